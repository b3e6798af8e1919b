"""Row statistics from scores and the kernel's log-sum-exp (headmech.stream.rows) against
the softmax pattern rows: maxima and argmaxes over any keys, probabilities at chosen keys,
the pattern made in place, and one reused buffer; with shared scores, the same from the
block's own softmax, and the output rows it computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_attention_call import _call as attention_call_case

from headmech.stream import blockwise
from headmech.stream import rows as rows_module
from headmech.stream.attention_call import LayerCall, pattern_rows
from headmech.stream.buffers import Buffers
from headmech.stream.rows import RowBlock


def _call(window=None, pad=6, mask=True):
    """test_attention_call's call (heads with planted peaks: previous token, first token,
    diffuse; padding keys at the end of sequence 1, an optional sliding window), whose
    padding queries also see nothing here; LSE by logsumexp of the scores in the fused
    kernel's order (the product, then the scale)."""
    call, allowed = attention_call_case(n=40, window=window, pad=pad)
    if pad:
        allowed[1, :, -pad:, :] = False
    s = ((call.q @ call.k.transpose(-1, -2)) * call.scale).masked_fill(~allowed, float("-inf"))
    lse = s.logsumexp(-1)
    return LayerCall(call.q, call.k, allowed if mask else None, call.scale, None, None, True, lse)


CALLS = {
    "mask": lambda: _call(),
    "window": lambda: _call(window=7),
    "causal-no-mask": lambda: _call(pad=0, mask=False),
}


def _shared(call: LayerCall) -> LayerCall:
    """The call as shared scores get it: values and an output buffer, no log-sum-exp."""
    (n_seqs, n_heads), n = call.q.shape[:2], call.k.shape[2]  # one value head serves all
    values = torch.randn(n_seqs, 1, n, 5, generator=torch.Generator().manual_seed(2))
    out = torch.full((n_seqs, call.q.shape[2], n_heads, 5), float("nan"))
    return dataclasses.replace(call, lse=None, values=values, out=out)


