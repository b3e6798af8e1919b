"""Head types: the registry, discovery of the catalog, and checks of what a type returns.

A head type is one small class in ``headmech/headtypes/`` (or in a third-party package
registered under the entry-point group ``headmech.head_types``, or in a ``.py`` file in a
folder listed in ``$HEADMECH_CATALOG_PATH``, which is how to try a new type before
contributing it): a subclass of :class:`HeadType` (:mod:`headmech.headtypes.base`, re-exported
here), which says what a type declares.

Registration is explicit and needs no import order: the head-type registry
(:data:`headmech.core.registry.HEAD_TYPES`) imports :mod:`headmech.headtypes`, whose loader
registers each :class:`HeadType` subclass with a ``name`` defined in the catalog's modules
and in the ``.py`` files of the ``$HEADMECH_CATALOG_PATH`` folders; entry points follow.
A type defined elsewhere (a notebook) is passed to :func:`headmech.classify` as a class or
instance, or registered with :func:`register`. A second class with the same name is refused.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headmech.core.errors import (
    ArgumentError,
    HeadIndexError,
    HeadmechError,
    PluginError,
    UnknownHeadTypeError,
)
from headmech.core.head_index import HeadIndex, check_heads
from headmech.core.registry import HEAD_TYPES, Registry, head_type_name
from headmech.headtypes.base import HeadType, checked_threshold
from headmech.stream.engine import HeadStats, ProbeBatch, stream_statistics

__all__ = [
    "HeadIndex",
    "HeadType",
    "check_heads",
    "checked_score",
    "get_head_type",
    "head_types",
    "load_catalog_folder",
    "load_catalog_path",
    "register",
    "types_in",
]

CATALOG_PATH_ENV = "HEADMECH_CATALOG_PATH"  # extra folders of head-type files (os.pathsep)


def _describe(value: Any) -> str:
    """``a float32 tensor of shape (2, 4)``, ``a float``: what a plug-in returned."""
    kind = (
        str(value.dtype).removeprefix("torch.")
        if isinstance(value, Tensor)
        else type(value).__name__
    )
    article = "an" if kind[0] in "aeiou" else "a"
    if isinstance(value, Tensor):
        return f"{article} {kind} tensor of shape {tuple(value.shape)}"
    return f"{article} {kind}"


def _method(t: HeadType, name: str) -> str:
    return f"head type '{t.name}' ({type(t).__qualname__}.{name})"


def checked_score(t: HeadType, stats: HeadStats) -> tuple[Tensor, list[HeadIndex]]:
    """``t.score(stats)`` and ``t.select(score, stats)``, checked: the score a real
    ``[n_layers, n_heads]`` tensor, the selection heads inside the model.

    Raises:
        PluginError: one line naming the type, its class and method, what it returned and
            the shape expected (instead of a broadcasting error deep in torch).
    """
    shape = (stats.n_layers, stats.n_heads)
    score = _score_only(t, stats)
    heads = t.select(score, stats)
    if not isinstance(heads, (list, tuple)):
        raise PluginError(
            f"{_method(t, 'select')} returned {_describe(heads)}; expected a list of (layer, head)"
        )
    try:
        heads = check_heads(heads, *shape, what=_method(t, "select"))
    except HeadIndexError as e:
        raise PluginError(str(e)) from None
    return score, heads


def _score_only(t: HeadType, stats: HeadStats) -> Tensor:
    """``t.score(stats)``, checked as :func:`checked_score` checks it."""
    shape = (stats.n_layers, stats.n_heads)
    score = t.score(stats)
    if (
        not isinstance(score, Tensor)
        or tuple(score.shape) != shape
        or score.is_complex()
        or score.dtype == torch.bool
    ):
        raise PluginError(
            f"{_method(t, 'score')} returned {_describe(score)}; expected a real tensor "
            f"[n_layers, n_heads] of shape {shape}"
        )
    return score


def _check_grid(t: HeadType, method: str, values: Any, shape: tuple[int, int]) -> dict[str, Tensor]:
    """What ``weight_statistics`` / ``model_statistics`` returned: ``{key: [n_layers, n_heads]}``."""
    if not isinstance(values, dict):
        raise PluginError(
            f"{_method(t, method)} returned {_describe(values)}; expected a dict of "
            f"[n_layers, n_heads] tensors of shape {shape}"
        )
    for key, value in values.items():
        if not isinstance(value, Tensor) or tuple(value.shape) != shape:
            raise PluginError(
                f"{_method(t, method)} returned '{key}' as {_describe(value)}; expected "
                f"[n_layers, n_heads] of shape {shape}"
            )
    return values


def register(cls: type[HeadType]) -> type[HeadType]:
    """Add a head type to the registry under its ``name`` (a second, different class with
    the same name is refused: ``ValueError``; a class without a ``name`` of its own:
    :class:`~headmech.core.errors.PluginError` naming the class and its file)."""
    if not (isinstance(cls, type) and issubclass(cls, HeadType)):
        raise PluginError(f"register() takes a HeadType subclass, got {cls!r}")
    name = head_type_name(cls, own=True)
    HEAD_TYPES.load()
    return HEAD_TYPES.register(name, cls, summary=cls.description)


def collect_statistics(
    types: Sequence[HeadType],
    model: Any,
    batches: Sequence[ProbeBatch],
    *,
    progress: bool | str = False,
) -> HeadStats:
    """Stream every type's reducers over the batches in one set of passes, then add
    their weight statistics and the statistics they measure with their own passes."""
    reducers = [r for t in types for r in t.reducers()]
    if reducers:
        stats = stream_statistics(model, batches, reducers, progress=progress, total=len(batches))
    else:  # weight-based types only: no forward pass to run
        stats = HeadStats(int(model.cfg.n_layers), int(model.cfg.n_heads))
    shape = (stats.n_layers, stats.n_heads)
    for t in types:
        for key, value in _check_grid(
            t, "weight_statistics", t.weight_statistics(model), shape
        ).items():
            stats.set(f"{t.name}.{key}", value)
        computed = t.model_statistics(model, batches)
        for key, value in _check_grid(t, "model_statistics", computed, shape).items():
            stats.set(f"{t.name}.{key}", value)
        if type(t).candidate_statistics is not HeadType.candidate_statistics:
            candidates = t.above(_score_only(t, stats))
            computed = t.candidate_statistics(model, batches, candidates)
            for key, value in _check_grid(t, "candidate_statistics", computed, shape).items():
                stats.set(f"{t.name}.{key}", value)
    return stats


def types_in(module: Any) -> list[type[HeadType]]:
    """The head types a module defines (subclasses with their own ``name``)."""
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, HeadType)
        and obj.__module__ == module.__name__
        and isinstance(obj.__dict__.get("name"), str)
    ]


def load_catalog_path(registry: Registry[Any]) -> None:
    """Register the types of the ``$HEADMECH_CATALOG_PATH`` folders (the head-type
    registry's loader, :func:`headmech.headtypes.load_catalog`, calls this after the
    package's own types; entry points follow)."""
    for folder in os.environ.get(CATALOG_PATH_ENV, "").split(os.pathsep):
        if folder:
            for cls in _import_folder(folder):
                _register_from_file(registry, cls)


def _register_from_file(registry: Registry[Any], cls: type[HeadType]) -> None:
    """Register a type defined in a head-type file; a name taken by another type (a
    built-in's, say) is refused in one line naming the file and both classes."""
    try:
        registry.register(cls.name, cls, summary=cls.description)
    except PluginError as e:
        path = getattr(sys.modules.get(cls.__module__), "__file__", cls.__module__)
        raise PluginError(f"head-type file {path}: {e}") from None


def _import_folder(folder: str | os.PathLike) -> list[type[HeadType]]:
    root = Path(folder)
    if not root.is_dir():
        raise HeadmechError(f"{CATALOG_PATH_ENV}: '{root}' is not a folder")
    found: list[type[HeadType]] = []
    for path in sorted(root.glob("*.py")):
        if path.name.startswith("_"):
            continue
        module_name = f"headmech_local_catalog.{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise HeadmechError(f"cannot import head-type file {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise HeadmechError(
                f"cannot import head-type file {path}: {type(e).__name__}: {e}"
            ) from None
        found += types_in(module)
    return found


def load_catalog_folder(folder: str | os.PathLike) -> list[str]:
    """Import every ``*.py`` file of a folder as head-type definitions and register them.

    Folders in ``$HEADMECH_CATALOG_PATH`` are loaded this way by the registry, so a new
    type can be written, checked and used (``headmech types``, ``headmech classify
    --types``) before it moves into ``headmech/headtypes/``.

    Returns:
        The names of the head types the files define (registering the same definitions
        again is allowed: reloading a folder is idempotent).

    Raises:
        HeadmechError: the folder is missing, or a file fails to import (one line).
        PluginError: a file defines a type under a name another type has (one line
            naming both).
    """
    found = _import_folder(folder)
    HEAD_TYPES.load()  # the built-ins first: a file may not take one of their names
    for cls in found:
        _register_from_file(HEAD_TYPES, cls)
    return sorted(cls.name for cls in found)


def head_types() -> dict[str, type[HeadType]]:
    """All registered head types, by name (catalog, catalog-path folders, entry points)."""
    return {e.name: e.obj for e in HEAD_TYPES.entries()}


def get_head_type(name: str) -> type[HeadType]:
    """A registered type by name; a one-line error naming the known ones otherwise."""
    return HEAD_TYPES.get(name)


def resolve_types(
    types: Sequence[str | HeadType | type[HeadType]] | str | None,
    thresholds: Mapping[str, float] | None = None,
) -> list[HeadType]:
    """Names, classes or instances → instances (default threshold where not given).

    Args:
        types: head type names (or one comma-separated string), classes or instances;
            None: every registered type.
        thresholds: ``{type name: threshold}`` for some of them (an instance given keeps
            its other settings: a copy gets the threshold).

    Raises:
        UnknownHeadTypeError: a name not registered (with a close name suggested).
        PluginError: a class without a ``name``, naming the class and its file.
        ArgumentError: a threshold for a type not among ``types``, or not a finite number
            within the type's range.
    """
    if types is None:
        out = [cls() for cls in head_types().values()]
        return _with_thresholds(out, thresholds)
    if isinstance(types, str):
        types = [t.strip() for t in types.split(",") if t.strip()]
        if not types:
            raise UnknownHeadTypeError("no head type given")
    elif isinstance(types, HeadType) or (isinstance(types, type) and issubclass(types, HeadType)):
        types = [types]  # one type given on its own
    elif not hasattr(types, "__iter__"):
        raise ArgumentError(
            f"types must be a list of head type names, classes or instances, got {type(types).__name__}"
        )
    types = list(types)
    if not types:
        raise ArgumentError(
            "types is an empty list: name at least one head type (None: every type)"
        )
    out = []
    for t in types:
        if isinstance(t, HeadType):
            head_type_name(t)  # a contributed class without a name: one line naming its file
            out.append(t)
        elif isinstance(t, type) and issubclass(t, HeadType):
            head_type_name(t)
            out.append(t())
        else:
            out.append(get_head_type(str(t))())
    return _with_thresholds(out, thresholds)


def _with_thresholds(
    types: list[HeadType], thresholds: Mapping[str, float] | None
) -> list[HeadType]:
    """``types`` with the thresholds of ``thresholds`` (each name a registered type among
    ``types``, each value a finite number in the type's range)."""
    if thresholds is None:
        return types
    if not isinstance(thresholds, Mapping):
        raise ArgumentError(
            "thresholds must be a dict of head type name to threshold, e.g. "
            f"{{'previous_token': 0.3}}, got {type(thresholds).__name__}"
        )
    by_name = {t.name: t for t in types}
    for name in thresholds:
        if not isinstance(name, str) or name not in by_name:
            if not isinstance(name, str) or name not in HEAD_TYPES:
                HEAD_TYPES.entry(str(name))  # unknown: one line, with a close name suggested
            raise ArgumentError(
                f"thresholds names head type '{name}', which is not classified here "
                f"(types: {', '.join(by_name)})"
            )
    out = []
    for t in types:
        if t.name in thresholds:
            value = checked_threshold(t, thresholds[t.name])
            t = copy.copy(t)
            t.threshold = value
        out.append(t)
    return out
