"""The attention output, each row's log-sum-exp and its maxima in one pass of tiles (CPU).

Statistics that read points and the rows' maxima (:class:`headmech.stream.points.Points`,
:mod:`headmech.stream.maxima`: every built-in sequence type, confidence and positional
among them) need three numbers a query row beside the layer's output: its log-sum-exp,
its largest score over every key and its largest over the keys a statistic keeps (the
ordinary tokens). CPU flash attention returns the first and not the others, and the row
path (:mod:`headmech.stream.rows`) writes every score of a block to a buffer that the
reducers read after its tiles (docs/scaling.md: the cost of that write on an AVX2 CPU).

:func:`attend` goes through one sequence's head and one tile of its rows at a time, in a
contiguous scratch tile of the keys those rows may see (a causal tile stops at its own
last row, a sliding window starts at its first row's window): the scores (the product,
then the scale, as the fused kernels), their maxima over every key and over each key set
declared, the softmax in place, its largest probability (``LSE = max − log p_max``: the
largest probability is ``1 / Σ exp(s − max)``) and ``pattern @ values`` into the layer's
output. No score leaves the tile; the flash kernel's structure, with the maxima added.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from headmech.stream.buffers import Buffers

__all__ = ["MIN_TILE_ROWS", "TILE_BYTES", "Attended", "attend"]

# a tile holds about this many bytes of scores, and at least MIN_TILE_ROWS rows: thinner
# q·kᵀ products run slower (one SmolLM2 head at 8,192 keys, one AVX2 core: 64-row tiles
# 2.1-2.4 s a layer, 128-row tiles 1.9-2.1 s)
TILE_BYTES = 2 * 2**20
MIN_TILE_ROWS = 128

Maxima = Float[Tensor, "batch n_heads q_pos"]


class Attended:
    """What :func:`attend` returns.

    Attributes:
        out: the attention output ``[batch, q_pos, n_heads, d_head]``.
        lse: each row's log-sum-exp ``[batch, n_heads, q_pos]`` (``+inf`` for a row with
            no key to attend to, so that every probability read from it is 0).
        every: each row's largest masked score over every key (``-inf``: no key).
        sets: the same over each declared key set, in order.
    """

    def __init__(self, out: Tensor, lse: Tensor, every: Maxima, sets: list[Maxima]) -> None:
        self.out, self.lse, self.every, self.sets = out, lse, every, sets


def attend(
    q: Float[Tensor, "batch n_heads q_pos d_head"],
    k: Float[Tensor, "batch n_kv_heads k_pos d_head"],
    v: Float[Tensor, "batch n_kv_heads k_pos d_head"],
    mask: Bool[Tensor, "batch_or_1 1 q_pos k_pos"] | None,
    scale: float,
    causal: bool,
    key_sets: Sequence[Bool[Tensor, "batch k_pos"]] = (),
    buffers: Buffers | None = None,
) -> Attended:
    """Plain softmax attention (float32, grouped-query heads allowed) with every row's
    log-sum-exp and maxima (module docstring).

    Args:
        q, k, v: queries, keys and values, as the model's attention function gets them.
        mask: True where a query may attend; None: causal (queries aligned to the last
            keys) or, with ``causal`` false, every key.
        scale: the factor on ``q · k``.
        causal: without a mask, queries see no later key.
        key_sets: key sets (``Bool[batch, k_pos]``) to maximise over besides every key.
        buffers: where the scratch tiles live (default: new ones).
    """
    n_seqs, n_heads, n_q, n_keys = (int(d) for d in (*q.shape[:3], k.shape[2]))
    group, buffers = n_heads // int(k.shape[1]), buffers or Buffers()
    out = q.new_empty(n_seqs, n_q, n_heads, int(v.shape[-1]))
    lse, every, *sets = (q.new_empty(n_seqs, n_heads, n_q) for _ in range(2 + len(key_sets)))
    tile = max(MIN_TILE_ROWS, TILE_BYTES // (4 * max(n_keys, 1)))
    rows = [(lo, min(lo + tile, n_q)) for lo in range(0, n_q, tile)]
    exact = math.frexp(scale)[0] == 0.5  # a power of two: scale q, no pass over the scores
    upper = torch.ones(tile, tile, dtype=torch.bool, device=q.device).triu_(1)
    for b in range(n_seqs):
        spans = _spans(mask, b, causal, rows, n_q, n_keys)
        hidden_keys = [(~keys[b]).nonzero()[:, 0] for keys in key_sets]
        seq_mask = None if mask is None else mask[b if mask.shape[0] > 1 else 0, 0]
        for h in range(n_heads):
            kv = h // group
            qh = q[b, h] * scale if exact else q[b, h]
            for (lo, hi), (first, stop) in zip(rows, spans, strict=True):
                picks = (b, h, slice(lo, hi))
                if stop <= first:  # no key for any row of the tile
                    out[b, lo:hi, h], lse[picks] = 0.0, math.inf
                    for m in (every, *sets):
                        m[picks] = -math.inf
                    continue
                s = buffers.take("tile", (hi - lo, stop - first), device=q.device)
                torch.mm(qh[lo:hi], k[b, kv, first:stop].T, out=s)
                if not exact:
                    s.mul_(scale)
                if seq_mask is not None:
                    hidden = buffers.take("tile_mask", tuple(s.shape), torch.bool, q.device)
                    s.masked_fill_(
                        torch.logical_not(seq_mask[lo:hi, first:stop], out=hidden), -math.inf
                    )
                elif causal:  # the keys of the tile's own rows: each row sees up to itself
                    diag, n = n_keys - n_q + lo - first, hi - lo
                    s[:, diag : diag + n].masked_fill_(upper[:n, :n], -math.inf)
                every[picks] = _maxima(s, first, stop, hidden_keys, [m[picks] for m in sets])
                _softmax_lse(s, every[picks], lse[picks])
                torch.mm(s, v[b, kv, first:stop], out=out[b, lo:hi, h])
    return Attended(out, lse, every, sets)


def _softmax_lse(s: Tensor, top: Tensor, lse: Tensor) -> None:
    """The tile's softmax in place and its rows' log-sum-exp into ``lse``, from their
    maxima ``top`` and largest probabilities (``1 / Σ exp(s − max)``); a row with no key
    gets zeros and ``+inf``."""
    torch.ops.aten._softmax.out(s, -1, False, out=s)
    empty = torch.isneginf(top)
    if bool(empty.any()):
        s.nan_to_num_(0.0)
    torch.sub(top, s.amax(-1).log_(), out=lse)
    lse.masked_fill_(empty, math.inf)


def _spans(
    mask: Tensor | None, b: int, causal: bool, rows: list[tuple[int, int]], n_q: int, n_keys: int
) -> list[tuple[int, int]]:
    """Each tile's keys ``first .. stop - 1``: every key one of its rows may see (the
    model's mask, else causal order, else every key)."""
    if mask is None:
        if not causal:
            return [(0, n_keys) for _ in rows]
        return [(0, min(n_keys, n_keys - n_q + hi)) for _, hi in rows]
    seen = mask[b if mask.shape[0] > 1 else 0, 0]
    spans = []
    for lo, hi in rows:
        cols = seen[lo:hi].any(0).nonzero()
        spans.append((int(cols[0, 0]), int(cols[-1, 0]) + 1) if len(cols) else (0, 0))
    return spans


