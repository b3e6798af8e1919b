"""The passes that reduce one layer's attention to per-head sums, wherever the pattern
comes from (:mod:`headmech.stream.engine` chooses):

- :func:`reduce_hooks`: read-only TransformerLens hooks on ``hook_pattern`` (the eager
  pattern) or ``hook_z``;
- :func:`block_hooks`: the pattern rebuilt from the hooked q and k, a block of query rows
  at a time (:mod:`headmech.stream.blockwise`);
- :func:`call_reducer`: inside the model's own attention call
  (:mod:`headmech.stream.attention_call`), from point masses (:class:`Points`), from
  blocks of scores (:class:`RowBlock`) or from blocks of the pattern.

Each adds ``{reducer}.{stat}`` sums and counts per layer to a :class:`HeadStats`; the
pass's mutable ``state`` holds the current batch, the reducers' prepared data, the block
budget and the shared buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from headmech.core.stats import HeadStats
from headmech.stream import attention_call, blockwise
from headmech.stream.buffers import Buffers
from headmech.stream.points import Points
from headmech.stream.reducers import Reducer, Sums, merge_sums
from headmech.stream.rows import RowBlock

__all__ = ["block_hooks", "call_reducer", "reduce_hooks"]


def _layer_of(hook_name: str) -> int:
    return int(hook_name.split(".")[1])


def _call(r: Reducer, act: Tensor, state: dict[str, Any], layer: int, rows: slice) -> Sums:
    return r(act, state["batch"], state["prepared"][r.name], layer, rows if r.blockwise else None)


def _add(stats: HeadStats, name: str, layer: int, out: Sums) -> None:
    for stat, (total_, count) in out.items():
        stats.add(f"{name}.{stat}", layer, total_, count)


def reduce_hooks(
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


def block_hooks(
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

    others = reduce_hooks([r for r in reducers if r.hook != "hook_pattern"], layers, stats, state)
    qk = [(f"blocks.{la}.attn.hook_q", keep_q) for la in layers]
    qk += [(f"blocks.{la}.attn.hook_k", reduce_k) for la in layers]
    return (qk if pattern_reducers else []) + others


def call_reducer(
    reducers: Sequence[Reducer], stats: HeadStats, state: dict[str, Any]
) -> Callable[[int, attention_call.LayerCall], None]:
    """Pattern reducers inside the model's attention call (:mod:`headmech.stream.attention_call`):
    from point masses where every one of them has them (or has ``from_maxima`` and the
    call brought its rows' maxima) and the call brought the rows' log-sum-exp, else from
    blocks of the pattern built from the final q and k it received."""
    pattern_reducers = [r for r in reducers if r.hook == "hook_pattern"]

    def on_call(layer: int, call: attention_call.LayerCall) -> None:
        if call.out is not None:  # shared scores: the blocks compute the output too
            _reduce_rows(call, pattern_reducers, layer, state, stats)
            return
        ways = [_pointwise(r, call) for r in pattern_reducers]
        if call.lse is not None and all(w is not None for w in ways):
            view = Points(call, state.setdefault("buffers", Buffers()))
            for r, way in zip(pattern_reducers, ways, strict=True):
                assert way is not None
                _add(
                    stats,
                    r.name,
                    layer,
                    way(view, state["batch"], state["prepared"][r.name], layer),
                )
            return

        if call.lse is not None:
            _reduce_rows(call, pattern_reducers, layer, state, stats)
            return

        def rows_of(rows: slice) -> Tensor:
            return attention_call.pattern_rows(call, rows)

        _reduce_blocks(pattern_reducers, rows_of, _shape3(call.q), layer, state, stats)

    # the pass builds rows for every query of a layer (some reducer has no points and reads
    # rows block by block): the attention call may let those blocks compute the output
    # (shared scores, :mod:`headmech.stream.rows`)
    on_call.every_row = any(r.points is None for r in pattern_reducers) and any(  # type: ignore[attr-defined]
        r.from_rows is not None or r.blockwise for r in pattern_reducers
    )
    if all(r.points is not None or r.from_maxima is not None for r in pattern_reducers):
        # ... but every statistic reads points and the rows' maxima: the tiles that compute
        # the output give those (:mod:`headmech.stream.tiles`), over every key and over the
        # key sets the built-in statistics take (ordinary tokens; real tokens)
        def maxima_keys() -> list[Tensor]:
            batch = state["batch"]
            return [~batch.special.bool(), batch.attention_mask.bool()]

        on_call.maxima_keys = maxima_keys  # type: ignore[attr-defined]
    return on_call


def _pointwise(r: Reducer, call: attention_call.LayerCall) -> Callable[..., Sums] | None:
    """The reducer's sums from points (:class:`Points`): ``points``, else ``from_maxima``
    where the call brought its rows' maxima; None: it needs rows."""
    if r.points is not None:
        return r.points
    return r.from_maxima if call.maxima is not None else None


def _reduce_rows(
    call: attention_call.LayerCall,
    reducers: Sequence[Reducer],
    layer: int,
    state: dict[str, Any],
    stats: HeadStats,
) -> None:
    """One layer inside an attention call that returned the rows' log-sum-exp, for a pass
    that needs rows: one block of scores at a time (:class:`RowBlock`, in the pass's one
    :class:`~headmech.stream.buffers.Buffers`); the reducers with ``from_rows`` read the scores (no softmax),
    then the other blockwise reducers the block's pattern (computed in place, only where
    one of them needs it); a reducer that is not blockwise gets its whole pattern."""
    from_rows = [r for r in reducers if r.from_rows is not None]
    on_pattern = [r for r in reducers if r.from_rows is None and r.blockwise]
    whole = [r for r in reducers if r.from_rows is None and not r.blockwise]
    n_seqs, n_heads, n = _shape3(call.q)
    step = blockwise.rows_per_block(n_seqs, n_heads, n, state["budget"])
    buffers = state.setdefault("buffers", Buffers())
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
    if call.q.device.type == "cpu":
        # the scores' buffer (64 MB for SmolLM2 at 8,192 tokens) is not held through the
        # layer's MLP, where the forward's own peak is: on a CPU a fresh one costs little
        buffers.release("scores")
        buffers.release("chunk_maxima")
    for r in [*from_rows, *on_pattern]:
        _add(stats, r.name, layer, {s: (t, c) for s, (t, c) in acc[r.name].items()})
    if whole:

        def rows_of(rows: slice) -> Tensor:
            return attention_call.pattern_rows(call, rows)

        _reduce_blocks(whole, rows_of, _shape3(call.q), layer, state, stats)
