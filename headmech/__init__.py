"""headmech: mechanistic analysis of attention heads.

Stream per-head statistics through TransformerLens hooks, classify heads into a cited
catalog of types, and measure what each head does.

Examples:
    >>> import headmech  # doctest: +SKIP
    >>> model = headmech.load_model("minilm-l6")  # doctest: +SKIP
    >>> catalog = headmech.classify(model)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from headmech._version import __version__

# public name -> the module that defines it: imported on first use (PEP 562), so that
# `headmech --help`, `headmech types` and a mistyped command answer without importing torch
_LAZY = {
    "HeadCatalog": "headmech.classification.classify",
    "TypeResult": "headmech.classification.classify",
    "classify": "headmech.classification.classify",
    "HeadmechError": "headmech.core.errors",
    "HeadIndex": "headmech.core.head_index",
    "HeadType": "headmech.headtypes.registry",
    "get_head_type": "headmech.headtypes.registry",
    "head_types": "headmech.headtypes.registry",
    "ModelInfo": "headmech.models",
    "list_models": "headmech.models",
    "load_hf": "headmech.models",
    "load_model": "headmech.models",
    "model_info": "headmech.models",
    "show": "headmech.publish.show",
    "HeadStats": "headmech.stream.engine",
    "ProbeBatch": "headmech.stream.engine",
    "Reducer": "headmech.stream.engine",
    "stream_statistics": "headmech.stream.engine",
    "target_reducer": "headmech.stream.engine",
}

if TYPE_CHECKING:
    from headmech.classification.classify import HeadCatalog, TypeResult, classify
    from headmech.core.errors import HeadmechError
    from headmech.core.head_index import HeadIndex
    from headmech.headtypes.registry import HeadType, get_head_type, head_types
    from headmech.models import ModelInfo, list_models, load_hf, load_model, model_info
    from headmech.publish.show import show
    from headmech.stream.engine import (
        HeadStats,
        ProbeBatch,
        Reducer,
        stream_statistics,
        target_reducer,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'headmech' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    if module != "headmech.core.errors":
        from headmech.core.progress import import_tqdm_quietly

        import_tqdm_quietly()  # a notebook without ipywidgets: bars on stderr, no TqdmWarning
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
