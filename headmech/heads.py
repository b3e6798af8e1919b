"""Head types: the base class, the registry and discovery of the catalog.

A head type is one small class in ``headmech/catalog/`` (or in a third-party package
registered under the entry-point group ``headmech.head_types``, or in a ``.py`` file in a
folder listed in ``$HEADMECH_CATALOG_PATH``, which is how to try a new type before
contributing it). It declares

* ``name`` (snake_case, written once: it is the registry key), ``reference`` (paper, year)
  and ``citation``;
* ``probe``: the probe it is measured on (see :mod:`headmech.probes`);
* ``reducers()``: the per-head statistics the engine computes inside the hooks — most
  types only override :meth:`HeadType.targets`, "for each query, which key is the
  target?", and inherit the attention-mass reducer;
* ``score()``: statistics → ``[n_layers, n_heads]``; ``select()``: the decision rule with
  the paper's default threshold;
* ``details()``: type-specific evidence for ``catalog.json``;
* ``task``: the name of the task (:mod:`headmech.tasks`) whose metric ablating heads of
  this type should hurt (catalog validation).

Registration is explicit and needs no import order: the head-type registry
(:data:`headmech.registry.HEAD_TYPES`) imports every module of ``headmech/catalog/``, every
``.py`` file of the ``$HEADMECH_CATALOG_PATH`` folders and the entry points, and
registers each :class:`HeadType` subclass with a ``name`` defined there. A type defined
elsewhere (a notebook) is passed to :func:`headmech.classify` as a class or instance, or
registered with :func:`register`. A second class with the same name is refused.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import operator
import os
import pkgutil
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.engine import HeadStats, ProbeBatch, Reducer, target_reducer
from headmech.errors import (
    ArgumentError,
    HeadIndexError,
    HeadmechError,
    PluginError,
    UnknownHeadTypeError,
)

if TYPE_CHECKING:
    from headmech.models import ModelInfo
    from headmech.registry import Registry

__all__ = [
    "HeadIndex",
    "HeadType",
    "check_heads",
    "checked_score",
    "get_head_type",
    "head_types",
    "load_catalog",
    "load_catalog_folder",
    "register",
]

CATALOG_PATH_ENV = "HEADMECH_CATALOG_PATH"  # extra folders of head-type files (os.pathsep)


class HeadIndex(NamedTuple):
    """A head: ``(layer, head)``, both 0-indexed."""

    layer: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"


def check_heads(
    heads: Iterable[HeadIndex | Sequence[int]],
    n_layers: int | None,
    n_heads: int | None,
    what: str = "heads",
) -> list[HeadIndex]:
    """``heads`` as :class:`HeadIndex` es, each inside a model of ``n_layers`` x ``n_heads``
    (None: any size; negative indices are refused all the same).

    Raises:
        HeadIndexError: a head outside the model (negative indices included), or not a
            ``(layer, head)`` pair of integers, in one line naming it and the model's shape.
    """
    out = []
    for h in heads:
        try:
            layer, head = h
            pair = HeadIndex(_index(layer), _index(head))
        except (TypeError, ValueError):
            raise HeadIndexError(f"{what}: {h!r} is not a (layer, head) pair of integers") from None
        if n_layers is None or n_heads is None:
            if min(pair) < 0:
                raise HeadIndexError(
                    f"{what}: head ({pair.layer}, {pair.head}) has a negative index"
                )
        elif not (0 <= pair.layer < n_layers and 0 <= pair.head < n_heads):
            raise HeadIndexError(
                f"{what}: head ({pair.layer}, {pair.head}) is outside the model "
                f"({n_layers} layers x {n_heads} heads)"
            )
        out.append(pair)
    return out


def _index(value: Any) -> int:
    """An integer index (a Python, NumPy or 0-dim tensor integer; not a bool or a float)."""
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


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


def _threshold(t: HeadType, value: Any) -> float:
    """A threshold given to a head type: a finite number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not math.isfinite(number):
        name = getattr(type(t), "name", type(t).__name__)
        raise ArgumentError(
            f"the threshold of head type '{name}' must be a finite number, got {value!r}"
        )
    return number