@pytest.mark.parametrize("shared", [False, True], ids=["lse", "shared"])
@pytest.mark.parametrize("which", sorted(CALLS))
@pytest.mark.parametrize("rows", [slice(0, 40), slice(0, 13), slice(13, 29), slice(29, 40)])
def test_row_statistics_equal_the_softmax_rows(which, rows, shared):
    call = CALLS[which]()
    want = pattern_rows(call, rows)  # the model's softmax, [batch, head, rows, width]
    if shared:
        call = _shared(call)
    view = RowBlock(call, rows)
    assert view.width == want.shape[-1] and view.probabilities == shared
    if shared:  # the block's output rows: its pattern times the values (padding rows: 0)
        assert call.out is not None and call.values is not None
        ref = want @ call.values[:, :, : view.width]  # [batch, head, rows, 5]
        torch.testing.assert_close(call.out[:, rows], ref.transpose(1, 2), atol=1e-5, rtol=0)
    # the keys each query may see, and whole rows picked out by query
    torch.testing.assert_close(view.visible(), want.amax(1) > 0)
    idx = torch.tensor([0, rows.stop - rows.start - 1])[None, None, :, None]
    idx = idx.expand(2, 3, 2, view.width)
    torch.testing.assert_close(view.rows_at(idx), want.gather(2, idx), atol=1e-6, rtol=0)
    keys = torch.ones(2, 40, dtype=torch.bool)
    keys[:, 0] = False  # every key but the first (confidence's "ordinary" keys)
    keys[1, 20] = False  # and a hole: not one run of keys
    for mask in (None, keys):
        p, idx = view.top(mask)
        w = want if mask is None else want.masked_fill(~mask[:, None, None, : want.shape[-1]], -1)
        wv, wi = w.max(-1)
        torch.testing.assert_close(p, wv.clamp(min=0), atol=1e-6, rtol=0)
        real = wv > 1e-6  # rows with a visible key: the same key (first on ties)
        assert torch.equal(idx[real], wi[real])
        blockwise.forget()
    targets = torch.randint(
        0, 40, (2, rows.stop - rows.start), generator=torch.Generator().manual_seed(1)
    )
    got = view.at(targets)
    wide = torch.nn.functional.pad(want, (0, 40 - want.shape[-1]))  # keys past the block: 0
    ref = wide.gather(-1, targets[:, None, :, None].expand(-1, 3, -1, 1))[..., 0]
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    b = torch.tensor([0, 1, 1])
    q = torch.tensor([0, rows.stop - rows.start - 1, 0])
    k = torch.tensor([0, 0, min(rows.start, view.width - 1)])
    torch.testing.assert_close(view.pairs(b, q, k), want[b, :, q, k], atol=1e-6, rtol=0)
    # the pattern itself, in place of the scores; the maxima then read it
    scores = view.scores
    pattern = view.pattern()
    assert pattern.data_ptr() == scores.data_ptr()
    torch.testing.assert_close(pattern, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(view.top()[0], want.max(-1).values, atol=1e-6, rtol=0)
    blockwise.forget()


@pytest.mark.parametrize(
    "masked", ["padding", None, "window"], ids=["padding-mask", "causal-no-mask", "window-mask"]
)
@pytest.mark.parametrize("kv_heads", [3, 1], ids=["mha", "one-kv-head"])
@pytest.mark.parametrize("rows", [slice(0, 437), slice(290, 437)])
def test_shared_scores_in_tiles_of_rows(monkeypatch, kv_heads, rows, masked):
    """Shared scores go through a head's rows in tiles (here 50 rows), each tile's
    products only over the keys its rows may see (causal: up to its last row; a sliding
    window of 100 keys: from its first row's window on), and take the first level of the
    row maxima (chunk maxima of keys 1..) from each tile: the output rows, the maxima and
    argmaxes over every key and over keys 1.. are the softmax rows' (437 keys: seven whole
    chunks of 64 and a tail; the last tile shorter)."""
    monkeypatch.setattr(rows_module, "TILE_BYTES", 0)
    monkeypatch.setattr(rows_module, "MIN_TILE_ROWS", 50)
    window = 100 if masked == "window" else None
    case, _ = attention_call_case(n=437, pad=40 if masked == "padding" else 0, window=window)
    call = dataclasses.replace(
        case, k=case.k[:, :kv_heads].contiguous(), mask=case.mask if masked else None
    )
    spans = RowBlock(_shared(call), rows)._spans(437, 437, 50)
    if masked != "padding":  # a causal tile's products stop at its own last row's key
        assert all(keys.stop == rows.start + sub.stop for sub, keys in spans)
    if masked == "window":  # and start at its first row's window
        assert all(keys.start == max(0, rows.start + sub.start - 99) for sub, keys in spans)
    want = pattern_rows(call, rows)
    call = _shared(call)
    view = RowBlock(call, rows)
    assert call.out is not None and call.values is not None
    ref = want @ call.values[:, :, : view.width]
    torch.testing.assert_close(call.out[:, rows], ref.transpose(1, 2), atol=1e-5, rtol=0)
    keys = torch.ones(2, 437, dtype=torch.bool)
    keys[:, 0] = False
    for mask in (None, keys):
        p, idx = view.top(mask)
        w = want if mask is None else want.masked_fill(~mask[:, None, None, :], -1)
        wv, wi = w.max(-1)
        torch.testing.assert_close(p, wv.clamp(min=0), atol=1e-6, rtol=0)
        real = wv > 1e-6
        assert torch.equal(idx[real], wi[real])
    blockwise.forget()


def test_pattern_rows_sum_to_one_when_the_kernel_rounded_its_lse_apart():
    """The fused kernel's log-sum-exp comes from its own float32 scores; where scores are
    in the thousands (Qwen2.5-Coder-1.5B's layer 0: up to 4,514) its rounding moves the
    LSE by ~1e-3 from these scores' own, and ``exp(s - LSE)`` rows sum to 1 ± 1e-3. The
    pattern is divided by its rows' sums: the softmax of the scores again. Planted here: an
    LSE 1e-3 off in every row (the point reads keep that relative error)."""
    call = _call()
    off = LayerCall(call.q, call.k, call.mask, call.scale, None, None, True, call.lse + 1e-3)
    want = pattern_rows(call, slice(0, 40))
    view = RowBlock(off, slice(0, 40))
    p, _ = view.top()
    torch.testing.assert_close(p, want.max(-1).values * torch.exp(torch.tensor(-1e-3)))
    pattern = view.pattern()
    torch.testing.assert_close(pattern, want, atol=1e-6, rtol=0)
    sums = pattern.sum(-1)
    real = call.mask.any(-1).expand_as(sums)  # rows with a key sum to 1; padding stays 0
    torch.testing.assert_close(sums[real], torch.ones(int(real.sum())))
    assert float(sums[~real].abs().sum()) == 0.0
    blockwise.forget()


def test_padding_queries_get_zero_rows():
    call = _call()
    view = RowBlock(call, slice(30, 40))
    p, _ = view.top()
    assert torch.equal(p[1, :, 4:], torch.zeros_like(p[1, :, 4:]))  # queries 34..39 of seq 1
    assert not view.pattern().isnan().any()
    assert float(view.pattern()[1, :, 4:].abs().sum()) == 0.0
    blockwise.forget()


def test_one_buffer_serves_every_block():
    call = _call()
    buffers = Buffers()
    first = RowBlock(call, slice(20, 40), buffers).scores
    ptr = first.data_ptr()
    for rows in (slice(0, 10), slice(10, 20), slice(30, 40)):  # no larger than the first
        assert RowBlock(call, rows, buffers).scores.data_ptr() == ptr
    x = torch.randn(2, 3, 5, 4)
    repeated = buffers.repeat_heads("k", x, 3)
    assert torch.equal(repeated, x.repeat_interleave(3, 1))
    assert buffers.repeat_heads("k", x + 1, 3).data_ptr() == repeated.data_ptr()
    with pytest.raises(ValueError, match="log-sum-exp"):
        RowBlock(LayerCall(call.q, call.k, None, 1.0, None, None, True, None), slice(0, 4))


def test_causal_blocks_that_grow_share_one_allocation():
    """Causal blocks widen as they go (keys up to the last query): the first block takes
    the buffer for the widest, so no later block allocates (on a GPU each allocation of a
    grown buffer cost a device allocation: a 32k-token pass was 8x slower)."""
    call = _call(pad=0, mask=False)
    buffers = Buffers()
    ptrs = {RowBlock(call, slice(s, s + 10), buffers).scores.data_ptr() for s in (0, 10, 20, 30)}
    assert len(ptrs) == 1


def test_a_gpu_takes_larger_blocks():
    from headmech.stream.blockwise import BLOCK_MEMORY, CUDA_BLOCK_MEMORY_MAX, default_block_memory

    assert default_block_memory("cpu") == BLOCK_MEMORY
    assert default_block_memory("cuda", free=40 * 2**30) == 10 * 2**30
    assert default_block_memory("cuda", free=2**30) == BLOCK_MEMORY  # never below the CPU's
    assert default_block_memory("cuda", free=200 * 2**30) == CUDA_BLOCK_MEMORY_MAX


def test_row_maxima_over_one_mask_read_its_runs_once(monkeypatch):
    """The key mask's runs are read on the host once per mask, not once per block (on a GPU
    each read is a synchronisation), and clipped to each block's width."""
    keys = torch.ones(2, 12, dtype=torch.bool)
    keys[:, 0] = False  # a BOS
    keys[1, 9:] = False  # padding
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))
    for width in (4, 8, 12):
        blockwise.forget()
        pattern = torch.rand(2, 3, 5, width)
        got = blockwise.top1(pattern, keys)
        want = pattern.masked_fill(~keys[:, None, None, :width], float("-inf")).max(-1)
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
    assert len(reads) == 2  # starts and counts, once


