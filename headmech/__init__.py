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
from headmech.classification.classify import HeadCatalog, TypeResult, classify
from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex
from headmech.core.progress import import_tqdm_quietly as _import_tqdm_quietly
from headmech.headtypes.registry import HeadType, get_head_type, head_types
from headmech.models import ModelInfo, list_models, load_hf, load_model, model_info
from headmech.publish.examples import show
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer, stream_statistics, target_reducer

_import_tqdm_quietly()  # a notebook without ipywidgets: bars on stderr, no TqdmWarning block

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