def _maxima(
    s: Float[Tensor, "rows width"],
    first: int,
    stop: int,
    hidden_keys: list[Tensor],
    outs: list[Tensor],
) -> Float[Tensor, " rows"]:
    """Each row's largest score over every key, returned, and over each key set (its
    hidden keys ``hidden_keys``, positions), into ``outs``. A set's hidden keys within the
    tile are few (the special tokens): where they lead the tile (a BOS) its maximum is
    read from the rest of the row, else they are set to ``-inf`` and put back."""
    top: Tensor | None = None
    for cols, m in zip(hidden_keys, outs, strict=True):
        cols = cols[(cols >= first) & (cols < stop)] - first
        c = len(cols)
        if c == 0:
            if top is None:
                top = s.amax(-1)
            m.copy_(top)
            continue
        if bool((cols == torch.arange(c, device=cols.device)).all()):  # leading keys
            if c == s.shape[1]:
                m.fill_(float("-inf"))
            else:
                torch.amax(s[:, c:], -1, out=m)
            if top is None:
                top = torch.maximum(m, s[:, :c].amax(-1))
            continue
        saved = s.index_select(1, cols)
        s.index_fill_(1, cols, float("-inf"))
        torch.amax(s, -1, out=m)
        s.index_copy_(1, cols, saved)
        if top is None:
            top = torch.maximum(m, saved.amax(-1))
    return s.amax(-1) if top is None else top
