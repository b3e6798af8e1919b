"""Statistics inside the model's attention call: the fused kernel's log-sum-exp against
``logsumexp`` of the scores, point masses against the softmax, argmax hits decided from
points against a brute-force argmax, and the engine's choice of path per model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from headmech.stream import attention_call, engine
from headmech.stream.attention_call import LayerCall, pattern_rows
from headmech.stream.engine import ProbeBatch, stream_statistics, target_reducer
from headmech.stream.points import Points


def _scores(q, k, scale, allowed):
    s = (q @ k.transpose(-1, -2)) * scale  # the fused kernels' order: the product, then the scale
    return s.masked_fill(~allowed, float("-inf"))


def _call(seed=0, n_seqs=2, n_heads=3, n=24, d=8, window=None, pad=5, peaks=True):
    """A causal call with padding at the end of sequence 1, an optional sliding window,
    and planted peaks (each head attends hard to a key per row), LSE by logsumexp."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_seqs, n_heads, n, d, generator=g)
    k = torch.randn(n_seqs, n_heads, n, d, generator=g)
    if peaks:  # head 0: previous token; head 1: first token; head 2: diffuse
        for i in range(1, n):
            q[:, 0, i] += 4 * k[:, 0, i - 1]
        q[:, 1] += 4 * k[:, 1, :1]
    pos = torch.arange(n)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    allowed = allowed[None, None].expand(n_seqs, 1, n, n).clone()
    allowed[1, :, :, n - pad :] = False  # padding keys of sequence 1
    scale = d**-0.5
    lse = _scores(q, k, scale, allowed).logsumexp(-1)
    return LayerCall(q, k, allowed, scale, None, None, True, lse), allowed


