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

Long sequences never hold a whole pattern: by default (``attention="auto"``) pattern
reducers get the pattern in blocks of query rows sized by a memory budget, computed inside
the model's own attention call from the final q and k it receives
(:mod:`headmech.stream.attention_call`) or, for bridges that attend in the bridge, rebuilt from
the hooked q and k (:mod:`headmech.stream.blockwise`), while the model runs fused attention; the
eager ``hook_pattern`` is used only where neither can be trusted (a hook edits the
pattern, a failed check).

Grouped-query attention needs no special case here: ``hook_pattern`` and ``hook_z`` are
per query head, so every statistic is ``[n_layers, n_heads]`` with ``n_heads`` query heads.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core import distributed
from headmech.core.checks import stream_arguments
from headmech.core.errors import ArgumentError
from headmech.core.placement import model_device
from headmech.core.stats import HeadStats, ProbeBatch
from headmech.stream import attention_call, blockwise
from headmech.stream.forward import bare_forward, fast_attention, pattern_hooked, run_blocks
from headmech.stream.passes import block_hooks, call_reducer, reduce_hooks
from headmech.stream.reducers import Reducer, Sums, target_reducer

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


# models whose pattern-free path was checked against their own pattern: model -> (mode,
# geometry) or None
_CHECKED: weakref.WeakKeyDictionary[Any, tuple[str, blockwise.Geometry | None] | None] = (
    weakref.WeakKeyDictionary()
)
BLOCK_MEMORY = blockwise.BLOCK_MEMORY  # default bytes for one block of rows on a CPU


def _probe_reducer() -> Reducer:
    """Random projections of the pattern's real query rows and their argmax: equal in
    both paths only if the rebuilt pattern is the model's (a padding query's row is
    whatever each path makes of a row with no key, and no statistic reads it)."""

    def fn(pattern: Tensor, batch: ProbeBatch, prepared: Any, layer: int, rows: slice) -> Sums:
        n = int(batch.input_ids.shape[1])
        w = torch.rand(n, n, generator=torch.Generator().manual_seed(layer))
        real = batch.attention_mask[:, None, rows].to(pattern)  # [batch, 1, rows]
        w = w[rows, : pattern.shape[-1]].to(pattern.device)
        proj = (pattern * w * real[..., None]).sum((-1, -2))
        top = (pattern.argmax(-1).float() * real).sum(-1)
        return {"proj": (proj, torch.ones(pattern.shape[0])), "top": (top, 1.0)}

    return Reducer("check", fn, blockwise=True)


