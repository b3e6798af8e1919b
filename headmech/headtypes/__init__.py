"""Head types: the base class, the registry of types, and one module per built-in type.

A contributor writes a :class:`HeadType` subclass (see README.md in this folder and
docs/contributing-head-types.md); :func:`head_types` and :func:`get_head_type` look the
registered ones up; :func:`load_catalog_folder` adds the types of a folder of files.

The head-type registry (:data:`headmech.core.registry.HEAD_TYPES`) imports this package before
its first lookup; importing it makes :func:`load_catalog` the registry's loader, which
registers the types defined in the modules here and in the ``$HEADMECH_CATALOG_PATH``
folders (the registry itself knows no head type: the layer that defines them fills it).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from headmech.core.head_index import HeadIndex
from headmech.core.registry import HEAD_TYPES, Registry
from headmech.headtypes.base import HeadType, at_or_above
from headmech.headtypes.registry import (
    collect_statistics,
    get_head_type,
    head_types,
    load_catalog_folder,
    load_catalog_path,
    register,
    types_in,
)

__all__ = [
    "HeadIndex",
    "HeadType",
    "at_or_above",
    "collect_statistics",
    "get_head_type",
    "head_types",
    "load_catalog",
    "load_catalog_folder",
    "register",
]


def load_catalog(registry: Registry[Any]) -> None:
    """Register the types of ``headmech/headtypes/`` and the ``$HEADMECH_CATALOG_PATH``
    folders (the head-type registry's loader; entry points follow)."""
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{mod.name}")
            for cls in types_in(module):
                registry.register(cls.name, cls, summary=cls.description)
    load_catalog_path(registry)


HEAD_TYPES.set_loader(load_catalog)
