"""headmech: mechanistic analysis of attention heads.

Stream per-head statistics through TransformerLens hooks, classify heads into a cited
catalog of types, and measure what each head does.

Examples:
    >>> import headmech  # doctest: +SKIP
    >>> model = headmech.load_model("minilm-l6")  # doctest: +SKIP
    >>> catalog = headmech.classify(model)  # doctest: +SKIP
"""

from __future__ import annotations

from headmech._version import __version__
from headmech.classify import HeadCatalog, TypeResult, classify
from headmech.engine import HeadStats, ProbeBatch, Reducer, stream_statistics, target_reducer
from headmech.errors import HeadmechError
from headmech.examples import show
from headmech.heads import HeadIndex, HeadType, get_head_type, head_types
from headmech.models import ModelInfo, list_models, load_hf, load_model, model_info

__all__ = [
    "HeadCatalog",
    "HeadIndex",
    "HeadStats",
    "HeadType",
    "HeadmechError",
    "ModelInfo",
    "ProbeBatch",
    "Reducer",
    "TypeResult",
    "__version__",
    "classify",
    "get_head_type",
    "head_types",
    "list_models",
    "load_hf",
    "load_model",
    "model_info",
    "show",
    "stream_statistics",
    "target_reducer",
]