def test_kernel_log_sum_exp_equals_logsumexp_of_the_scores():
    """CPU flash attention's LSE and output, grouped-query keys, bool, additive and no
    mask: LSE equals logsumexp of the masked scaled scores, the output SDPA's."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 16, 8, generator=g)
    k, v = torch.randn(2, 2, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g)
    module = torch.nn.Module()
    module.is_causal = True
    causal = torch.ones(16, 16, dtype=torch.bool).tril()[None, None].expand(2, 1, 16, 16).clone()
    causal[1, :, :, 12:] = False
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for mask, allowed in ((causal, causal), (additive, causal), (None, causal[:1])):
        fused = attention_call._with_lse(module, q, k, v, mask, 0.3)
        assert fused is not None
        out, lse, key = fused
        torch.testing.assert_close(key, kr, atol=0, rtol=0)  # what the statistics reuse
        want = _scores(q, kr, 0.3, allowed).logsumexp(-1)
        torch.testing.assert_close(lse, want, atol=1e-5, rtol=1e-5)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, kr, vr, attn_mask=allowed, scale=0.3
        )
        torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_point_masses_equal_the_softmax(window):
    call, allowed = _call(window=window)
    view = Points(call)
    pattern = torch.softmax(_scores(call.q, call.k, call.scale, allowed), -1).nan_to_num(0.0)
    torch.testing.assert_close(pattern_rows(call, slice(0, 24)), pattern, atol=1e-6, rtol=0)
    g = torch.Generator().manual_seed(2)
    keys = torch.randint(0, 24, (2, 24), generator=g)  # some hidden: future, outside window
    got = view.at(keys)
    want = pattern.gather(-1, keys[:, None, :, None].expand(-1, 3, -1, 1))[..., 0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert bool((got == 0).any()) and float(got.max()) > 0.5  # hidden keys and peaks met
    b, qq = torch.tensor([0, 1, 1]), torch.tensor([3, 10, 20])
    kk = torch.tensor([1, 10, 2])
    torch.testing.assert_close(view.pairs(b, qq, kk), pattern[b, :, qq, kk], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_hits_decided_from_points_equal_the_argmax(window, monkeypatch):
    """Targets: the previous token (head 0's peak), the first token (head 1's), a random
    earlier key; and sets of keys. Hits equal the brute-force argmax's, and most rows are
    decided without computing them whole."""
    call, allowed = _call(window=window, n=40)
    view = Points(call)
    pattern = torch.softmax(_scores(call.q, call.k, call.scale, allowed), -1).nan_to_num(0.0)
    top = pattern.argmax(-1)  # [batch, head, query]
    rows = allowed[:, 0].any(-1) & torch.ones(2, 40, dtype=torch.bool)
    rows[1, 35:] = False  # padding queries are not asked about
    computed = []
    real = Points.argmax
    monkeypatch.setattr(
        Points, "argmax", lambda self, r: computed.append(int(r.sum())) or real(self, r)
    )
    pos = torch.arange(40)
    g = torch.Generator().manual_seed(3)
    targets = {
        "previous": (pos - 1).clamp(min=0).expand(2, -1),
        "first": torch.zeros(2, 40, dtype=torch.long),
        "random": (torch.rand(2, 40, generator=g) * (pos + 1)).long(),
    }
    for name, t in targets.items():
        p = view.at(t)
        hits = view.hits(p, lambda keys, t=t: keys == t[:, None], rows)
        want = (top == t[:, None]) & rows[:, None]
        assert torch.equal(hits, want), name
    sets = torch.zeros(2, 40, 40, dtype=torch.bool)
    sets[:, pos, (pos - 1).clamp(min=0)] = True
    sets[:, pos, (pos - 3).clamp(min=0)] = True
    b, qq, kk = sets.nonzero().unbind(-1)
    best = (
        torch.zeros(2 * 40, 3)
        .scatter_reduce_(0, (b * 40 + qq)[:, None].expand(-1, 3), view.pairs(b, qq, kk), "amax")
        .view(2, 40, 3)
        .transpose(1, 2)
    )

    def in_set(keys):
        return sets[:, None].expand(-1, 3, -1, -1).gather(-1, keys[..., None])[..., 0]

    hits = view.hits(best, in_set, rows)
    assert torch.equal(hits, in_set(top) & rows[:, None])
    asked = 4 * int(rows.sum()) * 3
    assert sum(computed) < asked / 2, (sum(computed), asked)  # most decided from points


def test_engine_reduces_inside_the_call_with_points(tiny_models, monkeypatch):
    """On a tiny LLaMA the engine takes the call path; target reducers run from points
    (no pattern block is built) and equal the eager pattern's statistics; a reducer
    without points makes the pass build blocks."""
    model = tiny_models["llama"]
    assert engine._pattern_free(model) == ("call", None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(model.cfg.d_vocab), (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 24:] = 0
    batch = ProbeBatch(ids, mask, mask == 0)

    def previous(b):
        return torch.arange(b.input_ids.shape[1]).expand_as(b.input_ids) - 1

    def recent(b):  # the two keys before each query
        n = b.input_ids.shape[1]
        pos = torch.arange(n)
        gap = pos[:, None] - pos[None, :]
        return ((gap >= 1) & (gap <= 2)).expand(b.input_ids.shape[0], n, n)

    reducers = [target_reducer("prev", previous), target_reducer("recent", recent)]
    blocks = []
    real = attention_call.pattern_rows
    monkeypatch.setattr(attention_call, "pattern_rows", lambda c, r: blocks.append(r) or real(c, r))
    got = stream_statistics(model, [batch], reducers, attention="blocks")
    assert blocks == []  # every statistic from points
    want = stream_statistics(model, [batch], reducers, attention="pattern")
    for k in want.sums:
        torch.testing.assert_close(got.sums[k], want.sums[k], atol=1e-5, rtol=0, msg=k)
    assert float(want.mean("prev.hit").max()) > 0  # hits happen, so the comparison bites

    # a reducer with neither points nor row statistics: the pass reads blocks of rows (on
    # a CPU with shared scores: each block's softmax, in place, which also computes the
    # layer's output); the spy gets the block's pattern: the model's pattern rows
    seen = []

    def spy_fn(pattern, b, pr, layer, rows):
        seen.append((layer, rows, pattern.clone()))
        return {}

    spy = engine.Reducer("spy", spy_fn, blockwise=True)
    mixed = stream_statistics(model, [batch], [*reducers, spy], attention="blocks")
    assert blocks == []  # no softmax of pattern_rows: the pattern came from the LSE
    assert len(seen) == int(model.cfg.n_layers)
    for k in want.sums:
        torch.testing.assert_close(mixed.sums[k], want.sums[k], atol=1e-5, rtol=0, msg=k)
    _, cache = model.run_with_cache(batch.input_ids, attention_mask=batch.attention_mask)
    for layer, rows, pattern in seen:
        ref = cache[f"blocks.{layer}.attn.hook_pattern"][:, :, rows, : pattern.shape[-1]]
        real = batch.attention_mask.bool()[:, None, rows, None]  # padding queries: any row
        torch.testing.assert_close(pattern * real, ref * real, atol=1e-5, rtol=0)


def test_shared_scores_compute_the_output_and_the_statistics(tiny_models, monkeypatch):
    """Where a pass builds rows for every query (here confidence and positional: row
    statistics), a CPU attention call skips the fused kernel: the statistics' blocks
    compute the layer's output from their own softmax. Each layer's output equals SDPA's
    on the same q, k, v and mask (padding included), no fused kernel runs, and every
    statistic equals the kernel-and-LSE path's (shared scores off). (Confidence and
    positional also read maxima: the tiles of tests/test_tiles.py would give them, so
    they are off here.)"""
    from headmech.attribution.confidence import confidence_reducer
    from headmech.headtypes import get_head_type

    monkeypatch.setattr(attention_call, "TILED_MAXIMA", False)
    model = tiny_models["llama"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(model.cfg.d_vocab), (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: queries that see no key get a zero row
    mask[1, 24:] = 0
    batch = ProbeBatch(ids, mask, mask == 0)
    reducers = [confidence_reducer(), *get_head_type("positional")().reducers()]
    kernel, outputs = [], []
    real_kernel, real_shared = attention_call._with_lse, attention_call._shared
    monkeypatch.setattr(
        attention_call, "_with_lse", lambda *a, **k: kernel.append(1) or real_kernel(*a, **k)
    )

    def shared(query, key, value, attention_mask, scale, causal, callback, key_sets):
        assert key_sets is None  # tiles off: the rows compute the output
        out = real_shared(query, key, value, attention_mask, scale, causal, callback)
        outputs.append((query, key, value, attention_mask, scale, out.clone()))
        return out

    monkeypatch.setattr(attention_call, "_shared", shared)
    got = stream_statistics(model, [batch], reducers, attention="blocks")
    assert kernel == [] and len(outputs) == int(model.cfg.n_layers)
    for query, key, value, allowed, scale, out in outputs:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        allowed = attention_call._allowed(allowed)
        ref = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, is_causal=allowed is None, scale=scale
        ).transpose(1, 2)
        assert allowed is not None and bool(out.isfinite().all())
        seen = allowed.any(-1)[:, 0]  # [batch, query]: queries with a key to attend to
        assert not bool(seen.all())
        torch.testing.assert_close(out[seen], ref[seen], atol=1e-5, rtol=0)
    # statistics from points alone (here the previous token's mass and hits) build no
    # rows: the kernel computes the output and its log-sum-exp feeds the points
    n_layers = int(model.cfg.n_layers)
    points = [target_reducer("prev", lambda b: torch.arange(30).expand_as(b.input_ids) - 1)]
    assert all(r.points is not None for r in points)
    stream_statistics(model, [batch], points, attention="blocks")
    assert len(kernel) == n_layers and len(outputs) == n_layers
    monkeypatch.setattr(attention_call, "SHARED_SCORES", False)
    want = stream_statistics(model, [batch], reducers, attention="blocks")
    assert len(kernel) == 2 * n_layers and len(outputs) == n_layers
    for k in want.sums:
        torch.testing.assert_close(got.sums[k], want.sums[k], atol=1e-5, rtol=0, msg=k)


def test_points_read_grouped_keys_as_their_repeated_copy_to_the_bit(monkeypatch):
    """Points over keys one per key-value head (the tiles' pass) give every score,
    probability, tolerance and argmax of the same points over the repeated keys, to the
    bit, and so do the row maxima computed from blocks (to rounding: another product
    shape); the chunk of queries the products are taken in changes no bit."""
    from headmech.stream.maxima import explicit_maxima

    call, _ = _call(n_heads=6, n=24, window=5)
    kv = call.k[:, ::3].contiguous()  # 2 key heads, each serving 3 query heads
    rep = dataclasses.replace(call, k=kv.repeat_interleave(3, 1))
    grouped = dataclasses.replace(call, k=kv)
    lse = _scores(call.q, rep.k, call.scale, call.mask).logsumexp(-1)
    rep, grouped = (dataclasses.replace(c, lse=lse) for c in (rep, grouped))
    a, b = Points(rep), Points(grouped)
    assert (a.group, b.group, b.n_kv) == (1, 3, 2)
    keys = torch.randint(0, 24, (2, 24), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.scores_at(keys), b.scores_at(keys))
    assert torch.equal(a.at(keys), b.at(keys))
    for shift in (-30, -1, 0, 2, 30):
        assert torch.equal(a.scores_shifted(shift), b.scores_shifted(shift)), shift
    for which in ("first", "self", "previous"):
        assert torch.equal(a.fixed(which), b.fixed(which)), which
    assert torch.equal(a.tolerance(), b.tolerance())
    sel = torch.tensor([0, 1, 1]), torch.tensor([3, 7, 20]), torch.tensor([2, 7, 19])
    assert torch.equal(a.pairs(*sel), b.pairs(*sel))
    rows = torch.rand(2, 6, 24, generator=torch.Generator().manual_seed(4)) > 0.5
    assert torch.equal(a.argmax(rows), b.argmax(rows))
    ordinary = torch.ones(2, 24, dtype=torch.bool)
    ordinary[:, 0] = False
    for ks in (None, ordinary):
        want = explicit_maxima(rep)(ks)
        torch.testing.assert_close(explicit_maxima(grouped)(ks), want, atol=1e-6, rtol=0)
        assert bool(torch.isneginf(want[..., 0]).all()) == (ks is not None)  # row 0: key 0
    monkeypatch.setattr(Points, "PRODUCT_BYTES", 4 * 2 * 6 * 8 * 5)  # 5 queries a chunk
    c = Points(grouped)
    assert torch.equal(c.scores_at(keys), b.scores_at(keys))
    assert torch.equal(c.scores_shifted(-1), b.scores_shifted(-1))


def test_points_take_products_in_chunks_on_a_cpu_and_whole_elsewhere(monkeypatch):
    """On a CPU the products go through a buffer of PRODUCT_BYTES, a chunk of queries at a
    time; on another device (here "meta", as a GPU would) all queries are one chunk: two
    launches, not two a chunk."""
    from headmech.stream.buffers import Buffers

    class Recorded(Buffers):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def take(self, name, shape, *args, **kwargs):
            self.shapes.append((name, shape))
            return super().take(name, shape, *args, **kwargs)

    monkeypatch.setattr(Points, "PRODUCT_BYTES", 4 * 4 * 8 * 16)  # 16 queries of 4 heads
    for device, chunks in (("cpu", 4), ("meta", 1)):
        q, k = torch.zeros(1, 4, 64, 8, device=device), torch.zeros(1, 2, 64, 8, device=device)
        call = LayerCall(q, k, None, 0.3, None, None, True, torch.zeros(1, 4, 64, device=device))
        buffers = Recorded()
        assert Points(call, buffers).scores_shifted(-1).shape == (1, 4, 64)
        taken = [shape for name, shape in buffers.shapes if name == "points_k"]
        assert taken == [(1, 2, 2, 64 // chunks, 8)] * chunks, device


@pytest.mark.parametrize("window", [None, 6])
def test_shifted_scores_are_the_gathered_ones_to_the_bit(window):
    """Points.scores_shifted (slices of the keys) equals scores_at at the clamped keys
    exactly, under padding and a window, for shifts inside, at and past both ends; and with
    keys before the first query (no model mask, causal)."""
    call, _ = _call(window=window, n=24)
    view = Points(call)
    pos = torch.arange(24)
    for shift in (-30, -24, -5, -1, 0, 1, 3, 23, 24, 40):
        want = view.scores_at((pos + shift).clamp(0, 23).expand(2, -1))
        got = view.scores_shifted(shift)
        assert torch.equal(got, want), shift
    q, k = call.q[:, :, 4:], call.k  # 4 keys before the first of 20 queries
    lse = _scores(q, k, call.scale, pos[None, :] <= pos[4:, None]).logsumexp(-1)
    early = Points(LayerCall(q, k, None, call.scale, None, None, True, lse))
    assert early.offset == 4
    for shift in (-25, -2, 0, 4, 3, 10, 30):
        want = early.scores_at((torch.arange(20) + shift).clamp(0, 23).expand(2, -1))
        assert torch.equal(early.scores_shifted(shift), want), shift
        assert bool(torch.isneginf(want).any()) == (shift > 4)  # later keys are hidden
    n = torch.arange(20)
    for which, keys in (("first", n * 0), ("self", n + 4), ("previous", n + 3)):
        assert torch.equal(early.fixed(which), early.at(keys.expand(2, -1))), which
