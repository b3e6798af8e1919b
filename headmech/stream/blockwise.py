"""Attention patterns one block of queries at a time, from the hooked queries and keys.

A layer's full pattern is ``batch x heads x T x T`` floats: 2.4 GB per layer for
SmolLM2's 9 heads at 8,192 tokens. Every catalog statistic is a sum over query positions,
so none needs the whole pattern at once. Here the pattern is recomputed from the layer's
queries and keys (rotary embeddings applied as the model applies them, grouped-query
key heads repeated for their query heads, the model's scale, causal and padding masks)
``rows`` queries at a time; the engine hands each block to the reducers and lets it go,
while the model itself runs its fused attention (:func:`headmech.stream.forward.fast_attention`).

:func:`geometry` reads the scale, masks and rotary function from the model and refuses
attention this module does not reproduce (sliding windows, logit soft-capping, sink
logits, q/k norms, scaled keys); the engine also checks the blocks against the model's
own pattern on a short input before it trusts them for a model
(:func:`headmech.stream.engine.stream_statistics`, ``attention="auto"``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "BLOCK_MEMORY",
    "CHUNK",
    "Geometry",
    "capture_rotary",
    "default_block_memory",
    "forget",
    "geometry",
    "keep_chunk_maxima",
    "pattern_rows",
    "rotate",
    "rows_per_block",
    "row_max",
    "top1",
]

# block memory: scores, mask, softmax and one reducer temporary per block entry
_BYTES_PER_ENTRY = 4 * 4
# attributes of Hugging Face attention modules whose effect the blocks do not reproduce
_UNSUPPORTED = ("sinks", "attn_logit_softcapping", "key_multiplier", "q_norm", "k_norm")


@dataclass(frozen=True)
class Geometry:
    """What turns a layer's hooked q and k into its attention pattern.

    Attributes:
        n_heads: query heads per layer.
        n_kv_heads: key/value heads (fewer under grouped-query attention).
        causal: queries see only keys at or before them.
        scales: per layer, the factor on ``q · k``.
        rotary: the model's ``apply_rotary_pos_emb`` (rotary models), else None.
    """

    n_heads: int
    n_kv_heads: int
    causal: bool
    scales: tuple[float, ...]
    rotary: Callable[..., tuple[Tensor, Tensor]] | None


def _layer_scale(hf: Any, d_head: int, layer: int) -> float:
    scale = getattr(hf, "scaling", None)
    scale = float(d_head**-0.5 if scale is None else scale)
    if getattr(hf, "scale_attn_by_inverse_layer_idx", False):  # GPT-2's option
        scale /= float(layer + 1)
    return scale


def geometry(model: TransformerBridge) -> Geometry | str:
    """The model's attention geometry, or the reason its pattern cannot be rebuilt from q
    and k here."""
    # rotary attention bridges, separate (LLaMA) or joint q/k/v (GPT-NeoX, Phi-3)
    from transformer_lens.model_bridge.generalized_components.position_embedding_hooks_mixin import (
        PositionEmbeddingHooksMixin,
    )

    cfg = model.cfg
    n_heads = int(cfg.n_heads)
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    d_head = int(cfg.d_head)
    rotary, scales = None, []
    for layer, block in enumerate(model.blocks):
        attn = getattr(block, "attn", None)
        hf = getattr(attn, "original_component", None)
        if hf is None:
            return f"layer {layer} has no attention module"
        config = getattr(hf, "config", None)
        if getattr(config, "sliding_window", None) is not None:
            return "sliding-window attention"
        for name in _UNSUPPORTED:
            if getattr(hf, name, None) is not None or name in getattr(attn, "submodules", {}):
                return f"attention with {name}"
        if isinstance(attn, PositionEmbeddingHooksMixin):
            rotary = getattr(sys.modules[type(hf).__module__], "apply_rotary_pos_emb", None)
            if rotary is None:
                return f"no apply_rotary_pos_emb next to {type(hf).__name__}"
        scales.append(_layer_scale(hf, d_head, layer))
    causal = getattr(cfg, "attention_dir", "causal") == "causal"
    return Geometry(n_heads, n_kv, causal, tuple(scales), rotary)


def rotate(
    q: Float[Tensor, "batch pos n_heads d_head"],
    k: Float[Tensor, "batch pos n_kv_heads d_head"],
    position_embeddings: tuple[Tensor, Tensor] | None,
    geom: Geometry,
) -> tuple[Float[Tensor, "batch n_heads pos d_head"], Float[Tensor, "batch n_heads pos d_head"]]:
    """Queries and keys as attention multiplies them, in fp32: rotary embeddings applied
    (the model's own function on its ``(cos, sin)``), one key head per query head."""
    q = q.float().transpose(1, 2)
    k = k.float().transpose(1, 2)
    if geom.rotary is not None:
        if position_embeddings is None:
            raise RuntimeError("a rotary model's attention received no position_embeddings")
        cos, sin = (t.float() for t in position_embeddings)
        q, k = geom.rotary(q, k, cos, sin)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: kv head j serves a run of heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q, k


BLOCK_MEMORY = 256 * 2**20  # default bytes for one block of rebuilt pattern rows (CPU)
# On a GPU the blocks' cost is their kernel launches, not their arithmetic: measured on an
# H200 (benchmarks/bench_call.py, LLaMA-3.2-1B's shape, bf16, 8,192 tokens, every type on
# the sequence) 86,632 launches took 2.1 s of CPU for 0.33 s of GPU work with 2 GiB blocks,
# and 256 MiB blocks were 5x slower again. A CUDA device's blocks take a quarter of its free
# memory, up to this much:
CUDA_BLOCK_MEMORY_MAX = 16 * 2**30


def default_block_memory(device: torch.device | str, free: int | None = None) -> int:
    """Bytes for one block of rows on ``device``: :data:`BLOCK_MEMORY` on a CPU; on a CUDA
    device a quarter of its free memory (``free``: as ``torch.cuda.mem_get_info`` gives it),
    at least :data:`BLOCK_MEMORY` and at most :data:`CUDA_BLOCK_MEMORY_MAX`."""
    device = torch.device(device)
    if device.type != "cuda":
        return BLOCK_MEMORY
    if free is None:
        free = int(torch.cuda.mem_get_info(device)[0])
    return max(BLOCK_MEMORY, min(free // 4, CUDA_BLOCK_MEMORY_MAX))


def rows_per_block(n_seqs: int, n_heads: int, n_keys: int, budget_bytes: int) -> int:
    """Query rows per block so that one block and its temporaries fit ``budget_bytes``."""
    per_row = n_seqs * n_heads * n_keys * _BYTES_PER_ENTRY
    return max(1, min(n_keys, budget_bytes // max(per_row, 1)))


def pattern_rows(
    q: Float[Tensor, "batch n_heads pos d_head"],
    k: Float[Tensor, "batch n_heads pos d_head"],
    keys: Bool[Tensor, "batch pos"],
    geom: Geometry,
    layer: int,
    rows: slice,
) -> Float[Tensor, "batch n_heads rows width"]:
    """The attention pattern's query rows ``rows``: softmax of the scaled scores over the
    real keys (``keys``) a query may see; a row with no visible key is zero.

    Under causal attention the keys after the block's last query get no weight and are
    left out: the block covers keys ``0 .. width - 1`` with ``width = rows.stop`` (the
    whole sequence otherwise), which halves the work over a sequence."""
    n = k.shape[2]
    width = min(n, rows.stop) if geom.causal else n
    qb, kb = q[:, :, rows], k[:, :, :width]
    b, h, r, d = qb.shape
    # the scale rides in the matrix product (BLAS alpha): no extra pass over the scores
    scores = torch.baddbmm(
        qb.new_empty(()),
        qb.reshape(b * h, r, d),
        kb.reshape(b * h, width, d).transpose(1, 2),
        beta=0,
        alpha=geom.scales[layer],
    ).view(b, h, r, width)
    # masks touch only what they hide: the padding keys, and under causal attention the
    # square of keys rows.start .. width - 1 (every earlier key is visible to the block)
    pad = ~keys[:, :width]  # [batch, width]
    hidden = pad[:, None, None, :]
    if bool(pad.any()):
        scores.masked_fill_(hidden, float("-inf"))
    if geom.causal:
        first = rows.start
        future = torch.ones(width - first, width - first, dtype=torch.bool, device=q.device)
        future = future.triu(1)[: rows.stop - first]  # [rows, keys first .. width - 1]
        scores[..., first:].masked_fill_(future, float("-inf"))
        hidden = hidden[..., first:] | future
    empty = hidden.all(-1, keepdim=True)  # [batch, 1, rows or 1, 1]: no key to attend to
    if geom.causal and first > 0:
        empty = empty & pad[:, None, None, :first].all(-1, keepdim=True)
    if bool(empty.any()):
        scores.masked_fill_(empty, 0.0)
        return torch.softmax(scores, dim=-1).masked_fill_(empty, 0.0)
    return torch.softmax(scores, dim=-1)


# the block reducers are looking at, and the row maxima asked of it:
# [block, {("run", sequence, lo, hi): (values, indices), ("chunks", sequence, lo, hi):
# chunk maxima}, [(keys, (values, indices))]]
_TOP: list[Any] = [None, {}, []]


def top1(
    pattern: Float[Tensor, "batch n_heads rows width"],
    keys: Bool[Tensor, "batch pos"] | None = None,
) -> tuple[Float[Tensor, "batch n_heads rows"], Tensor]:
    """``(max, argmax)`` of each pattern row over the keys where ``keys`` is True (all by
    default; the first index wins ties, as in ``torch.max``).

    Several reducers ask this of the same block, so it is computed once per block and mask
    (the engine calls :func:`forget` when the block is done), and from views: the maximum
    over a run of keys (the ordinary tokens between a BOS and the padding) is read in
    place, and the maximum over every key is that run's combined with the first key's."""
    if _TOP[0] is not pattern:
        _TOP[0], _TOP[1], _TOP[2] = pattern, {}, []
    for mask, out in _TOP[2]:
        if (mask is None) == (keys is None) and (
            keys is None or mask is keys or torch.equal(mask, keys)
        ):
            return out
    width = pattern.shape[-1]
    if keys is None:
        out = _all_keys_max(pattern) if width > 1 else row_max(pattern)
    else:
        out = _masked_max(pattern, keys)
    values, indices = out
    _TOP[2].append((keys, (values, indices)))
    return values, indices


# keys per chunk of row_max's first level (measured on one CPU thread, 9 heads x 227 rows
# x 8,191 keys: 3.4 ms at 64, 4.2 ms at 32, 3.7 ms at 128, against 8.4 ms for torch.max)
CHUNK = 64


def row_max(x: Float[Tensor, "... width"], chunks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``x.max(-1)``: each row's maximum and the first key that holds it, in two levels.

    ``torch.max`` with indices is a slow reduction on a CPU (as slow as a softmax of the
    same rows); ``amax`` is vectorised. So the rows' chunks of :data:`CHUNK` keys get
    their maxima first (``chunks``: already taken, ``[..., width // CHUNK]``), the first
    chunk with the row's maximum is found among those, and the key within that chunk (its
    first maximum) by ``max`` over the chunk alone. Ties go to the first key, as in
    ``torch.max``; rows narrower than four chunks go to it."""
    width = x.shape[-1]
    n = width // CHUNK * CHUNK
    if width < 4 * CHUNK or x.stride(-1) != 1:
        return x.max(-1)
    head = x[..., :n]
    if chunks is None:
        chunks = head.unflatten(-1, (n // CHUNK, CHUNK)).amax(-1)
    _, chunk = chunks.max(-1)
    start = chunk * CHUNK
    keys = start[..., None] + torch.arange(CHUNK, device=x.device)
    value, offset = head.gather(-1, keys).max(-1)
    index = start + offset
    if n < width:  # the keys after the last whole chunk: a later key must be larger
        tail, at = x[..., n:].max(-1)
        later = tail > value
        value, index = torch.where(later, tail, value), torch.where(later, at + n, index)
    return value, index


def keep_chunk_maxima(pattern: Tensor, seq: int, lo: int, hi: int, chunks: Tensor) -> None:
    """Record the first level of :func:`row_max` over sequence ``seq``'s keys ``lo .. hi -
    1`` of ``pattern`` (``chunks``: each row's maxima of its whole chunks of
    :data:`CHUNK` keys from ``lo``), taken while the rows were in the cache: the maxima
    over that run (:func:`top1`) then start from them."""
    if _TOP[0] is not pattern:
        _TOP[0], _TOP[1], _TOP[2] = pattern, {}, []
    _TOP[1][("chunks", seq, lo, hi)] = chunks


def _run_max(pattern: Tensor, seq: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """Max and argmax of sequence ``seq``'s rows over keys ``lo .. hi - 1`` (a view)."""
    key = ("run", seq, lo, hi)
    if key not in _TOP[1]:
        v, i = row_max(pattern[seq, ..., lo:hi], _TOP[1].get(("chunks", seq, lo, hi)))
        _TOP[1][key] = (v, i + lo)
    return _TOP[1][key]


def _all_keys_max(pattern: Tensor) -> tuple[Tensor, Tensor]:
    """Keys 1.. read as a run (shared with a mask that leaves out a BOS), then key 0."""
    width = pattern.shape[-1]
    values, indices = [], []
    for seq in range(pattern.shape[0]):
        v, i = _run_max(pattern, seq, 1, width)
        first = pattern[seq, ..., 0]
        take = first >= v  # ties go to the first index
        values.append(torch.where(take, first, v))
        indices.append(torch.where(take, torch.zeros_like(i), i))
    return torch.stack(values), torch.stack(indices)


# the last key mask whose runs were read, and its runs: every block of a pass asks of the
# same mask, and reading it on the host is a device synchronisation on a GPU
_RUNS: list[Any] = [None, None]


def _runs(keys: Tensor) -> list[tuple[int, int]] | None:
    """Each sequence's allowed keys as one run ``(first, count)``; None where a sequence's
    keys are not one run (or there are none)."""
    if _RUNS[0] is not keys:
        starts = keys.int().argmax(-1)
        counts = keys.sum(-1)
        run = torch.arange(keys.shape[-1], device=keys.device)[None]
        contiguous = keys == ((run >= starts[:, None]) & (run < (starts + counts)[:, None]))
        ok = bool(contiguous.all()) and bool((counts > 0).all())
        runs = list(zip(starts.tolist(), counts.tolist(), strict=True)) if ok else None
        _RUNS[0], _RUNS[1] = keys, runs
    return _RUNS[1]


def _masked_max(pattern: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """Max over the allowed keys (``keys`` ``[batch, pos]``, the block's ``width`` first
    read); where they are one run per sequence (special tokens at the ends, the usual
    case), over a view of the run, without a masked copy."""
    width = pattern.shape[-1]
    runs = _runs(keys)
    if runs is None or any(lo >= width for lo, _ in runs):
        return row_max(pattern.masked_fill(~keys[:, None, None, :width], float("-inf")))
    pairs = [_run_max(pattern, seq, lo, min(lo + c, width)) for seq, (lo, c) in enumerate(runs)]
    return torch.stack([v for v, _ in pairs]), torch.stack([i for _, i in pairs])


def forget() -> None:
    """Drop the maxima of the last block (and the reference to it)."""
    _TOP[0], _TOP[1], _TOP[2] = None, {}, []


@contextlib.contextmanager
def capture_rotary(
    model: TransformerBridge, layers: Sequence[int], store: dict[int, Any]
) -> Iterator[None]:
    """Inside the block, ``store[layer]`` is the ``(cos, sin)`` that layer's attention last
    received (rotary models; None for others)."""

    def make(layer: int) -> Callable[..., None]:
        def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            store[layer] = kwargs.get("position_embeddings")

        return pre

    handles = [
        model.blocks[la].attn.register_forward_pre_hook(make(la), with_kwargs=True) for la in layers
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
