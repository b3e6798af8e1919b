"""KV plans: which KV heads keep the whole cache, and which keep sinks plus a window.

DuoAttention (Xiao et al. 2024) and RazorAttention (Tang et al. 2024) keep the full KV
cache only for retrieval heads and give every other head a small cache: the first
``sinks`` tokens (attention sinks, Xiao et al. 2023) and the ``window`` most recent ones.
A :class:`KVPlan` says which, per layer and **KV head**: under grouped-query attention the
query heads of a group share one cache, so a KV head is full if any of its query heads
needs it (query head ``h`` reads KV head ``h // (n_heads / n_kv_heads)``).

Plans come from a catalog (:meth:`KVPlan.from_catalog`: labelled heads of the named
types, or the best-scoring KV heads that fit a memory budget), any head set
(:meth:`KVPlan.from_heads`), or at random, as many full KV heads per layer as another
plan (:meth:`KVPlan.random_matched`, the control); ``plan.json`` keeps the provenance.

References:
    Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval
    and Streaming Heads", arXiv:2410.10819; Tang et al. 2024, "RazorAttention: Efficient
    KV Cache Compression Through Retrieval Heads", arXiv:2407.15891; Xiao et al. 2023,
    "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool
from torch import Tensor

from headmech.core.errors import InputError, KVPlanFileError
from headmech.core.head_index import HeadIndex, check_heads
from headmech.kv.budget import (
    kv_ranking,
    model_shape,
    model_windows,
    positive_int,
    split_beyond_windows,
    split_budget,
)
from headmech.runs.files import FileSchema, ResultFile
from headmech.runs.provenance import check_weights

if TYPE_CHECKING:
    from headmech.classification.results import HeadCatalog

__all__ = ["PLAN_SCHEMA", "KVPlan", "kv_ranking", "split_budget"]

PLAN_SCHEMA = "1"
# plan.json; a corrupt one is a KVPlanFileError (an InputError)
PLAN_FILE = FileSchema(
    "KV plan", "plan.json", PLAN_SCHEMA, required=("model", "full", "sinks", "window"),
    error=KVPlanFileError,
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class KVPlan(ResultFile):
    """Per layer and KV head: the whole cache (True) or ``sinks`` + ``window`` tokens.

    A windowed head's query at position ``t`` sees the keys at positions ``< sinks`` and
    ``t - window .. t``; its cache holds ``sinks + window`` entries between steps.

    Attributes:
        full: ``[n_layers, n_kv_heads]``, True where the KV head keeps the whole cache.
        n_heads: query heads per layer.
        sinks: first tokens every windowed head keeps.
        window: most recent tokens every windowed head keeps.
        model: the model's name.
        source: how the plan was chosen (kind, catalog, types, seed, budget, ...).
        provenance: the model's weights and versions (:func:`headmech.runs.provenance.provenance`).
        windows: per layer, the model's own sliding window (0: global; empty: no layer
            has one, :func:`~headmech.kv.budget.model_windows`). Such a layer caches only
            its window whatever the plan says, and the plan's sizes count that.
    """

    full: Bool[Tensor, "n_layers n_kv_heads"]
    n_heads: int
    sinks: int = 4
    window: int = 256
    model: str = "model"
    source: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        positive_int(self.sinks, "sinks", 0)
        positive_int(self.window, "window", 1)
        full = torch.as_tensor(self.full, dtype=torch.bool).cpu()
        if full.dim() != 2 or min(full.shape) < 1 or self.n_heads % full.shape[1]:
            raise InputError(f"a KV plan needs [n_layers, n_kv_heads] dividing {self.n_heads}")
        object.__setattr__(self, "full", full)
        windows = tuple(int(w) for w in self.windows) if any(self.windows) else ()
        if windows and len(windows) != full.shape[0]:
            raise InputError(f"a KV plan of {full.shape[0]} layers needs as many windows")
        object.__setattr__(self, "windows", windows)

    # --- shape ---------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """Layers."""
        return int(self.full.shape[0])

    @property
    def n_kv_heads(self) -> int:
        """KV heads per layer."""
        return int(self.full.shape[1])

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_full(self) -> int:
        """KV heads (all layers) that keep the whole cache."""
        return int(self.full.sum())

    def query_full(self) -> Bool[Tensor, "n_layers n_heads"]:
        """Per query head: whether its KV head keeps the whole cache."""
        return self.full.repeat_interleave(self.group, dim=1)

    def full_heads(self) -> list[tuple[int, int]]:
        """The full ``(layer, kv_head)`` pairs."""
        return [(int(a), int(b)) for a, b in self.full.nonzero().tolist()]

    def per_layer(self) -> list[int]:
        """Full KV heads in each layer."""
        return [int(n) for n in self.full.sum(1)]

    def _own(self, layer: int, seen: int) -> int:
        """Positions layer ``layer`` caches per KV head with the whole cache."""
        w = self.windows[layer] if self.windows else 0
        return min(seen, w) if w else seen

    def cache_entries(self, seen: int) -> int:
        """Cached positions over all layers and KV heads after ``seen`` tokens."""
        total = 0
        for layer, n in enumerate(self.per_layer()):
            own = self._own(layer, seen)
            total += n * own + (self.n_kv_heads - n) * min(own, self.sinks + self.window)
        return total

    def own_entries(self, seen: int) -> int:
        """Cached positions of the model's own cache (its sliding windows kept)."""
        return self.n_kv_heads * sum(self._own(la, seen) for la in range(self.n_layers))

    def kv_fraction(self, seen: int) -> float:
        """The cache's size after ``seen`` tokens as a fraction of the model's own cache
        (the whole cache, or for a model with sliding-window layers, those layers'
        windows and the other layers' whole cache: what the plan saves beyond them)."""
        return self.cache_entries(seen) / max(self.own_entries(seen), 1)

    def check_model(self, model: Any, *, force: bool = False) -> None:
        """Refuse a model of another shape or (unless ``force``) other weights."""
        name, n_layers, n_heads, n_kv = model_shape(model)
        if (n_layers, n_heads, n_kv) != (self.n_layers, self.n_heads, self.n_kv_heads):
            raise InputError(
                f"the KV plan is for {self.n_layers} layers x {self.n_heads} heads "
                f"({self.n_kv_heads} KV heads), {name} has {n_layers} x {n_heads} ({n_kv})"
            )
        if not force and hasattr(model, "cfg"):
            check_weights(self.provenance, model, f"the KV plan of {self.model}")

    # --- constructors --------------------------------------------------------------
    @classmethod
    def from_heads(
        cls,
        model: Any,
        heads: Iterable[HeadIndex | Sequence[int] | str] | str,
        *,
        sinks: int = 4,
        window: int = 256,
        source: dict[str, Any] | None = None,
    ) -> KVPlan:
        """Full cache for the KV heads of the given **query** heads (``(layer, head)``
        pairs or ``"L18H6"`` strings), sinks + window elsewhere."""
        name, n_layers, n_heads, n_kv = model_shape(model)
        full = torch.zeros(n_layers, n_kv, dtype=torch.bool)
        for layer, head in check_heads(heads, None, None, "KVPlan.from_heads"):
            if not (layer < n_layers and head < n_heads):
                raise InputError(f"head L{layer}H{head} is not in a {n_layers}x{n_heads} model")
            full[layer, head // (n_heads // n_kv)] = True
        src = {"kind": "heads"} if source is None else dict(source)
        windows = model_windows(model)
        return cls(full, n_heads, sinks, window, name, src, _provenance(model), windows)

    @classmethod
    def windowed(cls, model: Any, *, sinks: int = 4, window: int = 256) -> KVPlan:
        """Every head windowed (StreamingLLM)."""
        return cls.from_heads(model, [], sinks=sinks, window=window, source={"kind": "windowed"})

    @classmethod
    def full_cache(cls, model: Any) -> KVPlan:
        """Every head full: the uncompressed model."""
        _, n_layers, n_heads, _ = model_shape(model)
        heads = [(la, h) for la in range(n_layers) for h in range(n_heads)]
        return cls.from_heads(model, heads, source={"kind": "full"})

    @classmethod
    def from_catalog(
        cls,
        catalog: HeadCatalog | str | os.PathLike,
        model: Any,
        types: Sequence[str] = ("retrieval",),
        *,
        sinks: int = 4,
        window: int = 256,
        budget: float | None = None,
        context: int | None = None,
        fill: str = "heads",
        force: bool = False,
    ) -> KVPlan:
        """Full cache for catalogued heads.

        Args:
            catalog: a :class:`~headmech.classification.results.HeadCatalog` or its ``catalog.json``/folder.
            model: the model the plan is for (the catalog must describe it).
            types: head types whose heads keep the whole cache.
            sinks, window: what every other head keeps (at least, with a budget).
            budget: a fraction of the whole cache at ``context`` tokens to spend
                (:func:`split_budget`). ``fill="heads"``: ignore the labels, keep as many
                KV heads full, best :func:`kv_ranking` first, as leave the others
                ``window``, then widen their window; ``fill="window"``: keep the labelled
                heads' KV heads full and widen every other window to spend the rest.
            force: apply a catalog computed on other weights.
        """
        from headmech.classification.results import HeadCatalog

        cat = catalog if isinstance(catalog, HeadCatalog) else HeadCatalog.load(catalog)
        _check_catalog(cat, model, types, force)
        src: dict[str, Any] = {"kind": "catalog", "types": list(types)}
        if not isinstance(catalog, HeadCatalog):
            src["catalog"] = str(catalog)
        if budget is None:
            heads = [h for t in types for h in cat.heads(t)]
            return cls.from_heads(model, heads, sinks=sinks, window=window, source=src)
        if context is None:
            raise InputError("a budget needs the context length it is measured at")
        _, n_layers, n_heads, n_kv = model_shape(model)
        group = n_heads // n_kv
        src.update(budget=budget, context=context, fill=fill)
        if fill == "window":
            heads = [h for t in types for h in cat.heads(t)]
            n = cls.from_heads(model, heads).n_full
            _, w = split_budget(budget, context, n_layers * n_kv, sinks, window, n_full=n)
            return cls.from_heads(model, heads, sinks=sinks, window=w, source=src)
        if fill != "heads":
            raise InputError(f"fill is 'heads' or 'window', got {fill!r}")
        ranking = kv_ranking(cat, types, group)
        return cls.from_ranking(
            model, ranking, budget, context, sinks=sinks, window=window, source=src
        )

    @classmethod
    def from_ranking(
        cls,
        model: Any,
        ranking: Sequence[tuple[int, int]],
        budget: float,
        context: int,
        *,
        sinks: int = 4,
        window: int = 256,
        source: dict[str, Any] | None = None,
    ) -> KVPlan:
        """The best-ranked KV heads full within ``budget`` (a fraction of the model's own
        cache at ``context`` tokens), as many as leave every other KV head ``sinks +
        window``; the others' window then widens to spend the rest (:func:`split_budget`).

        ``ranking`` lists ``(layer, kv_head)`` pairs, best first. A layer with its own
        sliding window (:func:`~headmech.kv.budget.model_windows`) keeps it: the plan
        chooses among the other layers' KV heads, and the budget is what is left after
        the windowed layers' caches.
        """
        _, n_layers, n_heads, n_kv = model_shape(model)
        windows = model_windows(model) or (0,) * n_layers
        glob, k, w = split_beyond_windows(budget, context, windows, n_kv, sinks, window, ranking)
        group = n_heads // n_kv
        heads = [
            HeadIndex(la, kv * group)
            for la in range(n_layers)
            if la not in glob
            for kv in range(n_kv)
        ]
        heads += [HeadIndex(la, kv * group) for la, kv in ranking if la in glob][:k]
        src: dict[str, Any] = {"kind": "ranking"} if source is None else dict(source)
        src.update(budget=budget, context=context)
        return cls.from_heads(model, heads, sinks=sinks, window=w, source=src)

    def random_matched(self, generator: torch.Generator, draw: int | None = None) -> KVPlan:
        """As many full KV heads in each layer as this plan, drawn uniformly in the layer."""
        full = torch.zeros_like(self.full)
        for layer, n in enumerate(self.per_layer()):
            full[layer, torch.randperm(self.n_kv_heads, generator=generator)[:n]] = True
        src = {"kind": "random_matched", "matched": dict(self.source), "draw": draw}
        return KVPlan(
            full, self.n_heads, self.sinks, self.window, self.model, src, self.provenance,
            self.windows,
        )  # fmt: skip

    # --- JSON (headmech.runs.files: the header, save, load, equality) -----------
    SCHEMA = PLAN_FILE

    def _body(self) -> dict[str, Any]:
        """The ``plan.json`` contents but for the header."""
        contexts = (2048, 4096, 8192, 32768)
        model: dict[str, Any] = {
            "name": self.model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
        }
        if self.windows:
            model["windows"] = list(self.windows)
        return {
            "model": model,
            "sinks": self.sinks,
            "window": self.window,
            "full": [list(p) for p in self.full_heads()],
            "summary": {
                "n_full": self.n_full,
                "n_kv_heads_total": self.full.numel(),
                "kv_fraction": {str(c): self.kv_fraction(c) for c in contexts},
            },
            "source": self.source,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``plan.json`` (a folder gets ``plan.json`` inside); returns its path."""
        return super().save(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> KVPlan:
        """Read a ``plan.json`` (or a folder holding one); one-line errors if corrupt."""
        return super().load(path)

    @classmethod
    def _from_json(cls, data: dict[str, Any]) -> KVPlan:
        m = data["model"]
        n_layers, n_heads, n_kv = (int(m[k]) for k in ("n_layers", "n_heads", "n_kv_heads"))
        full = torch.zeros(n_layers, n_kv, dtype=torch.bool)
        for layer, kv in data["full"]:
            full[int(layer), int(kv)] = True
        return cls(
            full, n_heads, int(data["sinks"]), int(data["window"]), str(m["name"]),
            dict(data.get("source", {})), dict(data.get("provenance", {})),
            tuple(int(w) for w in m.get("windows", ())),
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"KVPlan({self.model}: {self.n_full} of {self.full.numel()} KV heads full, "
            f"sinks {self.sinks}, window {self.window})"
        )


def _check_catalog(cat: HeadCatalog, model: Any, types: Sequence[str], force: bool) -> None:
    name, n_layers, n_heads, _ = model_shape(model)
    if (cat.model.n_layers, cat.model.n_heads) != (n_layers, n_heads):
        raise InputError(
            f"the catalog describes {cat.model.name}, a model of {cat.model.n_layers}x"
            f"{cat.model.n_heads} heads; {name} has {n_layers}x{n_heads}"
        )
    if not types:
        raise InputError("name at least one head type for the plan")
    missing = [t for t in types if t not in cat.types]
    if missing:
        have = ", ".join(cat.types) or "none"
        raise InputError(f"the catalog has no type {', '.join(missing)} (it has: {have})")
    if hasattr(model, "cfg"):  # other weights refused, another name without a hash warned
        cat.check_model(model, force=force)


def _provenance(model: Any) -> dict[str, Any]:
    """The model part of the provenance record (bridges only: their weights are hashed)."""
    if not hasattr(model, "cfg"):
        return {}
    from headmech.runs.provenance import provenance

    rec = provenance(model)
    rec.pop("probes", None)
    rec.pop("probe_options", None)
    return rec