def _blocks_reproduce(model: TransformerBridge, mode: str, geom: blockwise.Geometry | None) -> bool:
    """Whether the pattern-free path's pattern equals the model's on two short random
    sequences (one padded), checked once per model."""
    n = min(48, int(getattr(model.cfg, "n_ctx", 48) or 48))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(model.cfg.d_vocab), (2, n), generator=g)
    mask = torch.ones_like(ids)
    mask[1, n // 2 :] = 0
    batch = ProbeBatch(ids, mask, mask == 0)
    r = [_probe_reducer()]
    a, _ = _stream(model, [batch], r, None, "pattern", None, BLOCK_MEMORY, shard=False)
    # a budget of a few rows: several blocks
    b, _ = _stream(model, [batch], r, None, mode, geom, n * 2 * 4 * 2, shard=False)
    diff = float((a.sums["check.proj"] - b.sums["check.proj"]).abs().max())
    ties = float((a.sums["check.top"] - b.sums["check.top"]).abs().max())
    if diff > 1e-4 or ties > 0:
        warnings.warn(
            f"the pattern rebuilt from q and k differs from the model's (max diff {diff:.2g}): "
            "statistics use the model's pattern",
            stacklevel=3,
        )
    return diff <= 1e-4 and ties == 0


def _any_hooks(model: TransformerBridge) -> bool:
    return any(hp._forward_hooks or hp._forward_pre_hooks for hp in model.hook_dict.values())


def _pattern_free(model: TransformerBridge) -> tuple[str, blockwise.Geometry | None] | str:
    """Where patterns come from without the eager ``hook_pattern``: inside the model's
    attention call (``"call"``), else rebuilt from the hooked q and k (``"blocks"`` and
    the geometry); or why neither can be trusted."""
    if pattern_hooked(model):  # interventions on the pattern need the real one
        return "a hook reads or edits the pattern"
    why_call = attention_call.possible(model)
    if why_call is None:
        return "call", None
    geom = blockwise.geometry(model)
    if isinstance(geom, str):
        return f"{why_call}, and {geom} is not rebuilt from q and k"
    return "blocks", geom


def _choose(
    model: TransformerBridge, reducers: Sequence[Reducer], attention: str
) -> tuple[str, blockwise.Geometry | None]:
    if attention not in ("auto", "pattern", "blocks"):
        raise ValueError(f"attention must be auto, pattern or blocks, got {attention!r}")
    if attention == "pattern" or not any(r.hook == "hook_pattern" for r in reducers):
        return "pattern", None
    where = _pattern_free(model)
    if attention == "blocks":
        if isinstance(where, str):
            raise ValueError(
                f"cannot compute attention patterns without the eager pattern: {where}"
            )
        return where
    if isinstance(where, str):
        return "pattern", None
    if model not in _CHECKED:
        if _any_hooks(model):  # the check's random input must not meet a caller's edits
            return "pattern", None
        _CHECKED[model] = where if _blocks_reproduce(model, *where) else None
    checked = _CHECKED[model]
    return checked if checked is not None else ("pattern", None)


def _stream(
    model: TransformerBridge,
    batches: Iterable[ProbeBatch],
    reducers: Sequence[Reducer],
    layers: Sequence[int] | None,
    mode: str,
    geom: blockwise.Geometry | None,
    budget: int | None,
    *,
    shard: bool = True,
) -> tuple[HeadStats, list[int]]:
    """The passes of :func:`stream_statistics` on this rank (no merge across ranks), and
    the size of every batch."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    stats = HeadStats(n_layers, n_heads)
    layers = list(range(n_layers)) if layers is None else list(layers)
    device = model_device(model)
    if budget is None:
        budget = blockwise.default_block_memory(device)
    state: dict[str, Any] = {"prepared": {}, "rope": {}, "budget": budget, "sizes": []}
    ctx: Any = contextlib.ExitStack()
    if mode == "blocks":
        assert geom is not None
        fwd_hooks = block_hooks(reducers, layers, stats, state, geom)
        ctx.enter_context(blockwise.capture_rotary(model, layers, state["rope"]))
        ctx.enter_context(fast_attention(model))
    elif mode == "call":
        others = [r for r in reducers if r.hook != "hook_pattern"]
        fwd_hooks = reduce_hooks(others, layers, stats, state)
        on_call = call_reducer(reducers, stats, state)
        ctx.enter_context(attention_call.reducing(model, layers, on_call))
    else:
        fwd_hooks = reduce_hooks(reducers, layers, stats, state)
    # under torchrun: batch i on rank i mod world (unless every rank runs every batch)
    rank, world = distributed.world() if shard else (0, 1)
    with torch.inference_mode(), ctx, model.hooks(fwd_hooks=fwd_hooks):
        for i, batch in enumerate(batches):
            state["sizes"].append(int(batch.input_ids.shape[0]))
            if i % world != rank:
                continue
            batch = batch.to(device)
            state["batch"] = batch
            for r in reducers:
                state["prepared"][r.name] = r.prepare(batch) if r.prepare else None
            run_blocks(model, batch.input_ids, batch.attention_mask, max(layers) + 1)
    return stats, state["sizes"]


def stream_statistics(
    model: TransformerBridge,
    batches: Iterable[ProbeBatch],
    reducers: Sequence[Reducer],
    *,
    layers: Sequence[int] | None = None,
    progress: bool | str = False,
    total: int | None = None,
    attention: str = "auto",
    block_memory: int | None = None,
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
        attention: where pattern reducers get the pattern. ``"pattern"``: the model's own
            ``hook_pattern`` (eager attention, one whole ``T x T`` pattern per layer).
            ``"blocks"``: pattern-free, in blocks of query rows: inside the model's own
            attention call from the final q and k, mask, scaling, soft-capping and sinks it
            receives (:mod:`headmech.stream.attention_call`; rotary decoders, every attention
            variant their code implements), else rebuilt from the hooked q and k
            (:mod:`headmech.stream.blockwise`: GPT-2, GPT-NeoX, Phi-3, BERT), while the model runs
            fused attention. ``"auto"`` (default): pattern-free where the model allows,
            nothing hooks the pattern (a pattern intervention needs the real one) and a
            check on a short input reproduced the model's pattern (once per model); else
            the pattern.
        block_memory: bytes for one block of rebuilt rows and its temporaries (default:
            :func:`~headmech.stream.blockwise.default_block_memory` of the model's device: 256 MiB on a CPU, a quarter
            of the free memory of a GPU, where fewer, larger blocks mean fewer launches).

    Returns:
        :class:`HeadStats` with ``reducer.stat`` entries. Under ``torchrun`` each rank
        streams its share of the batches and every rank returns the sum over all ranks
        (:mod:`headmech.core.distributed`).
    """
    stream_arguments(model, reducers, layers)
    mode, geom = _choose(model, reducers, attention)
    iterator: Iterable[ProbeBatch] = batches
    if progress and distributed.world()[0] == 0:
        from headmech.core.progress import bar

        desc = progress if isinstance(progress, str) else "batches"
        iterator = bar(batches, desc, total, tokens=lambda b: int(b.attention_mask.sum()))
    try:
        stats, sizes = _stream(model, iterator, reducers, layers, mode, geom, block_memory)
    finally:  # an error mid-stream: take the bar off its line before the error is printed
        if iterator is not batches and hasattr(iterator, "close"):
            iterator.close()
    if not sizes:  # every rank saw the same (empty) stream: all refuse alike
        raise ArgumentError("stream_statistics got no batches: the probe is empty")
    return distributed.merge_stats(stats, sizes)