@pytest.mark.parametrize("width", [5, 255, 256, 300, 1000])
def test_row_max_in_two_levels_equals_torch_max(width):
    """blockwise.row_max (chunk maxima, then the key within the first chunk that holds
    the row's maximum) against ``torch.max``: values and first indices, with ties within
    and across chunks, rows of -inf (hidden keys) and views that start past key 0."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(2, 3, 7, width, generator=g).round(decimals=1)  # many ties
    x[0, 0, 0] = float("-inf")  # a row that sees nothing: key 0, as torch.max says
    x[0, 1, 1, width // 2 :] = float("-inf")
    x[1, 2, 3] = 4.0  # a whole row tied
    x[1, 0, 2, -1] = 9.0  # the maximum in the keys after the last whole chunk
    x[1, 0, 4, [1, width - 1]] = 9.0  # a tie between the first chunk and the tail
    for view in (x, x[..., 1:], x[0]):
        want = view.max(-1)
        value, index = blockwise.row_max(view)
        assert torch.equal(value, want.values) and torch.equal(index, want.indices)


def test_a_power_of_two_scale_on_the_queries_gives_the_same_scores():
    """A scale that is a power of two (head size 64: 1/8) multiplies the queries before
    the product, not every score after it: the same bits, one pass fewer."""
    call = dataclasses.replace(_call(), scale=0.125)
    view = RowBlock(call, slice(5, 30))
    want = (call.q[:, :, 5:30] @ call.k[:, :, : view.width].transpose(-1, -2)) * 0.125
    assert call.mask is not None
    want = want.masked_fill(~call.mask[..., 5:30, : view.width], float("-inf"))
    assert torch.equal(view.scores, want)