def checked_score(t: HeadType, stats: HeadStats) -> tuple[Tensor, list[HeadIndex]]:
    """``t.score(stats)`` and ``t.select(score, stats)``, checked: the score a real
    ``[n_layers, n_heads]`` tensor, the selection heads inside the model.

    Raises:
        PluginError: one line naming the type, its class and method, what it returned and
            the shape expected (instead of a broadcasting error deep in torch).
    """
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
    the same name is refused: ``ValueError``)."""
    from headmech.registry import HEAD_TYPES

    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} must set a class attribute `name`")
    HEAD_TYPES.load()
    return HEAD_TYPES.register(name, cls, summary=cls.description)


class HeadType:
    """Base class of a catalog head type.

    Attributes:
        name: registry key, snake_case (``previous_token``).
        reference: short citation shown in tables (``"Olsson et al. 2022"``).
        citation: full reference.
        description: one sentence: what the head does.
        probe: the probe it is measured on.
        default_threshold: the anchor's decision threshold on :meth:`score`.
        causal_only: True for types that need a decoder (generation, next-token loss).
        task: the task whose metric validation measures (``lm``, ``induction``, ...).
        ablation: how validation removes the heads (``zero``, ``mean``, ``uniform``).
        threshold: the threshold in use (constructor argument, else the default).
        The constructor also takes ``probe`` to measure the type on another probe.
    """

    name: ClassVar[str]
    reference: ClassVar[str] = ""
    citation: ClassVar[str] = ""
    description: ClassVar[str] = ""
    probe: str = "prose"  # class default; the constructor may override it per instance
    default_threshold: ClassVar[float] = 0.5
    causal_only: ClassVar[bool] = False
    # the task whose metric (higher is worse) ablating heads of this type should hurt
    task: ClassVar[str] = "lm"
    ablation: ClassVar[str] = "zero"  # how validation removes heads (zero, mean, uniform)
    # True: ablating the heads should raise the task's metric (they serve the task);
    # False: lower it (they work against it, as negative name movers do)
    helps_task: ClassVar[bool] = True

    def __init__(self, threshold: float | None = None, *, probe: str | None = None) -> None:
        self.threshold = (
            self.default_threshold if threshold is None else _threshold(self, threshold)
        )
        if probe is not None:  # e.g. previous_token on repeated random tokens for a toy vocabulary
            self.probe = probe

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold})"

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """Per query, the target key position (``Int[batch, query_pos]``, -1 = none) or
        set of positions (``Bool[batch, query_pos, key_pos]``)."""
        raise NotImplementedError(f"{type(self).__name__} must define targets() or reducers()")

    def reducers(self) -> list[Reducer]:
        """Statistics to stream; by default attention mass on :meth:`targets`."""
        return [target_reducer(self.name, self.targets)]

    def weight_statistics(self, model: Any) -> dict[str, Tensor]:
        """Per-head statistics from the weights rather than data (``[n_layers, n_heads]``
        each); stored in the stats as ``name.key``. Default: none."""
        return {}

    def ideal_weight_statistics(self) -> dict[str, float]:
        """Values of :meth:`weight_statistics` and :meth:`model_statistics` for a perfect
        head (positive controls)."""
        return {}

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        """Per-head statistics the type measures by running the model itself on its
        probe's batches — interventions such as patching, which no attention hook can
        stream (``[n_layers, n_heads]`` each, stored as ``name.key``). Default: none."""
        return {}

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        """The per-head score the threshold applies to (default: mean attention mass on target)."""
        return stats.mean(f"{self.name}.mass")

    def select(
        self, score: Float[Tensor, "n_layers n_heads"], stats: HeadStats | None = None
    ) -> list[HeadIndex]:
        """Heads whose score reaches the threshold, best first (``stats`` lets a type add
        conditions on other statistics)."""
        s = torch.nan_to_num(score, nan=float("-inf"))
        hits = (s >= self.threshold).nonzero().tolist()
        hits.sort(key=lambda lh: -float(s[lh[0], lh[1]]))
        return [HeadIndex(int(layer), int(head)) for layer, head in hits]

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        """Type-specific evidence for ``catalog.json``."""
        return {}

    def ideal_pattern(self, batch: ProbeBatch) -> Tensor:
        """The attention pattern ``[batch, query_pos, key_pos]`` of a perfect head of this
        type (used to plant the role in positive controls): uniform over the targets;
        queries without a target keep attending to themselves."""
        t = self.targets(batch)
        n = batch.input_ids.shape[1]
        if t.dtype != torch.bool:
            has = t >= 0
            t = torch.nn.functional.one_hot(t.clamp(min=0), n).bool() & has[..., None]
        t = t & batch.attention_mask.bool()[:, None, :]
        eye = torch.eye(n, dtype=torch.bool, device=t.device).expand_as(t)
        t = torch.where(t.any(-1, keepdim=True), t, eye)
        p = t.float()
        return p / p.sum(-1, keepdim=True)

    # --- behaviour ----------------------------------------------------------------
    def report(self, details: dict[str, Any]) -> list[str]:
        """Lines of type-specific evidence for the command line (default: none)."""
        return []

    def check_model(self, info: ModelInfo) -> str | None:
        """Why this type cannot run on the model, or None."""
        if self.causal_only and not info.causal:
            return f"head type '{self.name}' needs a causal (decoder) model"
        return None


def collect_statistics(
    types: Sequence[HeadType],
    model: Any,
    batches: Sequence[ProbeBatch],
    *,
    progress: bool | str = False,
) -> HeadStats:
    """Stream every type's reducers over the batches in one set of passes, then add
    their weight statistics and the statistics they measure with their own passes."""
    from headmech.engine import HeadStats, stream_statistics

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
    return stats


def _types_in(module: Any) -> list[type[HeadType]]:
    """The head types a module defines (subclasses with their own ``name``)."""
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, HeadType)
        and obj.__module__ == module.__name__
        and isinstance(obj.__dict__.get("name"), str)
    ]


def load_catalog(registry: Registry[Any]) -> None:
    """Register the types of ``headmech/catalog/`` and the ``$HEADMECH_CATALOG_PATH``
    folders (the head-type registry's loader; entry points follow)."""
    import headmech.catalog as catalog

    for mod in pkgutil.iter_modules(catalog.__path__):
        if not mod.name.startswith("_"):
            module = importlib.import_module(f"headmech.catalog.{mod.name}")
            for cls in _types_in(module):
                registry.register(cls.name, cls, summary=cls.description)
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
    from pathlib import Path

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
        found += _types_in(module)
    return found


def load_catalog_folder(folder: str | os.PathLike) -> list[str]:
    """Import every ``*.py`` file of a folder as head-type definitions and register them.

    Folders in ``$HEADMECH_CATALOG_PATH`` are loaded this way by the registry, so a new
    type can be written, checked and used (``headmech types``, ``headmech classify
    --types``) before it moves into ``headmech/catalog/``.

    Returns:
        The names of the head types the files define (registering the same definitions
        again is allowed: reloading a folder is idempotent).

    Raises:
        HeadmechError: the folder is missing, or a file fails to import (one line).
        PluginError: a file defines a type under a name another type has (one line
            naming both).
    """
    from headmech.registry import HEAD_TYPES

    found = _import_folder(folder)
    HEAD_TYPES.load()  # the built-ins first: a file may not take one of their names
    for cls in found:
        _register_from_file(HEAD_TYPES, cls)
    return sorted(cls.name for cls in found)


def head_types() -> dict[str, type[HeadType]]:
    """All registered head types, by name (catalog, catalog-path folders, entry points)."""
    from headmech.registry import HEAD_TYPES

    return {e.name: e.obj for e in HEAD_TYPES.entries()}


def get_head_type(name: str) -> type[HeadType]:
    """A registered type by name; a one-line error naming the known ones otherwise."""
    from headmech.registry import HEAD_TYPES

    return HEAD_TYPES.get(name)


def resolve_types(types: Sequence[str | HeadType | type[HeadType]] | str | None) -> list[HeadType]:
    """Names, classes or instances → instances (default threshold where not given)."""
    if types is None:
        return [cls() for cls in head_types().values()]
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
    out: list[HeadType] = []
    for t in types:
        if isinstance(t, HeadType):
            out.append(t)
        elif isinstance(t, type) and issubclass(t, HeadType):
            out.append(t())
        else:
            out.append(get_head_type(str(t))())
    return out
