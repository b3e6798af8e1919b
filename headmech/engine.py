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


# fn(activation, batch, prepared, layer) -> {stat: (sum over queries [n_heads], count)}
ReduceFn = Callable[[Tensor, ProbeBatch, Any, int], Mapping[str, tuple[Tensor, Tensor | float]]]


@dataclass(frozen=True)
class Reducer:
    """A per-head statistic computed inside a hook.

    Attributes:
        name: prefix of the statistics it produces (``name.stat``).
        fn: ``fn(activation, batch, prepared, layer)`` → ``{stat: (sum[n_heads], count)}``;
            ``count`` is a scalar or ``[n_heads]``. It must not modify ``activation``.
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
    machines combine exactly; :meth:`mean` divides at the end.
    """

    def __init__(self, n_layers: int, n_heads: int) -> None:
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.sums: dict[str, Float[Tensor, "n_layers n_heads"]] = {}
        self.counts: dict[str, Float[Tensor, "n_layers n_heads"]] = {}

    def _zeros(self) -> Tensor:
        return torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)

    def add(self, name: str, layer: int, total: Tensor, count: Tensor | float) -> None:
        """Add one layer's per-head sums ``total`` (``[n_heads]``) and ``count``."""
        if name not in self.sums:
            self.sums[name] = self._zeros()
            self.counts[name] = self._zeros()
        self.sums[name][layer] += total.detach().to("cpu", torch.float64)
        if isinstance(count, Tensor):
            count = count.detach().to("cpu", torch.float64)
        self.counts[name][layer] += count

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
        n = has.sum()
        return {
            "mass": ((mass * w).sum((0, 2)), n),
            "hit": ((hit.to(pattern.dtype) * w).sum((0, 2)), n),
            "rows": ((mass * real_query[:, None]).sum((0, 2)), real_query.sum()),
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
                out = r.fn(activation.detach(), state["batch"], state["prepared"][r.name], layer)
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
        :class:`HeadStats` with ``reducer.stat`` entries.
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
    iterator: Iterable[ProbeBatch] = batches
    if progress:
        from tqdm.auto import tqdm

        desc = progress if isinstance(progress, str) else "batches"
        iterator = tqdm(batches, desc=desc, total=total, leave=False)
    with torch.inference_mode(), model.hooks(fwd_hooks=fwd_hooks):
        for batch in iterator:
            batch = batch.to(device)
            state["batch"] = batch
            for r in reducers:
                state["prepared"][r.name] = r.prepare(batch) if r.prepare else None
            run_blocks(model, batch.input_ids, batch.attention_mask, max(layers) + 1)
    return stats
