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
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core import distributed
from headmech.core.checks import stream_arguments
from headmech.core.errors import ArgumentError
from headmech.core.stats import HeadStats, ProbeBatch
from headmech.stream import attention_call, blockwise
from headmech.stream.forward import bare_forward, fast_attention, pattern_hooked, run_blocks
from headmech.stream.points import Points
from headmech.stream.reducers import Reducer, Sums, merge_sums, target_reducer
from headmech.stream.rows import RowBlock

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


def _layer_of(hook_name: str) -> int:
    return int(hook_name.split(".")[1])


def _call(r: Reducer, act: Tensor, state: dict[str, Any], layer: int, rows: slice) -> Sums:
    return r(act, state["batch"], state["prepared"][r.name], layer, rows if r.blockwise else None)


def _add(stats: HeadStats, name: str, layer: int, out: Sums) -> None:
    for stat, (total_, count) in out.items():
        stats.add(f"{name}.{stat}", layer, total_, count)


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
            # reductions in fp32 whatever the model's dtype (a no-op for fp32 models)
            act = activation.detach().float()
            rows = slice(0, act.shape[2] if act.dim() == 4 else act.shape[1])
            for r in group:
                _add(stats, r.name, layer, _call(r, act, state, layer, rows))
            blockwise.forget()
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


def _shape3(q: Tensor) -> tuple[int, int, int]:
    """Sequences, heads and query positions of ``[batch, n_heads, q_pos, d_head]``."""
    return int(q.shape[0]), int(q.shape[1]), int(q.shape[2])


def _reduce_blocks(
    pattern_reducers: Sequence[Reducer],
    rows_of: Callable[[slice], Tensor],
    shape: tuple[int, int, int],
    layer: int,
    state: dict[str, Any],
    stats: HeadStats,
) -> None:
    """Build one layer's pattern ``rows`` queries at a time (``rows_of(rows)``; ``shape``:
    sequences, heads, queries) and reduce each block; a reducer that is not blockwise gets
    all rows in one block."""
    n_seqs, n_heads, n = shape
    step = blockwise.rows_per_block(n_seqs, n_heads, n, state["budget"])
    for group, size in (
        ([r for r in pattern_reducers if r.blockwise], step),
        ([r for r in pattern_reducers if not r.blockwise], n),
    ):
        acc: dict[str, dict[str, list[Any]]] = {r.name: {} for r in group}
        for start in range(0, n if group else 0, size):
            rows = slice(start, min(n, start + size))
            block = rows_of(rows)
            for r in group:
                merge_sums(acc[r.name], _call(r, block, state, layer, rows))
            blockwise.forget()
            del block
        for r in group:
            _add(stats, r.name, layer, {s: (t, c) for s, (t, c) in acc[r.name].items()})


def _block_hooks(
    reducers: Sequence[Reducer],
    layers: Sequence[int],
    stats: HeadStats,
    state: dict[str, Any],
    geom: blockwise.Geometry,
) -> list[tuple[str, Callable[..., None]]]:
    """Pattern reducers from the hooked q and k (``hook_q`` keeps the queries, ``hook_k``
    rebuilds the pattern block by block); other reducers on their own hooks."""
    pattern_reducers = [r for r in reducers if r.hook == "hook_pattern"]

    def keep_q(activation: Tensor, *, hook: Any) -> None:
        state["q"] = activation.detach()

    def reduce_k(activation: Tensor, *, hook: Any) -> None:
        layer = _layer_of(hook.name)
        rope = state["rope"].pop(layer, None)
        q, k = blockwise.rotate(state.pop("q"), activation.detach(), rope, geom)
        keys = state["batch"].attention_mask.bool()

        def rows_of(rows: slice) -> Tensor:
            return blockwise.pattern_rows(q, k, keys, geom, layer, rows)

        _reduce_blocks(pattern_reducers, rows_of, _shape3(q), layer, state, stats)

    others = _reduce_hooks([r for r in reducers if r.hook != "hook_pattern"], layers, stats, state)
    qk = [(f"blocks.{la}.attn.hook_q", keep_q) for la in layers]
    qk += [(f"blocks.{la}.attn.hook_k", reduce_k) for la in layers]
    return (qk if pattern_reducers else []) + others


