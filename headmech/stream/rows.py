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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.stream import blockwise

if TYPE_CHECKING:
    from headmech.stream.attention_call import LayerCall

__all__ = ["RowBlock"]


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

    def __init__(
        self, call: LayerCall, rows: slice, buffers: blockwise.Buffers | None = None
    ) -> None:
        if call.lse is None:
            raise ValueError("RowBlock needs the log-sum-exp of the fused kernel")
        n_seqs, n_heads, n_q = (int(d) for d in call.q.shape[:3])
        n_keys = int(call.k.shape[2])
        width = min(n_keys, rows.stop) if call.causal and n_keys == n_q else n_keys
        shape = (n_seqs, n_heads, rows.stop - rows.start, width)
        # the buffer at once for the widest block of the pass (causal blocks grow): a
        # buffer grown block by block is a new allocation each time (on a GPU, a device
        # allocation and synchronisation each)
        widest = n_seqs * n_heads * (rows.stop - rows.start) * n_keys
        scores = (buffers or blockwise.Buffers()).take(
            "scores", shape, device=call.q.device, reserve=widest
        )
        # the product, then the scale: the fused kernel's order (its LSE is rounded as these)
        torch.matmul(call.q[:, :, rows], call.k[:, :, :width].transpose(-1, -2), out=scores)
        scores.mul_(call.scale)
        if call.softcap is not None:
            scores.div_(call.softcap).tanh_().mul_(call.softcap)
        if call.mask is not None:
            scores.masked_fill_(~call.mask[..., rows, :width], float("-inf"))
        elif call.causal:  # only the keys at or after the block's first query can be hidden
            lo = rows.start + n_keys - n_q
            if lo < width:
                q_pos = torch.arange(rows.start, rows.stop, device=scores.device) + n_keys - n_q
                hidden = torch.arange(lo, width, device=scores.device)[None, :] > q_pos[:, None]
                scores[..., lo:].masked_fill_(hidden, float("-inf"))
        self.scores: Float[Tensor, "batch n_heads rows width"] = scores
        self.lse: Float[Tensor, "batch n_heads rows"] = call.lse[:, :, rows]
        self.rows, self.width = rows, width
        self._probs = False

    def _p(self, s: Tensor, lse: Tensor) -> Tensor:
        """Scores at their rows' LSE to probabilities (0 where the row has no key)."""
        return s if self._probs else torch.exp(s - lse).nan_to_num_(0.0)

    def top(
        self, keys: Bool[Tensor, "batch pos"] | None = None
    ) -> tuple[Float[Tensor, "batch n_heads rows"], Int[Tensor, "batch n_heads rows"]]:
        """Each row's largest probability over the keys where ``keys`` is True (all by
        default) and its key, as :func:`headmech.stream.blockwise.top1` of the pattern
        (first index on ties; 0 and key 0 for a row with none)."""
        values, indices = blockwise.top1(self.scores, keys)
        return self._p(values, self.lse), indices

    def at(self, keys: Int[Tensor, "batch rows"]) -> Float[Tensor, "batch n_heads rows"]:
        """``p(i, keys[b, i])`` for the block's rows (key indices >= 0; a key past the
        block's width, or hidden, gets 0)."""
        n_heads = self.scores.shape[1]
        idx = keys.clamp(max=self.width - 1)[:, None, :, None].expand(-1, n_heads, -1, 1)
        p = self._p(self.scores.gather(-1, idx)[..., 0], self.lse)
        return p.masked_fill_((keys >= self.width)[:, None], 0.0)

    def pairs(self, b: Tensor, q: Tensor, k: Tensor) -> Float[Tensor, "pairs n_heads"]:
        """``p(q, k)`` of sequence ``b`` for listed triples (``q`` a row of the block,
        counted from its first; ``k < width``), every head."""
        return self._p(self.scores[b, :, q, k], self.lse[b, :, q])

    def pattern(self) -> Float[Tensor, "batch n_heads rows width"]:
        """The block's pattern rows, computed in place of the scores (after this call the
        block holds probabilities; :meth:`top`, :meth:`at` and :meth:`pairs` read them).
        Each row is divided by its sum: the kernel's LSE is rounded apart from these
        scores (the module's docstring)."""
        if not self._probs:
            blockwise.forget()  # maxima cached for the scores are not the pattern's
            self.scores.sub_(self.lse[..., None]).exp_().nan_to_num_(0.0)
            # a row with no key sums to 0 and stays 0
            self.scores.div_(self.scores.sum(-1, keepdim=True).clamp_min_(1e-30))
            self._probs = True
        return self.scores
