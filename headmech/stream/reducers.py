"""What a reducer is: a per-head statistic computed inside a hook.

:class:`Reducer` pairs a function that turns one layer's activation (the attention
pattern, or a block of its query rows; or ``hook_z``) into per-sequence sums and counts
with a ``prepare`` run once per batch. :func:`target_reducer` is the common case, "how
much attention goes to each query's target key(s), and is the target the argmax".
:mod:`headmech.stream.engine` runs reducers; both names are re-exported there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.stats import ProbeBatch
from headmech.stream import blockwise

if TYPE_CHECKING:
    from headmech.stream.points import Points
    from headmech.stream.rows import RowBlock

__all__ = ["Reducer", "Sums", "merge_sums", "target_reducer"]


# what a reducer returns: {stat: (sum over queries [batch, n_heads], count)}
Sums = Mapping[str, tuple[Tensor, Tensor | float]]


@dataclass(frozen=True)
class Reducer:
    """A per-head statistic computed inside a hook.

    Attributes:
        name: prefix of the statistics it produces (``name.stat``).
        fn: ``fn(activation, batch, prepared, layer)`` → ``{stat: (sum, count)}``, per
            sequence: ``sum`` is ``[batch, n_heads]`` and ``count`` ``[batch]`` or ``[batch,
            n_heads]`` (per-sequence sums let :mod:`headmech.stream.uncertainty` resample the probe's
            examples); a reducer with no per-sequence view may return ``[n_heads]`` and a
            scalar or ``[n_heads]`` count instead. It must not modify ``activation``.
        prepare: ``prepare(batch)`` → anything, run once per batch (not once per layer).
        hook: the attention hook it reads: ``"hook_pattern"``
            (``[batch, head_index, query_pos, key_pos]``) or ``"hook_z"``
            (``[batch, pos, head_index, d_head]``).
        blockwise: the reducer takes a block of query rows: it is called as ``fn(block,
            batch, prepared, layer, rows)`` with ``rows`` a ``slice`` of query positions and
            ``block`` the pattern's rows ``[batch, head_index, len(rows), width]``: keys
            ``0 .. width - 1``, where ``width <= T`` (causal attention leaves out the keys
            after the block's last query: they have no weight). Its sums and counts over
            the blocks add up to the whole pattern's. Without it a pattern reducer sees
            every query and key at once (one ``T x T`` block).
        points: the same sums from point masses, without pattern blocks:
            ``points(view, batch, prepared, layer)`` with ``view`` an
            :class:`headmech.stream.points.Points` (probabilities of chosen (query, key)
            pairs from the fused kernel's log-sum-exp, and the argmax of the rows it
            names). Where every pattern reducer of a pass has it and the model's attention
            call returns the log-sum-exp, the engine computes no pattern rows but those.
        from_rows: the same sums from a block of rows' scores and log-sum-exp, without
            the block's softmax: ``from_rows(view, batch, prepared, layer, rows)`` with
            ``view`` a :class:`headmech.stream.rows.RowBlock` (each row's maximum and
            argmax over any keys, probabilities at chosen keys). Where the model's
            attention call returns the log-sum-exp and a pass needs rows (a reducer
            without ``points``), the engine gives every reducer that has it the block's
            scores, and the block's pattern only to the reducers without it.
        from_maxima: the same sums from point masses and the rows' maxima (a statistic
            of a row's maximum or argmax that points alone cannot give): called as
            ``points`` is, with a view whose ``has_maxima`` is True
            (:mod:`headmech.stream.maxima`). A reducer with ``points`` needs none.
    """

    name: str
    fn: Callable[..., Mapping[str, tuple[Tensor, Tensor | float]]]
    prepare: Callable[[ProbeBatch], Any] | None = None
    hook: str = "hook_pattern"
    blockwise: bool = False
    points: Callable[..., Mapping[str, tuple[Tensor, Tensor | float]]] | None = None
    from_rows: Callable[..., Mapping[str, tuple[Tensor, Tensor | float]]] | None = None
    from_maxima: Callable[..., Mapping[str, tuple[Tensor, Tensor | float]]] | None = None

    def __call__(
        self,
        activation: Tensor,
        batch: ProbeBatch,
        prepared: Any,
        layer: int,
        rows: slice | None = None,
    ) -> Sums:
        """``fn`` on one layer's activation; ``rows``: the query rows of a pattern block
        (default all, the only choice for a reducer that is not blockwise)."""
        if not self.blockwise:
            if rows is not None and (rows.start, rows.stop) != (0, activation.shape[-2]):
                raise ValueError(f"reducer {self.name} is not blockwise: it needs every row")
            return self.fn(activation, batch, prepared, layer)
        rows = slice(0, activation.shape[-2]) if rows is None else rows
        return self.fn(activation, batch, prepared, layer, rows)


@dataclass(frozen=True)
class _Targets:
    """:func:`target_reducer`'s targets for one batch, prepared once.

    One key per query is ``index`` (``[batch, query_pos]``, 0 where a query has none). A
    set of keys per query is kept as its pairs, ``(sequence * T + query) * T + key`` codes
    in ascending order, not as a ``T x T`` mask: at 8,192 tokens the mask alone was 64 MB a
    sequence, held through every layer, where a probe's sets hold a few pairs a query.
    """

    has: Tensor  # [batch, query_pos]: the query is real and has a target
    real_query: Tensor  # [batch, query_pos]
    index: Tensor | None = None  # one key per query
    pairs: Tensor | None = None  # a set per query: sorted (sequence, query, key) codes
    n: int = 0  # T, the codes' base

    def at(self, rows: slice) -> _Targets:
        """The rows' view (``has``, ``real_query`` and ``index``; the pairs stay whole)."""
        index = None if self.index is None else self.index[:, rows]
        return _Targets(self.has[:, rows], self.real_query[:, rows], index, self.pairs, self.n)

    def pairs_in(self, rows: slice, width: int) -> tuple[Tensor, Tensor, Tensor]:
        """The set pairs ``(sequence, query - rows.start, key)`` with a query in ``rows``
        and a key below ``width``, read by binary search (O(pairs of the rows))."""
        assert self.pairs is not None
        n, codes = self.n, self.pairs
        seqs = torch.arange(self.has.shape[0], device=codes.device)
        bounds = torch.stack([(seqs * n + rows.start) * n, (seqs * n + rows.stop) * n], 1)
        lo, hi = torch.searchsorted(codes, bounds).unbind(1)
        if len(lo) == 1:  # one sequence: a slice, no gather
            mine = codes[int(lo[0]) : int(hi[0])]
        else:
            mine = torch.cat([codes[int(a) : int(b)] for a, b in zip(lo, hi, strict=True)])
        b, rest = mine.div(n * n, rounding_mode="floor"), mine.remainder(n * n)
        q, k = rest.div(n, rounding_mode="floor"), rest.remainder(n)
        keep = k < width
        return b[keep], q[keep] - rows.start, k[keep]

    def contains(self, keys: Tensor, start: int = 0) -> Tensor:
        """Whether each of ``keys`` (``[batch, head, rows]``, key positions of queries
        ``start ..``) is in its query's set, by binary search."""
        assert self.pairs is not None
        n, codes = self.n, self.pairs
        if codes.numel() == 0:
            return torch.zeros_like(keys, dtype=torch.bool)
        b = torch.arange(keys.shape[0], device=keys.device)[:, None, None]
        q = torch.arange(start, start + keys.shape[2], device=keys.device)
        want = (b * n + q) * n + keys
        at = torch.searchsorted(codes, want.flatten()).clamp_(max=codes.numel() - 1)
        return (codes[at] == want.flatten()).view_as(keys)


def _checked_targets(
    name: str, targets: Callable[[ProbeBatch], Tensor], batch: ProbeBatch
) -> Tensor:
    """``targets(batch)``, refused in one line naming the plug-in, the method and the shape
    expected unless it is ``Int[batch, query_pos]`` or ``Bool[batch, query_pos, key_pos]``."""
    from headmech.core.errors import PluginError

    t = targets(batch)
    b, n = (int(d) for d in batch.input_ids.shape)
    ok = isinstance(t, Tensor) and (
        (
            t.dim() == 2
            and tuple(t.shape) == (b, n)
            and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
        )
        or (t.dim() == 3 and tuple(t.shape) == (b, n, n) and t.dtype == torch.bool)
    )
    if not ok:
        kind = str(t.dtype).removeprefix("torch.") if isinstance(t, Tensor) else type(t).__name__
        got = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
        got += f" tensor of shape {tuple(t.shape)}" if isinstance(t, Tensor) else ""
        who = getattr(targets, "__qualname__", None) or repr(targets)
        raise PluginError(
            f"'{name}' ({who}) returned {got} for a batch of {b} x {n} tokens; expected "
            f"Int[batch, query_pos] of shape {(b, n)} (key index, -1 for none) or "
            f"Bool[batch, query_pos, key_pos] of shape {(b, n, n)}"
        )
    return t


def target_reducer(
    name: str,
    targets: Callable[[ProbeBatch], Tensor],
    *,
    hits: bool = True,
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
        hits: also ``name.hit``, which needs each row's argmax: from point masses most
            rows are decided without their whole row, but a diffuse row (a random model's)
            is computed whole. Without it, inside an attention call that returns the
            log-sum-exp the statistics cost O(d_head) per query.

    Returns:
        A :class:`Reducer` on ``hook_pattern``.
    """
    return Reducer(
        name,
        functools.partial(_target_pattern, hits),
        functools.partial(_target_prepare, name, targets),
        blockwise=True,
        points=functools.partial(_target_points, hits),
        from_rows=functools.partial(_target_rows, hits),
    )


def _target_prepare(
    name: str, targets: Callable[[ProbeBatch], Tensor], batch: ProbeBatch
) -> _Targets:
    """The targets, checked, as :class:`_Targets`."""
    t = _checked_targets(name, targets, batch)
    real_query = batch.attention_mask.bool()
    if t.dtype == torch.bool:  # a set of keys per query: [batch, query_pos, key_pos]
        t = t & batch.attention_mask.bool()[:, None, :]
        has = t.any(-1) & real_query
        n = t.shape[1]
        b, q, k = t.nonzero().unbind(-1)  # in (sequence, query, key) order: codes ascend
        del t  # the T x T mask is not kept
        return _Targets(has, real_query, pairs=(b * n + q) * n + k, n=n)
    return _Targets((t >= 0) & real_query, real_query, index=t.clamp(min=0))


def _target_pattern(
    hits: bool, pattern: Tensor, batch: ProbeBatch, prepared: _Targets, layer: int, rows: slice
) -> dict:
    """The sums from a block of pattern rows."""
    t = prepared.at(rows)
    # pattern: [batch, head_index, query rows, key_pos]
    top = blockwise.top1(pattern)[1] if hits else None  # [batch, head_index, query rows]
    width = pattern.shape[-1]  # keys 0 .. width - 1 (later keys have no weight)
    hit = None
    if t.index is not None:  # one key per query: read it, no [query, key] mask needed
        target = t.index
        idx = target.clamp(max=width - 1)[:, None, :, None].expand(-1, pattern.shape[1], -1, 1)
        mass = pattern.gather(-1, idx)[..., 0] * (t.has & (target < width))[:, None]
        if top is not None:
            hit = top == target[:, None]
    else:  # a set of keys per query: its pairs in this block (O(pairs), not O(T^2))
        b, q, k = prepared.pairs_in(rows, width)
        mass = pattern.new_zeros(pattern.shape[0], pattern.shape[2], pattern.shape[1])
        mass.index_put_((b, q), pattern[b, :, q, k], accumulate=True)  # [batch, rows, head]
        mass = mass.transpose(1, 2)
        if top is not None:
            hit = prepared.contains(top, rows.start)
    return _target_sums(mass, hit, t.has, t.real_query)


def _target_points(
    hits: bool, view: Points, batch: ProbeBatch, prepared: _Targets, layer: int
) -> dict:
    """The sums from point masses (:class:`~headmech.stream.points.Points`)."""
    has = prepared.has
    if prepared.index is not None:  # one key per query
        target = prepared.index
        mass = view.at(target) * has[:, None]

        def is_target(keys: Tensor) -> Tensor:
            return keys == target[:, None]

        best = mass
    else:  # a set of keys per query: its (sequence, query, key) pairs
        b, q, k = prepared.pairs_in(slice(0, prepared.n), prepared.n)
        p = view.pairs(b, q, k)  # [pairs, head]
        n_seqs, n = has.shape
        mass = p.new_zeros(n_seqs, n, p.shape[1]).index_put_((b, q), p, accumulate=True)
        mass, best = mass.transpose(1, 2), _set_max(p, b, q, n_seqs, n).transpose(1, 2)
        is_target = prepared.contains  # keys [batch, head, q_pos]

    hit = view.hits(best, is_target, has) if hits else None
    return _target_sums(mass, hit, has, prepared.real_query)


def _target_rows(
    hits: bool, view: RowBlock, batch: ProbeBatch, prepared: _Targets, layer: int, rows: slice
) -> dict:
    """The sums from a block of rows' scores (:class:`~headmech.stream.rows.RowBlock`)."""
    t = prepared.at(rows)
    top = view.top()[1] if hits else None  # [batch, head_index, query rows]
    hit = None
    if t.index is not None:  # one key per query
        mass = view.at(t.index) * t.has[:, None]
        if top is not None:
            hit = top == t.index[:, None]
    else:  # a set of keys per query: its (sequence, query, key) pairs in this block
        b, q, k = prepared.pairs_in(rows, view.width)
        p = view.pairs(b, q, k)  # [pairs, head]
        n_seqs, n_heads, n_rows = view.scores.shape[:3]
        mass = p.new_zeros(n_seqs, n_rows, n_heads).index_put_((b, q), p, accumulate=True)
        mass = mass.transpose(1, 2)
        if top is not None:
            hit = prepared.contains(top, rows.start)
    return _target_sums(mass, hit, t.has, t.real_query)


def _set_max(p: Tensor, b: Tensor, q: Tensor, n_seqs: int, n: int) -> Tensor:
    """Per (sequence, query) the largest of its rows' ``p`` (``[pairs, head]``), ``[batch,
    q_pos, head]`` (0 where a query has none)."""
    out = p.new_zeros(n_seqs * n, p.shape[1])
    idx = (b * n + q)[:, None].expand_as(p)
    return out.scatter_reduce_(0, idx, p, "amax").view(n_seqs, n, p.shape[1])


def _target_sums(mass: Tensor, hit: Tensor | None, has: Tensor, real_query: Tensor) -> dict:
    """target_reducer's statistics from per-row masses and hits ``[batch, head, rows]``."""
    w = has[:, None].to(mass.dtype)
    n = has.sum(1)  # [batch]: per sequence
    out = {
        "mass": ((mass * w).sum(2), n),
        "rows": ((mass * real_query[:, None]).sum(2), real_query.sum(1)),
    }
    if hit is not None:
        out["hit"] = ((hit.to(mass.dtype) * w).sum(2), n)
    return out


def merge_sums(acc: dict[str, list[Any]], out: Sums) -> None:
    """Add a block's sums and counts into ``acc`` (``{stat: [sum, count]}``)."""
    for stat, (total_, count) in out.items():
        if stat in acc:
            acc[stat][0] = acc[stat][0] + total_
            acc[stat][1] = acc[stat][1] + count
        else:
            acc[stat] = [total_, count]
