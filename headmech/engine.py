"""Streaming per-head statistics through hooks.

The idea: instead of caching every layer's attention pattern (``run_with_cache`` keeps
``n_layers x batch x n_heads x pos x pos`` floats alive), reduce each layer's pattern to a
few numbers per head *inside its hook*, then let the tensor go. What survives a batch is
a set of per-head sums and counts, ``[n_layers, n_heads]`` each, so batches (and data
shards on other machines) merge by addition and memory stays at one layer's pattern.

A :class:`Reducer` names the hook it reads (``hook_pattern`` by default, ``hook_z`` for
head outputs), an optional ``prepare`` run once per batch (for example the per-query
target positions, shared by every layer), and a function that returns, for one layer,
``{stat: (sum[n_heads], count)}``. The most common reducer is :func:`target_reducer`:
"for each query position, which key positions are the target?" — it measures the
attention mass on the target and how often the head's argmax hits it.

Grouped-query attention needs no special case here: ``hook_pattern`` and ``hook_z`` are
per query head, so every statistic is ``[n_layers, n_heads]`` with ``n_heads`` query heads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech import distributed
from headmech.forward import bare_forward, run_blocks

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "HeadStats",
    "ProbeBatch",
    "Reducer",
    "bare_forward",
    "run_blocks",
    "stream_statistics",
    "target_reducer",
]


@dataclass
class ProbeBatch:
    """One padded batch of probe data (right padding).

    Attributes:
        input_ids: token ids.
        attention_mask: 1 for real tokens, 0 for padding.
        special: True at special tokens (BOS/CLS/SEP/EOS) and padding; such positions are
            excluded as queries and as targets by the built-in reducers.
        extras: probe-specific per-batch data (word ids, repeat offsets, ...).
    """

    input_ids: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    special: Bool[Tensor, "batch pos"]
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> ProbeBatch:
        """The batch with every tensor on ``device``."""
        return ProbeBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.special.to(device),
            {k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.extras.items()},
        )


# fn(activation, batch, prepared, layer) -> {stat: (sum over queries [batch, n_heads], count)}
ReduceFn = Callable[[Tensor, ProbeBatch, Any, int], Mapping[str, tuple[Tensor, Tensor | float]]]


@dataclass(frozen=True)
class Reducer:
    """A per-head statistic computed inside a hook.

    Attributes:
        name: prefix of the statistics it produces (``name.stat``).
        fn: ``fn(activation, batch, prepared, layer)`` → ``{stat: (sum, count)}``, per
            sequence: ``sum`` is ``[batch, n_heads]`` and ``count`` ``[batch]`` or ``[batch,
            n_heads]`` (per-sequence sums let :mod:`headmech.uncertainty` resample the probe's
            examples); a reducer with no per-sequence view may return ``[n_heads]`` and a
            scalar or ``[n_heads]`` count instead. It must not modify ``activation``.
        prepare: ``prepare(batch)`` → anything, run once per batch (not once per layer).
        hook: the attention hook it reads: ``"hook_pattern"``
            (``[batch, head_index, query_pos, key_pos]``) or ``"hook_z"``
            (``[batch, pos, head_index, d_head]``).
    """

    name: str
    fn: ReduceFn
    prepare: Callable[[ProbeBatch], Any] | None = None
    hook: str = "hook_pattern"


class HeadStats:
    """Named per-head sums and counts, each ``[n_layers, n_heads]`` in float64.

    Sums and counts merge by addition (``a + b``), so statistics from batches, probes or
    machines combine exactly; :meth:`mean` divides at the end. Where reducers give
    per-sequence sums, those are kept too (:meth:`units`), so a score can be recomputed on
    a resample of the probe's sequences (:meth:`resample`; bootstrap intervals).
    """

    def __init__(self, n_layers: int, n_heads: int) -> None:
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.sums: dict[str, Float[Tensor, "n_layers n_heads"]] = {}
        self.counts: dict[str, Float[Tensor, "n_layers n_heads"]] = {}
        # name -> layer -> per batch: (sums [batch, n_heads], counts [batch, n_heads])
        self._units: dict[str, list[list[tuple[Tensor, Tensor]]]] = {}
        self._stacked: dict[str, tuple[Tensor, Tensor]] = {}  # units(), built once

    def _zeros(self) -> Tensor:
        return torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)

    def add(self, name: str, layer: int, total: Tensor, count: Tensor | float) -> None:
        """Add one layer's sums ``total`` — per sequence ``[batch, n_heads]``, or
        ``[n_heads]`` — and their ``count`` (``[batch]``, ``[batch, n_heads]``, ``[n_heads]``
        or a scalar)."""
        if name not in self.sums:
            self.sums[name] = self._zeros()
            self.counts[name] = self._zeros()
        total = total.detach().to("cpu", torch.float64)
        if isinstance(count, Tensor):
            count = count.detach().to("cpu", torch.float64)
        if total.dim() == 2:  # per sequence
            c = torch.as_tensor(count, dtype=torch.float64)
            c = (c[:, None] if c.dim() == 1 else c).expand_as(total)
            rows = self._units.setdefault(name, [[] for _ in range(self.n_layers)])
            rows[layer].append((total, c))
            self._stacked.pop(name, None)
            total, count = total.sum(0), c.sum(0)
        self.sums[name][layer] += total
        self.counts[name][layer] += count

    def units(self, name: str) -> tuple[Tensor, Tensor] | None:
        """Per-sequence sums and counts ``[n_units, n_layers, n_heads]`` of a statistic, or
        None where its reducer gave only totals (layers it did not see are zero)."""
        rows = self._units.get(name)
        if rows is None:
            return None
        if name in self._stacked:
            return self._stacked[name]
        n_units = max(sum(t.shape[0] for t, _ in layer) for layer in rows)
        sums = torch.zeros(n_units, self.n_layers, self.n_heads, dtype=torch.float64)
        counts = torch.zeros_like(sums)
        for la, layer in enumerate(rows):
            if layer:
                sums[:, la] = torch.cat([t for t, _ in layer])
                counts[:, la] = torch.cat([c for _, c in layer])
        self._stacked[name] = (sums, counts)
        return sums, counts

    @property
    def n_units(self) -> int:
        """Sequences with per-sequence statistics (0: none kept)."""
        names = list(self._units)
        return 0 if not names else int(self.units(names[0])[0].shape[0])  # type: ignore[index]

    def resample(self, weights: Float[Tensor, " n_units"]) -> HeadStats:
        """The statistics of a reweighted probe (bootstrap: how often each sequence is
        drawn); statistics without per-sequence sums are kept as they are."""
        out = HeadStats(self.n_layers, self.n_heads)
        w = weights.to(torch.float64)
        for name in self.sums:
            unit = self.units(name)
            if unit is None:
                out.sums[name], out.counts[name] = self.sums[name], self.counts[name]
            else:
                out.sums[name] = torch.einsum("u,ulh->lh", w, unit[0])
                out.counts[name] = torch.einsum("u,ulh->lh", w, unit[1])
        return out

    def set(self, name: str, value: Float[Tensor, "n_layers n_heads"]) -> None:
        """Store a per-head value computed once (from weights), with count 1."""
        self.sums[name] = value.detach().to("cpu", torch.float64).clone()
        self.counts[name] = torch.ones_like(self.sums[name])

    def mean(self, name: str) -> Float[Tensor, "n_layers n_heads"]:
        """Sum / count; NaN where a head saw no query for this statistic."""
        if name not in self.sums:
            raise KeyError(f"no statistic '{name}' (have: {', '.join(sorted(self.sums))})")
        return (self.sums[name] / self.counts[name]).float()

    def __contains__(self, name: str) -> bool:
        return name in self.sums

    def __add__(self, other: HeadStats) -> HeadStats:
        if (self.n_layers, self.n_heads) != (other.n_layers, other.n_heads):
            raise ValueError("cannot merge statistics of models of different shapes")
        out = HeadStats(self.n_layers, self.n_heads)
        for src in (self, other):
            for k in src.sums:
                if k not in out.sums:
                    out.sums[k], out.counts[k] = out._zeros(), out._zeros()
                out.sums[k] += src.sums[k]
                out.counts[k] += src.counts[k]
            for k, rows in src._units.items():
                mine = out._units.setdefault(k, [[] for _ in range(out.n_layers)])
                for la, layer in enumerate(rows):
                    mine[la] += layer
                out._stacked.pop(k, None)
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """Flat tensors for ``safetensors.torch.save_file``."""
        return {
            **{f"sum/{k}": v for k, v in self.sums.items()},
            **{f"count/{k}": v for k, v in self.counts.items()},
        }

    def __repr__(self) -> str:
        return f"HeadStats({self.n_layers}x{self.n_heads}: {', '.join(sorted(self.sums))})"


def target_reducer(
    name: str,
    targets: Callable[[ProbeBatch], Tensor],
) -> Reducer:
    """Attention mass on, and argmax hits of, per-query target positions.

    Args:
        name: statistic prefix; produces ``name.mass``, ``name.hit`` (means over the
            queries that have a target) and ``name.rows`` (mass summed over every real
            query, divided by all real queries — TransformerLens' "mul" score when the
            pattern rows sum to one).
        targets: ``targets(batch)`` returns either ``Int[batch, query_pos]`` (one key
            position per query, -1 for none) or ``Bool[batch, query_pos, key_pos]`` (a set
            of target keys per query; empty rows have no target).

    Returns:
        A :class:`Reducer` on ``hook_pattern``.
    """

    def prepare(batch: ProbeBatch) -> tuple[Tensor, Tensor, Tensor]:
        t = targets(batch)
        real_query = batch.attention_mask.bool()
        if t.dtype == torch.bool:
            mask = t & batch.attention_mask.bool()[:, None, :]  # [batch, query_pos, key_pos]
            has = mask.any(-1) & real_query
        else:
            has = (t >= 0) & real_query
            mask = torch.zeros(*t.shape, t.shape[-1], dtype=torch.bool, device=t.device)
            idx = t.clamp(min=0)
            mask.scatter_(-1, idx[..., None], has[..., None])
        return mask, has, real_query

    def fn(pattern: Tensor, batch: ProbeBatch, prepared: Any, layer: int) -> dict:
        mask, has, real_query = prepared
        # pattern: [batch, head_index, query_pos, key_pos]
        m = mask[:, None].to(pattern.dtype)
        mass = (pattern * m).sum(-1)  # [batch, head_index, query_pos]
        hit = mask[:, None].expand_as(pattern).gather(-1, pattern.argmax(-1, keepdim=True))[..., 0]
        w = has[:, None].to(pattern.dtype)
        n = has.sum(1)  # [batch]: per sequence
        return {
            "mass": ((mass * w).sum(2), n),
            "hit": ((hit.to(pattern.dtype) * w).sum(2), n),
            "rows": ((mass * real_query[:, None]).sum(2), real_query.sum(1)),
        }

    return Reducer(name, fn, prepare)


def _layer_of(hook_name: str) -> int:
    return int(hook_name.split(".")[1])


def _reduce_hooks(
    reducers: Sequence[Reducer],
    layers: Sequence[int],
    stats: HeadStats,
    state: dict[str, Any],
) -> list[tuple[str, Callable[..., None]]]:
    """One read-only hook per (attention hook kind, layer), running its reducers on the
    current batch (``state["batch"]``) with their prepared data (``state["prepared"]``)."""

    def make_hook(group: list[Reducer]) -> Callable[..., None]:
        def hook_fn(activation: Tensor, *, hook: Any) -> None:
            layer = _layer_of(hook.name)
            for r in group:
                # reductions in fp32 whatever the model's dtype (a no-op for fp32 models)
                act = activation.detach().float()
                out = r.fn(act, state["batch"], state["prepared"][r.name], layer)
                for stat, (total_, count) in out.items():
                    stats.add(f"{r.name}.{stat}", layer, total_, count)
            return None  # read-only: the forward pass is unchanged

        return hook_fn

    by_hook: dict[str, list[Reducer]] = {}
    for r in reducers:
        by_hook.setdefault(r.hook, []).append(r)
    return [
        (f"blocks.{layer}.attn.{hook}", make_hook(group))
        for hook, group in by_hook.items()
        for layer in layers
    ]


def stream_statistics(
    model: TransformerBridge,
    batches: Iterable[ProbeBatch],
    reducers: Sequence[Reducer],
    *,
    layers: Sequence[int] | None = None,
    progress: bool | str = False,
    total: int | None = None,
) -> HeadStats:
    """Run batches through the model and reduce attention to per-head statistics.

    No activation cache is kept: each reducer sees one layer's activation inside its hook.
    The forward pass stops after the last block (the unembedding is never computed:
    :func:`run_blocks`).

    Args:
        model: a ``TransformerBridge``.
        batches: probe batches (right-padded).
        reducers: statistics to compute; they share the forward passes.
        layers: restrict to these layers (default all).
        progress: show a tqdm bar (a string is used as its description).
        total: number of batches, for the bar.

    Returns:
        :class:`HeadStats` with ``reducer.stat`` entries. Under ``torchrun`` each rank
        streams its share of the batches and every rank returns the sum over all ranks
        (:mod:`headmech.distributed`).
    """
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    stats = HeadStats(n_layers, n_heads)
    layers = list(range(n_layers)) if layers is None else list(layers)
    device = next(model.parameters()).device
    names = [r.name for r in reducers]
    if len(set(names)) != len(names):
        raise ValueError(f"reducer names must be unique, got {names}")
    state: dict[str, Any] = {"prepared": {}}
    fwd_hooks = _reduce_hooks(reducers, layers, stats, state)
    rank, world = distributed.world()  # under torchrun: batch i on rank i mod world
    iterator: Iterable[ProbeBatch] = batches
    if progress and rank == 0:
        from headmech.progress import bar

        desc = progress if isinstance(progress, str) else "batches"
        iterator = bar(batches, desc, total, tokens=lambda b: int(b.attention_mask.sum()))
    sizes = []
    with torch.inference_mode(), model.hooks(fwd_hooks=fwd_hooks):
        for i, batch in enumerate(iterator):
            sizes.append(int(batch.input_ids.shape[0]))
            if i % world != rank:
                continue
            batch = batch.to(device)
            state["batch"] = batch
            for r in reducers:
                state["prepared"][r.name] = r.prepare(batch) if r.prepare else None
            run_blocks(model, batch.input_ids, batch.attention_mask, max(layers) + 1)
    return distributed.merge_stats(stats, sizes)
