"""Row statistics of the attention pattern from scores and the kernel's log-sum-exp.

Inside a model's attention call the fused kernel returns each query row's log-sum-exp
(:class:`headmech.stream.attention_call.LayerCall`). With it, a block of query rows'
scores (``scale · q · kᵀ``, ``-inf`` where the mask hides a key) holds every statistic a
row has without a softmax: ``p(i, j) = exp(s_ij − LSE_i)`` at any key, and a row's
maximum and argmax over any set of keys straight from the scores (the softmax is
monotone, so the argmax is the same key and the maximum is ``exp(max s − LSE)``). The
probabilities of a whole row are computed only where a statistic asks for them
(:meth:`RowBlock.pattern`, in place). The kernel's log-sum-exp comes from its own float32
scores; where scores reach the thousands (Qwen2.5-Coder-1.5B's layer 0: up to 4,514, one
unit in the last place 4.9e-4) a different rounding of them moves every probability by
the same factor. The scores are therefore computed in the kernel's order, the product
first and the scale after it (``q · scale`` first left rows of that layer summing to
1 ± 1e-3, the product first to 1 ± 1.2e-4), and :meth:`RowBlock.pattern` divides its
rows by their sums, the eager softmax's precision again (1.5e-5 from float64); the point
reads (``top``, ``at``, ``pairs``) keep the 1e-4 relative error. The scores go to one
buffer per pass (:class:`ScoreBuffer`), reused by every block of every layer, so the peak
memory of a pass does not depend on how the allocator treats freed blocks.

**Shared scores** (CPU). Where a pass builds rows for every query of a layer anyway, the
attention call skips the fused kernel and hands over the values instead
(``LayerCall.values``): each block's scores become the softmax in place and the block's
output rows are ``pattern @ values``, written into ``LayerCall.out``, one sequence's head
and one tile of its rows (:data:`TILE_BYTES`) at a time while they are in the cache, which
is also when the first level of the rows' maxima is taken
(:func:`headmech.stream.blockwise.keep_chunk_maxima`). The layer's q·kᵀ is then computed once, not
once in the kernel and once more for the statistics, and the block holds the eager
pattern itself (no log-sum-exp: :meth:`RowBlock.top`, :meth:`RowBlock.at` and the others
read probabilities). docs/scaling.md has the measurements.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.stream import blockwise
from headmech.stream.buffers import Buffers

if TYPE_CHECKING:
    from headmech.stream.attention_call import LayerCall

__all__ = ["MIN_TILE_ROWS", "TILE_BYTES", "RowBlock"]

# Shared scores go through a head's rows in tiles of about this many bytes of scores (a
# core's L2 cache), at least MIN_TILE_ROWS rows
TILE_BYTES = 2 * 2**20
MIN_TILE_ROWS = 16


class RowBlock:
    """Query rows ``rows`` of one layer's attention as scores and log-sum-exp.

    Args:
        call: the layer's call, with ``lse``.
        rows: the query rows of the block.
        buffers: the pass's buffers (the scores go to ``"scores"``; default: a new tensor).

    Attributes:
        width: keys ``0 .. width - 1`` (causal attention leaves out the keys after the
            block's last query, as :func:`headmech.stream.attention_call.pattern_rows`).
    """

    def __init__(self, call: LayerCall, rows: slice, buffers: Buffers | None = None) -> None:
        if call.lse is None and call.out is None:
            raise ValueError("RowBlock needs the log-sum-exp of the fused kernel or the values")
        n_seqs, n_heads, n_q = (int(d) for d in call.q.shape[:3])
        n_keys = int(call.k.shape[2])
        width = min(n_keys, rows.stop) if call.causal and n_keys == n_q else n_keys
        shape = (n_seqs, n_heads, rows.stop - rows.start, width)
        # the buffer at once for the widest block of the pass (causal blocks grow): a
        # buffer grown block by block is a new allocation each time (on a GPU, a device
        # allocation and synchronisation each)
        widest = n_seqs * n_heads * (rows.stop - rows.start) * n_keys
        scores = (buffers or Buffers()).take("scores", shape, device=call.q.device, reserve=widest)
        self._call, self.rows, self.width = call, rows, width
        self.scores: Float[Tensor, "batch n_heads rows width"] = scores
        self.lse: Float[Tensor, "batch n_heads rows"] | None = (
            None if call.lse is None else call.lse[:, :, rows]
        )
        self._probs = call.out is not None
        self._hide = self._hidden(n_keys, n_q)
        hidden = self._hide
        if call.out is None:
            self._scores(slice(None), slice(None), hidden)
            return
        # shared scores: one sequence's head at a time, a tile of its rows at a time, scores
        # to pattern to output (and the first level of its row maxima) while the tile is in
        # the cache (docs/scaling.md)
        assert call.values is not None
        empty = call.mask is not None and not bool(call.mask[..., rows, :width].any(-1).all())
        group = n_heads // call.values.shape[1]  # query heads per key-value head
        n_rows = rows.stop - rows.start
        tile = max(MIN_TILE_ROWS, TILE_BYTES // (4 * width))
        chunked = width - 1 >= 4 * blockwise.CHUNK  # row_max reads chunk maxima from here
        n_chunks = (width - 1) // blockwise.CHUNK
        maxima = (buffers or Buffers()).take(
            "chunk_maxima", (n_seqs, n_heads, n_rows, n_chunks), device=call.q.device
        )
        spans = self._spans(n_keys, n_q, tile)
        for b, h in itertools.product(range(n_seqs), range(n_heads)):
            values = call.values[b, h // group, :width]
            for sub, keys in spans:
                block = self._scores(slice(b, b + 1), slice(h, h + 1), hidden, sub, keys)
                torch.ops.aten._softmax.out(block, -1, False, out=block)
                if empty:
                    block.nan_to_num_(0.0)  # a query with no key to attend to (padding): 0
                out = call.out[b, rows.start + sub.start : rows.start + sub.stop, h]
                torch.mm(block[0, 0, :, keys], values[keys], out=out)
                if chunked:
                    tail = block[0, 0, :, 1 : 1 + n_chunks * blockwise.CHUNK]
                    torch.amax(
                        tail.unflatten(-1, (n_chunks, blockwise.CHUNK)), -1, out=maxima[b, h, sub]
                    )
        if chunked:  # keys 1 .. width - 1: every key but the first (a BOS), and every key
            for b in range(n_seqs):
                blockwise.keep_chunk_maxima(self.scores, b, 1, width, maxima[b])

    def _spans(self, n_keys: int, n_q: int, tile: int) -> list[tuple[slice, slice]]:
        """The block's tiles of rows, each with the keys that hold every key its rows may
        see: a tile's products are computed over those only (a causal tile's rows see no
        key after its own last row; a sliding window's, none before its first row's
        window), its other keys are ``-inf`` before the softmax."""
        call, rows, width = self._call, self.rows, self.width
        n_rows = rows.stop - rows.start
        tiles = [slice(lo, min(lo + tile, n_rows)) for lo in range(0, n_rows, tile)]
        if call.mask is None:
            if not call.causal:
                return [(sub, slice(0, width)) for sub in tiles]
            first = rows.start + n_keys - n_q  # the block's first row's last key
            return [(sub, slice(0, min(width, first + sub.stop))) for sub in tiles]
        seen = call.mask[..., rows, :width].flatten(0, -3).any(0)  # [rows, width]
        anywhere = seen.any(-1)
        first = seen.int().argmax(-1).masked_fill_(~anywhere, width)
        stop = (width - seen.flip(-1).int().argmax(-1)).masked_fill_(~anywhere, 0)
        spans = []
        for sub, lo, hi in zip(tiles, first.split(tile), stop.split(tile), strict=True):
            left, right = int(lo.min()), int(hi.max())
            spans.append((sub, slice(min(left, right), right)))
        return spans

    def _hidden(self, n_keys: int, n_q: int) -> tuple[Tensor, int] | None:
        """The block's hidden keys as a mask and the first key it covers: from the first
        key that some query of the block may not see (causal: the block's first query's
        next key), so the scores are filled only there; None: every key is visible."""
        call, rows, width = self._call, self.rows, self.width
        if call.mask is not None:  # the model's: [batch | 1, 1, rows, width]
            hidden = ~call.mask[..., rows, :width]
            cols = hidden.flatten(0, -2).any(0).nonzero()
            if len(cols) == 0:
                return None
            lo = int(cols[0, 0])
            return hidden[..., lo:], lo
        lo = rows.start + n_keys - n_q
        if not call.causal or lo >= width:
            return None
        q_pos = torch.arange(rows.start, rows.stop, device=self.scores.device) + n_keys - n_q
        return torch.arange(lo, width, device=self.scores.device)[None, :] > q_pos[:, None], lo

    def _scores(
        self,
        seqs: slice,
        heads: slice,
        hidden: tuple[Tensor, int] | None,
        sub: slice = slice(None),
        keys: slice | None = None,
    ) -> Tensor:
        """Sequences ``seqs``' heads ``heads`` of the block's masked scores (its rows
        ``sub``, counted from its first), into the block's buffer; with ``keys``, the rows
        see no key outside that span: only its scores are computed, the rest is ``-inf``.

        The product, then the scale: the fused kernel's order (its LSE is rounded as
        these); a scale that is a power of two multiplies the queries instead (no rounding
        either way: the same scores, without a pass over them)."""
        call, block = self._call, self.scores[seqs, heads, sub]
        left, stop = (0, self.width) if keys is None else (keys.start, keys.stop)
        out = block[..., left:stop]
        q = call.q[seqs, heads, self.rows][:, :, sub]
        k = self._keys(seqs, heads)[:, :, left:stop].transpose(-1, -2)
        exact = math.frexp(call.scale)[0] == 0.5
        if out.shape[0] * out.shape[1] == 1:  # one head: a plain GEMM into the strided rows
            torch.mm((q * call.scale if exact else q)[0, 0], k[0, 0], out=out[0, 0])
        else:
            torch.matmul(q * call.scale if exact else q, k, out=out)
        if not exact:
            out.mul_(call.scale)
        if call.softcap is not None:
            out.div_(call.softcap).tanh_().mul_(call.softcap)
        block[..., :left].fill_(float("-inf"))
        block[..., stop:].fill_(float("-inf"))
        if hidden is not None:
            mask, lo = hidden
            if mask.dim() == 4 and mask.shape[0] > 1:  # one mask per sequence
                mask = mask[seqs]
            mask = mask[..., sub, :]
            if mask.dim() == 2 and sub.start:  # causal: the tile's rows see the keys before it
                mask, lo = mask[:, sub.start :], lo + sub.start
            start = max(lo, left)
            if start < stop:
                block[..., start:stop].masked_fill_(
                    mask[..., start - lo : stop - lo], float("-inf")
                )
        return block

    def _keys(self, seqs: slice, heads: slice) -> Tensor:
        """The keys of heads ``heads`` (query heads), ``[seqs, heads, width, d_head]``:
        under shared scores the call keeps one key per key-value head (a view where
        ``heads`` is one head; the one case the shared loop asks for)."""
        k, n_heads = self._call.k, int(self._call.q.shape[1])
        group = n_heads // int(k.shape[1])  # query heads per key-value head
        if group == 1:
            return k[seqs, heads, : self.width]
        first, stop, _ = heads.indices(n_heads)
        if stop - first == 1:
            return k[seqs, first // group : first // group + 1, : self.width]
        return k[seqs, :, : self.width].repeat_interleave(group, 1)[:, heads]

    @property
    def probabilities(self) -> bool:
        """Whether the block holds its pattern (shared scores, or after :meth:`pattern`)
        rather than scores."""
        return self._probs

    def _p(self, s: Tensor, rows: Tensor | slice = slice(None), b: Tensor | None = None) -> Tensor:
        """Values read from the block (``[batch, n_heads, rows]``-shaped, or ``[pairs,
        n_heads]`` with the pairs' sequences ``b`` and ``rows``) as probabilities: scores at
        their rows' LSE (0 where a row has no key); the values themselves once the block
        holds its pattern."""
        if self._probs:
            return s
        assert self.lse is not None
        lse = self.lse[:, :, rows] if b is None else self.lse[b, :, rows]
        return torch.exp(s - lse).nan_to_num_(0.0)

    def top(
        self, keys: Bool[Tensor, "batch pos"] | None = None
    ) -> tuple[Float[Tensor, "batch n_heads rows"], Int[Tensor, "batch n_heads rows"]]:
        """Each row's largest probability over the keys where ``keys`` is True (all by
        default) and its key, as :func:`headmech.stream.blockwise.top1` of the pattern
        (first index on ties; 0 and key 0 for a row with none)."""
        values, indices = blockwise.top1(self.scores, keys)
        return self._p(values), indices

    def at(self, keys: Int[Tensor, "batch rows"]) -> Float[Tensor, "batch n_heads rows"]:
        """``p(i, keys[b, i])`` for the block's rows (key indices >= 0; a key past the
        block's width, or hidden, gets 0)."""
        n_heads = self.scores.shape[1]
        idx = keys.clamp(max=self.width - 1)[:, None, :, None].expand(-1, n_heads, -1, 1)
        p = self._p(self.scores.gather(-1, idx)[..., 0])
        return p.masked_fill_((keys >= self.width)[:, None], 0.0)

    def pairs(self, b: Tensor, q: Tensor, k: Tensor) -> Float[Tensor, "pairs n_heads"]:
        """``p(q, k)`` of sequence ``b`` for listed triples (``q`` a row of the block,
        counted from its first; ``k < width``), every head."""
        return self._p(self.scores[b, :, q, k], q, b)

    def rows_at(
        self, idx: Int[Tensor, "batch n_heads steps width"]
    ) -> Float[Tensor, "batch n_heads steps width"]:
        """Whole probability rows of the block's queries ``idx`` (counted from its first,
        expanded to the width, as ``gather`` along the rows takes them), without turning the
        other rows into probabilities."""
        rows = self.scores.gather(2, idx)
        if self._probs:
            return rows
        assert self.lse is not None
        return torch.exp(rows - self.lse.gather(2, idx[..., 0])[..., None]).nan_to_num_(0.0)

    def visible(self) -> Bool[Tensor, "batch rows width"]:
        """Which keys each query of the block may attend to (the model's mask, causal
        order), the same for every head."""
        n_seqs, _, n_rows, width = (int(d) for d in self.scores.shape)
        seen = torch.ones(n_seqs, n_rows, width, dtype=torch.bool, device=self.scores.device)
        hidden = self._hide
        if hidden is not None:
            mask, lo = hidden
            seen[..., lo:] &= ~(mask[:, 0] if mask.dim() == 4 else mask)
        return seen

    def pattern(self) -> Float[Tensor, "batch n_heads rows width"]:
        """The block's pattern rows, computed in place of the scores (after this call the
        block holds probabilities; :meth:`top`, :meth:`at` and :meth:`pairs` read them).
        Each row is divided by its sum: the kernel's LSE is rounded apart from these
        scores (the module's docstring)."""
        if not self._probs:
            assert self.lse is not None
            blockwise.forget()  # maxima cached for the scores are not the pattern's
            self.scores.sub_(self.lse[..., None]).exp_().nan_to_num_(0.0)
            # a row with no key sums to 0 and stays 0
            self.scores.div_(self.scores.sum(-1, keepdim=True).clamp_min_(1e-30))
            self._probs = True
        return self.scores