def _call_reducer(
    reducers: Sequence[Reducer], stats: HeadStats, state: dict[str, Any]
) -> Callable[[int, attention_call.LayerCall], None]:
    """Pattern reducers inside the model's attention call (:mod:`headmech.stream.attention_call`):
    from point masses where every one of them has them and the call brought the rows'
    log-sum-exp, else from blocks of the pattern built from the final q and k it received."""
    pattern_reducers = [r for r in reducers if r.hook == "hook_pattern"]
    pointwise = all(r.points is not None for r in pattern_reducers)

    def on_call(layer: int, call: attention_call.LayerCall) -> None:
        if pointwise and call.lse is not None:
            view = Points(call, state.setdefault("buffers", blockwise.Buffers()))
            for r in pattern_reducers:
                assert r.points is not None
                out = r.points(view, state["batch"], state["prepared"][r.name], layer)
                _add(stats, r.name, layer, out)
            return

        if call.lse is not None:
            _reduce_rows(call, pattern_reducers, layer, state, stats)
            return

        def rows_of(rows: slice) -> Tensor:
            return attention_call.pattern_rows(call, rows)

        _reduce_blocks(pattern_reducers, rows_of, _shape3(call.q), layer, state, stats)

    return on_call


def _reduce_rows(
    call: attention_call.LayerCall,
    reducers: Sequence[Reducer],
    layer: int,
    state: dict[str, Any],
    stats: HeadStats,
) -> None:
    """One layer inside an attention call that returned the rows' log-sum-exp, for a pass
    that needs rows: one block of scores at a time (:class:`RowBlock`, in the pass's one
    :class:`~headmech.stream.blockwise.Buffers`); the reducers with ``from_rows`` read the scores (no softmax),
    then the other blockwise reducers the block's pattern (computed in place, only where
    one of them needs it); a reducer that is not blockwise gets its whole pattern."""
    from_rows = [r for r in reducers if r.from_rows is not None]
    on_pattern = [r for r in reducers if r.from_rows is None and r.blockwise]
    whole = [r for r in reducers if r.from_rows is None and not r.blockwise]
    n_seqs, n_heads, n = _shape3(call.q)
    step = blockwise.rows_per_block(n_seqs, n_heads, n, state["budget"])
    buffers = state.setdefault("buffers", blockwise.Buffers())
    acc: dict[str, dict[str, list[Any]]] = {r.name: {} for r in [*from_rows, *on_pattern]}
    for start in range(0, n if from_rows or on_pattern else 0, step):
        rows = slice(start, min(n, start + step))
        view = RowBlock(call, rows, buffers)
        for r in from_rows:
            assert r.from_rows is not None
            prepared = state["prepared"][r.name]
            merge_sums(acc[r.name], r.from_rows(view, state["batch"], prepared, layer, rows))
        if on_pattern:
            block = view.pattern()
            for r in on_pattern:
                merge_sums(acc[r.name], _call(r, block, state, layer, rows))
        blockwise.forget()
        del view
    for r in [*from_rows, *on_pattern]:
        _add(stats, r.name, layer, {s: (t, c) for s, (t, c) in acc[r.name].items()})
    if whole:

        def rows_of(rows: slice) -> Tensor:
            return attention_call.pattern_rows(call, rows)

        _reduce_blocks(whole, rows_of, _shape3(call.q), layer, state, stats)


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
    device = next(model.parameters()).device
    if budget is None:
        budget = blockwise.default_block_memory(device)
    state: dict[str, Any] = {"prepared": {}, "rope": {}, "budget": budget, "sizes": []}
    ctx: Any = contextlib.ExitStack()
    if mode == "blocks":
        assert geom is not None
        fwd_hooks = _block_hooks(reducers, layers, stats, state, geom)
        ctx.enter_context(blockwise.capture_rotary(model, layers, state["rope"]))
        ctx.enter_context(fast_attention(model))
    elif mode == "call":
        others = [r for r in reducers if r.hook != "hook_pattern"]
        fwd_hooks = _reduce_hooks(others, layers, stats, state)
        on_call = _call_reducer(reducers, stats, state)
        ctx.enter_context(attention_call.reducing(model, layers, on_call))
    else:
        fwd_hooks = _reduce_hooks(reducers, layers, stats, state)
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
