"""The attention output, each row's log-sum-exp and its maxima in one pass of tiles (CPU).

Statistics that read points and the rows' maxima (:class:`headmech.stream.points.Points`,
:mod:`headmech.stream.maxima`: every built-in sequence type, confidence and positional
among them) need three numbers a query row beside the layer's output: its log-sum-exp,
its largest score over every key and its largest over the keys a statistic keeps (the
ordinary tokens). CPU flash attention returns the first and not the others, and the row
path (:mod:`headmech.stream.rows`) writes every score of a block to a buffer that the
reducers read after its tiles (docs/scaling.md: the cost of that write on an AVX2 CPU).

:func:`attend` goes through one sequence's rows a tile at a time (the keys those rows may
see: a causal tile stops at its own last row, a sliding window starts at its first row's
window); each key head's keys meet the rows of every query head it serves (grouped-query
attention) in one product, in a contiguous scratch tile. Without a model mask a key head
goes through every tile (its keys and values stay in cache); under one, every key head of
a tile in turn, so that the tile's mask is built once.
In the tile: the scores (the product, then the scale, as the
fused kernels), their maxima over every key and over each key set declared,
``p = 2^(s · log2 e − max · log2 e)`` in place (``exp2`` runs 1.7x faster than ``exp`` on an
AVX2 core; the row's largest ``p`` is 1 to within the rounding of ``max · log2 e``, about
1e-6 relative for scores of 20), ``Σ p`` (so ``LSE = max + log Σ p``)
and ``(p @ values) / Σ p`` into the layer's output. No score leaves the tile: the flash
kernel's structure, with the maxima added.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from headmech.stream.buffers import Buffers

__all__ = ["MIN_TILE_ROWS", "TILE_BYTES", "Attended", "attend"]

# a tile holds about this many bytes of scores, and at least MIN_TILE_ROWS rows (those of
# every query head of a key head together): thinner or thicker products run slower (one
# SmolLM2 layer at 8,192 tokens, 3 query heads a key head, one AVX2 core, best of 3: 96
# rows 1.44 s, 128 1.49 s, 192 1.31-1.34 s, 256 1.39 s, 384 1.36 s; SDPA 1.12-1.16 s)
TILE_BYTES = 2 * 2**20
MIN_TILE_ROWS = 192

Maxima = Float[Tensor, "batch n_heads q_pos"]
_LOG2E = 1.0 / math.log(2.0)


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
    n_kv, d_head, d_v = int(k.shape[1]), int(q.shape[-1]), int(v.shape[-1])
    group, buffers = n_heads // n_kv, buffers or Buffers()
    out = q.new_empty(n_seqs, n_q, n_heads, d_v)
    lse, every, *sets = (q.new_empty(n_seqs, n_heads, n_q) for _ in range(2 + len(key_sets)))
    # rows of each query head a tile: the group's rows fill about TILE_BYTES of scores,
    # at least MIN_TILE_ROWS in all
    tile = -(-MIN_TILE_ROWS // group)
    tile = min(n_q, max(tile, TILE_BYTES // (4 * group * max(n_keys, 1))))
    rows = [(lo, min(lo + tile, n_q)) for lo in range(0, n_q, tile)]
    exact = math.frexp(scale)[0] == 0.5  # a power of two: scale q, no pass over the scores
    upper = torch.ones(tile, tile, dtype=torch.bool, device=q.device).triu_(1)
    for b in range(n_seqs):
        spans = _spans(mask, b, causal, rows, n_q, n_keys)
        hidden_keys = [(~keys[b]).nonzero()[:, 0] for keys in key_sets]
        plans = [[_leading(cols, first, stop) for cols in hidden_keys] for first, stop in spans]
        seq_mask = None if mask is None else mask[b if mask.shape[0] > 1 else 0, 0]
        tiles = []
        for t, ((lo, hi), (first, stop)) in enumerate(zip(rows, spans, strict=True)):
            if stop > first:
                tiles.append(t)
            else:  # no key for any row of the tile
                out[b, lo:hi], lse[b, :, lo:hi] = 0.0, math.inf
                for m in (every, *sets):
                    m[b, :, lo:hi] = -math.inf
        # under a mask, every key head of a tile in turn (the tile's 0 / -inf mask built
        # once); else a key head through every tile (its keys and values stay in cache:
        # 1.7% faster on one SmolLM2-shaped layer at 8,192 tokens, ABBA)
        if seq_mask is None:
            order = [(t, kv) for kv in range(n_kv) for t in tiles]
        else:
            order = [(t, kv) for t in tiles for kv in range(n_kv)]
        built, keyless, bias = -1, False, None
        for t, kv in order:
            (lo, hi), (first, stop), plan = rows[t], spans[t], plans[t]
            n, width, heads = hi - lo, stop - first, slice(kv * group, (kv + 1) * group)
            if seq_mask is not None and t != built:  # the mask as 0 / -inf, a tile
                seen = seq_mask[lo:hi, first:stop]
                keyless, built = not bool(seen.any(-1).all()), t
                bias = buffers.take("tile_bias", (n, width), q.dtype, q.device).zero_()
                bias.masked_fill_(~seen, -math.inf)
            qt = buffers.take("tile_q", (group, n, d_head), q.dtype, q.device)
            torch.mul(q[b, heads, lo:hi], scale if exact else 1.0, out=qt)
            s = buffers.take("tile", (group * n, width), q.dtype, q.device)
            torch.mm(qt.view(group * n, d_head), k[b, kv, first:stop].T, out=s)
            s3 = s.view(group, n, width)
            if not exact:
                s.mul_(scale)
            if bias is not None:  # added to every query head's scores (add_ runs 10x
                s3.add_(bias)  # faster than masked_fill_)
            elif causal:  # the keys of the tile's own rows: each row sees up to itself
                diag = n_keys - n_q + lo - first
                s3[:, :, diag : diag + n].masked_fill_(upper[:n, :n], -math.inf)
            top = every[b, heads, lo:hi]
            _maxima(s3, plan, top, [m[b, heads, lo:hi] for m in sets])
            total = _exp2_rows(s, top.reshape(-1), keyless)
            o = buffers.take("tile_out", (group, n, d_v), q.dtype, q.device)
            torch.mm(s, v[b, kv, first:stop], out=o.view(group * n, d_v))
            o.div_(total.view(group, n, 1))
            torch.add(top, total.view(group, n).log_(), out=lse[b, heads, lo:hi])
            if keyless:  # a row without a key: output 0, every probability 0
                o.nan_to_num_(0.0)
                lse[b, heads, lo:hi].masked_fill_(torch.isneginf(top), math.inf)
            out[b, lo:hi, heads] = o.transpose(0, 1)
    return Attended(out, lse, every, sets)


def _exp2_rows(
    s: Float[Tensor, "rows width"], top: Float[Tensor, " rows"], keyless: bool
) -> Tensor:
    """``exp(s − top)`` in place as ``2^(s · log2 e − top · log2 e)`` (one fused
    multiply-add before ``exp2``: 3% faster a layer than subtracting, then scaling; the
    maximum's term is 1 within the rounding of ``top · log2 e``), and each row's sum (about
    1 or more; 0 for a row with no key where ``keyless``)."""
    if keyless:  # -inf - -inf would be nan: such a row's terms stay exp(-inf) = 0
        top = top.masked_fill(torch.isneginf(top), 0.0)
    torch.add(top[:, None] * -_LOG2E, s, alpha=_LOG2E, out=s).exp2_()
    return s.sum(-1)


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


def _leading(cols: Tensor, first: int, stop: int) -> int | Tensor | None:
    """How a key set's hidden keys ``cols`` (positions) meet the tile of keys ``first ..
    stop - 1``: None (none in it), their count where they lead it (a BOS), else their
    positions in the tile. The same for every head of the tile."""
    cols = cols[(cols >= first) & (cols < stop)] - first
    c = len(cols)
    if c == 0:
        return None
    return c if bool((cols == torch.arange(c, device=cols.device)).all()) else cols


def _maxima(
    s: Float[Tensor, "heads rows width"],
    plan: list[int | Tensor | None],
    top: Float[Tensor, "heads rows"],
    outs: list[Float[Tensor, "heads rows"]],
) -> None:
    """Each row's largest score over every key into ``top`` and over each key set (how
    its hidden keys meet the tile: ``plan``, :func:`_leading`) into ``outs``. Hidden keys
    that lead the tile (a BOS): the set's maximum is read from the rest of the row; others
    (few: the special tokens) are set to ``-inf`` and put back."""
    done = False
    for hidden, m in zip(plan, outs, strict=True):
        if hidden is None:
            if not done:
                torch.amax(s, -1, out=top)
                done = True
            m.copy_(top)
        elif isinstance(hidden, int):
            if hidden == s.shape[-1]:
                m.fill_(-math.inf)
            else:
                torch.amax(s[..., hidden:], -1, out=m)
                if not done:
                    torch.maximum(m, s[..., :hidden].amax(-1), out=top)
                    done = True
        else:
            saved = s.index_select(-1, hidden)
            s.index_fill_(-1, hidden, -math.inf)
            torch.amax(s, -1, out=m)
            s.index_copy_(-1, hidden, saved)
            if not done:
                torch.maximum(m, saved.amax(-1), out=top)
                done = True
    if not done:
        torch.amax(s, -1, out=top)
