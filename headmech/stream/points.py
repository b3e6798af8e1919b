"""Attention probabilities at chosen (query, key) pairs, from a row's log-sum-exp.

Most head statistics are point masses: the attention a query puts on one key (the token
before it, the token after an earlier copy, the first token) or on a few. With each row's
log-sum-exp from the fused kernel that computed the attention output
(:class:`headmech.stream.attention_call.LayerCall`), ``p(i, j) = exp(scale · q_i · k_j − LSE_i)``
costs O(d_head) instead of a row of ``T`` scores. Whether a target is the row's argmax is
decided from points where it can be; only the rows left open are computed whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.stream.buffers import Buffers

if TYPE_CHECKING:
    from headmech.stream.attention_call import LayerCall

__all__ = ["Points"]


def _softmax_rows(
    q: Float[Tensor, "rows d_head"],
    k: Float[Tensor, "width d_head"],
    hidden: Tensor | None,
    call: LayerCall,
    sink: Tensor | None,
) -> Float[Tensor, "rows width"]:
    """Pattern rows of one head as :func:`pattern_rows` computes them, for any rows."""
    scores = torch.matmul(q, k.T).mul_(call.scale)
    if call.softcap is not None:
        scores = scores.div_(call.softcap).tanh_().mul_(call.softcap)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    if sink is not None:
        logits = torch.cat([scores, sink.to(scores).expand(scores.shape[0], 1)], -1)
        return torch.softmax(logits - logits.amax(-1, keepdim=True), -1)[..., :-1]
    return torch.softmax(scores, -1).nan_to_num_(0.0)


class Points:
    """The attention probability of chosen (query, key) pairs from the call's LSE:
    ``p(i, j) = exp((q_i · k_j) · scale − LSE_i)``, O(d_head) each instead of a whole row,
    and the argmax of the rows a statistic cannot decide without it. The product first,
    then the scale: the fused kernel's order, so that the scores are rounded as the ones
    its LSE came from (:mod:`headmech.stream.rows`).

    Args:
        call: the layer's call, with ``lse``.
        buffers: the pass's buffers, where the keys read at each query's key and their
            products with the queries go (default: new ones). A pass reads them a dozen
            times a layer: reused buffers, not fresh temporaries (the process's peak still
            moves with glibc's heap, as the bare forward's does: docs/scaling.md). The
            keys are read one per key-value head (``call.k`` may hold them so, as the
            tiles' pass does), the products a chunk of queries at a time
            (``PRODUCT_BYTES``, on a CPU): 6 MB and 2 MB for SmolLM2 at 8,192 tokens,
            where the repeated keys and the whole product took 19 MB each. On a GPU
            all queries are one chunk: a chunk costs two kernel launches.
    """

    # a probability decided from points must clear this margin (the kernel's LSE and the
    # softmax of a block differ in the last bits)
    EPS = 1e-5
    # float32 dot products' relative error allowed between the kernel's row maximum and a
    # point's score of the same key (of scale · ‖q‖ · ‖k‖: :meth:`tolerance`)
    DOT_EPS = 1e-6
    # key sets of at most this many keys a sequence are maximised from points
    FEW = 8
    # bytes of scores for one chunk of rows computed whole
    ROW_BYTES = 64 * 2**20
    # bytes of query-key products (before the sum over d_head) a chunk of queries, on a CPU
    PRODUCT_BYTES = 2 * 2**20

    def __init__(self, call: LayerCall, buffers: Buffers | None = None) -> None:
        if call.lse is None:
            raise ValueError("Points needs the log-sum-exp of the fused kernel")
        self.call = call
        self._buffers = buffers or Buffers()
        self.n_seqs, self.n_heads, self.n_queries, self.d_head = (int(d) for d in call.q.shape)
        self.offset = int(call.k.shape[2]) - self.n_queries  # keys before the first query
        self.n_kv = int(call.k.shape[1])  # key heads: one per query head, or grouped-query
        self.group = self.n_heads // self.n_kv  # the query heads a key head serves
        self._q = call.q
        # [batch, n_kv, group, q_pos, d_head]: a key head's key meets its group's queries
        self._qg = call.q.unflatten(1, (self.n_kv, self.group))
        self._fixed: dict[str, Tensor] = {}  # p at the first key, the query, the one before

    def allowed(self, keys: Tensor) -> Tensor:
        """Whether query ``i`` may attend to key ``keys[b, i]``, ``[batch, 1, q_pos]``."""
        call = self.call
        if call.mask is not None:
            mask = call.mask.expand(self.n_seqs, -1, -1, -1)[:, 0]  # [batch, q_pos, k_pos]
            return mask.gather(-1, keys[..., None])[..., 0][:, None]
        if call.causal:
            pos = torch.arange(self.n_queries, device=keys.device) + self.offset
            return (keys <= pos)[:, None]
        return torch.ones_like(keys, dtype=torch.bool)[:, None]

    def scores_at(self, keys: Tensor) -> Float[Tensor, "batch n_heads q_pos"]:
        """The scaled score ``s(i, keys[b, i])`` for every query (``keys``:
        ``Int[batch, q_pos]``, valid key indices); ``-inf`` where the mask hides the key."""
        call = self.call
        # index_select copies d_head contiguous floats per (key head, query); a gather with
        # an index expanded over d_head reads element by element (3x slower)
        shape = (self.n_seqs, self.n_kv, self.n_queries, self.d_head)
        k = self._buffers.take("points_keys", shape, device=keys.device)
        for b in range(self.n_seqs):
            torch.index_select(call.k[b], 1, keys[b], out=k[b])  # [key head, q_pos, d_head]
        return self._scaled(self._dots([(0, self.n_queries, k)]), keys)

    def scores_shifted(self, shift: int) -> Float[Tensor, "batch n_heads q_pos"]:
        """:meth:`scores_at` of the key ``shift`` positions after each query's index
        (``keys = (arange(q_pos) + shift).clamp(0, k_pos - 1)``: the token before, the
        query's own, ...) from slices of the keys, no gather: the same products, so the
        same scores to the bit."""
        call, n_q = self.call, self.n_queries
        n_keys = int(call.k.shape[2])
        lo = min(max(0, -shift), n_q)  # queries before lo read key 0, from hi the last key
        hi = max(min(n_q, n_keys - shift), lo)
        parts = [(0, lo, call.k[:, :, :1]), (lo, hi, call.k[:, :, lo + shift : hi + shift])]
        parts.append((hi, n_q, call.k[:, :, -1:]))
        keys = (torch.arange(n_q, device=call.q.device) + shift).clamp(0, n_keys - 1)
        return self._scaled(self._dots(parts), keys.expand(self.n_seqs, -1))

    def _dots(self, parts: list[tuple[int, int, Tensor]]) -> Float[Tensor, "batch n_heads q_pos"]:
        """``q_i · k`` for every query, the key of queries ``a .. z - 1`` given by ``parts``
        (``(a, z, keys)``, ``keys`` ``[batch, n_kv, z - a | 1, d_head]``: one key a query,
        or one for them all), a chunk of queries at a time: the elementwise products in a
        reused buffer, then their sum (``linalg.vecdot``'s own steps; the same rounding
        whichever chunk a query falls in)."""
        heads, n_q = (self.n_seqs, self.n_kv, self.group), self.n_queries
        out = self._q.new_empty(*heads, n_q)
        step = max(1, self.PRODUCT_BYTES // (4 * self.n_seqs * self.n_heads * self.d_head))
        if out.device.type != "cpu":  # launches, not cache, bound a GPU's pass
            step = n_q
        for c in range(0, n_q, step):
            e = min(n_q, c + step)
            prod = self._buffers.take("points_k", (*heads, e - c, self.d_head), device=out.device)
            for a, z, keys in parts:
                lo, hi = max(a, c), min(z, e)
                if hi > lo:
                    k = keys if keys.shape[2] == 1 else keys[:, :, lo - a : hi - a]
                    q = self._qg[:, :, :, lo:hi]
                    torch.mul(k[:, :, None], q, out=prod[:, :, :, lo - c : hi - c])
            torch.sum(prod, -1, out=out[..., c:e])
        return out.view(self.n_seqs, self.n_heads, n_q)

    def _scaled(self, dots: Tensor, keys: Tensor) -> Float[Tensor, "batch n_heads q_pos"]:
        """Scores from ``q · k`` of the keys ``keys`` (``Int[batch, q_pos]``): the scale
        (after the product, as the fused kernels), the softcap, ``-inf`` where hidden."""
        call = self.call
        scores = dots.mul_(call.scale)
        if call.softcap is not None:
            scores = scores.div_(call.softcap).tanh_().mul_(call.softcap)
        return scores.masked_fill_(~self.allowed(keys), float("-inf"))

    def at(self, keys: Tensor) -> Float[Tensor, "batch n_heads q_pos"]:
        """``p(i, keys[b, i])`` for every query (``keys``: ``Int[batch, q_pos]``, valid
        key indices); 0 where the mask hides the key."""
        assert self.call.lse is not None
        return torch.exp(self.scores_at(keys) - self.call.lse).nan_to_num_(0.0)

    # --- from the rows' maxima (headmech.stream.maxima) ----------------------------------
    @property
    def has_maxima(self) -> bool:
        """Whether the call brought its rows' maxima (:meth:`top` and :meth:`is_max` need them)."""
        return self.call.maxima is not None

    def top(self, keys: Tensor | None = None) -> Float[Tensor, "batch n_heads q_pos"]:
        """Each row's largest probability over the keys where ``keys`` (``Bool[batch,
        k_pos]``) is True, every key for None: ``exp(max − LSE)``; 0 for a row with none."""
        call = self.call
        assert call.maxima is not None and call.lse is not None
        return torch.exp(call.maxima(keys) - call.lse).nan_to_num_(0.0)

    def max_score(self, keys: Tensor) -> Float[Tensor, "batch n_heads q_pos"]:
        """Each row's largest score over the keys where ``keys`` (``Bool[batch, k_pos]``)
        is True, ``-inf`` for a row with none: from points where every sequence has at
        most ``FEW`` such keys (the special tokens, say), else the call's maxima."""
        counts = keys.sum(-1)
        most = int(counts.max()) if counts.numel() else 0
        if most > self.FEW:
            assert self.call.maxima is not None
            return self.call.maxima(keys)
        # each sequence's chosen keys first, in key order
        order = keys.int().argsort(dim=-1, descending=True, stable=True)[:, :most]
        out = torch.full(
            (self.n_seqs, self.n_heads, self.n_queries), float("-inf"), device=keys.device
        )
        for c in range(most):
            s = self.scores_at(order[:, c : c + 1].expand(-1, self.n_queries))
            out = torch.maximum(out, s.masked_fill_(~(counts > c)[:, None, None], float("-inf")))
        return out

    def tolerance(self) -> Float[Tensor, "batch n_heads q_pos"]:
        """How far the kernel's maximum and a point's score of the same key may lie apart
        by rounding alone: ``DOT_EPS · scale · ‖q_i‖ · max_j ‖k_j‖``, a bound on
        ``scale · Σ|q_i k_j|`` (Cauchy-Schwarz) times float32 dot products' relative
        error (the kernel sums its products in another order)."""
        if "tolerance" not in self._fixed:
            call = self.call
            k_norm = call.k.norm(dim=-1).amax(-1, keepdim=True)  # [batch, key head, 1]
            k_norm = k_norm.repeat_interleave(self.group, 1)  # [batch, head, 1]
            self._fixed["tolerance"] = self.DOT_EPS * call.scale * call.q.norm(dim=-1) * k_norm
        return self._fixed["tolerance"]

    def is_max(
        self, scores: Float[Tensor, "batch n_heads q_pos"], keys: Tensor | None = None
    ) -> Tensor:
        """Whether each score (of a key among ``keys``) is its row's maximum over ``keys``
        (every key for None), ``Bool[batch, n_heads, q_pos]``: equal to it within
        :meth:`tolerance`; False for a hidden key or a row with none."""
        assert self.call.maxima is not None
        best = self.call.maxima(keys)
        return torch.isfinite(best) & (scores >= best - self.tolerance())

    def fixed(self, which: str) -> Float[Tensor, "batch n_heads q_pos"]:
        """``p`` at the key every row has: ``"first"`` (key 0), ``"self"`` (the query's own
        position) or ``"previous"`` (the one before it); computed once per call, shared by
        every statistic that asks."""
        if which not in self._fixed:
            assert self.call.lse is not None
            shift = {"first": -self.n_queries - self.offset, "self": self.offset}
            shift["previous"] = self.offset - 1  # clamped at key 0, as the first's
            score = self.scores_shifted(shift[which])
            self._fixed[which] = torch.exp(score - self.call.lse).nan_to_num_(0.0)
        return self._fixed[which]

    def pairs(self, b: Tensor, q: Tensor, k: Tensor) -> Float[Tensor, "pairs n_heads"]:
        """``p(q, k)`` of sequence ``b`` for every head, for listed (b, q, k) triples; 0
        where the mask hides the key."""
        call = self.call
        qs = self._q[b, :, q]  # [pairs, head, d_head]
        ks = call.k[b, :, k].repeat_interleave(self.group, 1)  # [pairs, head, d_head]
        scores = (qs * ks).sum(-1).mul_(call.scale)
        assert call.lse is not None
        if call.mask is not None:
            ok = call.mask[b if call.mask.shape[0] > 1 else torch.zeros_like(b), 0, q, k]
        elif call.causal:
            ok = k <= q + self.offset
        else:
            ok = torch.ones_like(k, dtype=torch.bool)
        return torch.exp(scores - call.lse[b, :, q]).masked_fill_(~ok[:, None], 0.0)

    def argmax(self, rows: Tensor) -> Tensor:
        """The argmax key of the pattern rows where ``rows`` (``Bool[batch, n_heads,
        q_pos]``) is True, -1 elsewhere; computed row by row as :func:`pattern_rows` would
        (first index on ties)."""
        call = self.call
        out = torch.full(rows.shape, -1, dtype=torch.long, device=rows.device)
        for b, h in rows.any(-1).nonzero().tolist():
            chosen = rows[b, h].nonzero()[:, 0]
            step = max(1, self.ROW_BYTES // (4 * int(call.k.shape[2])))
            for sel in chosen.split(step):  # ascending: a chunk's keys end at its last row
                width = int(sel[-1]) + 1 + self.offset if call.causal else call.k.shape[2]
                if call.mask is not None:
                    mask = call.mask[b if call.mask.shape[0] > 1 else 0, 0]
                    hidden = ~mask[sel, :width]
                elif call.causal:
                    key = torch.arange(width, device=sel.device)
                    hidden = key[None, :] > (sel + self.offset)[:, None]
                else:
                    hidden = None
                sink = None if call.sinks is None else call.sinks[h].reshape(1, 1)
                k = call.k[b, h // self.group, :width]
                probs = _softmax_rows(call.q[b, h, sel], k, hidden, call, sink)
                out[b, h, sel] = probs.argmax(-1)
        return out

    def hits(
        self,
        p_best: Float[Tensor, "batch n_heads q_pos"],
        is_target: Callable[[Tensor], Tensor],
        rows: Tensor,
    ) -> Tensor:
        """Whether each row's argmax is a target key, ``Bool[batch, n_heads, q_pos]``.

        ``p_best``: the largest probability on a target key of each row; ``is_target``:
        ``Int[batch, n_heads, q_pos]`` keys → whether each is a target of its row;
        ``rows``: ``Bool[batch, q_pos]``, the rows asked about. A row is decided from
        points where it can be: a target above 1/2 is the argmax; a non-target among the
        first key, the query itself and the one before it that beats the best target
        rules a hit out. Only the other rows are computed whole (:meth:`argmax`). With the
        rows' maxima (:attr:`has_maxima`) every row is decided from them: a hit where the
        best target's probability is the row's largest (within :meth:`tolerance`)."""
        if self.has_maxima:  # the argmax is where a score is the row's maximum
            best = self.top()
            close = p_best >= best * torch.exp(-self.tolerance())
            return close & (best > 0) & rows[:, None]
        eps = self.EPS
        hit = p_best > 0.5 + eps
        miss = torch.zeros_like(hit)
        pos = torch.arange(self.n_queries, device=p_best.device) + self.offset
        for which, key in zip(
            ("first", "self", "previous"),
            (torch.zeros_like(pos), pos, (pos - 1).clamp(min=0)),
            strict=True,
        ):
            keys = key.expand(self.n_seqs, -1)
            p = self.fixed(which)
            other = ~is_target(keys[:, None].expand(-1, self.n_heads, -1))
            miss |= other & (p > p_best + eps)
        todo = rows[:, None] & ~hit & ~miss
        top = self.argmax(todo)
        return (hit | (todo & is_target(top.clamp(min=0)))) & rows[:, None]
