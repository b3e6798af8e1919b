"""The attention output, log-sum-exp and row maxima from tiles of scores
(headmech.stream.tiles): against SDPA, ``logsumexp`` and ``amax`` of the explicit scores
under every mask the attention call meets, and, inside a pass, every statistic against the
maxima route with the fused kernel's LSE (the same decisions) and against the row path."""

from __future__ import annotations

import pytest
import torch

from headmech.attribution.confidence import confidence_reducer
from headmech.headtypes.registry import get_head_type
from headmech.probes import ProbeOptions, build_probe
from headmech.stream import attention_call, maxima, passes, tiles
from headmech.stream.engine import stream_statistics

N, D = 50, 8


def _inputs(n_heads=4, n_kv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n_heads, N, D, generator=g) * 2
    k = torch.randn(2, n_kv, N, D, generator=g)
    v = torch.randn(2, n_kv, N, D, generator=g)
    q[:, 0, 1:] += 3 * k[:, 0, :1]  # head 0 parks on key 0 (a BOS), as real heads do
    return q, k, v


def _masks():
    pos = torch.arange(N)
    causal = pos[None, :] <= pos[:, None]
    padded = causal[None, None].repeat(2, 1, 1, 1)
    padded[1, :, :, :4] = False  # left padding: sequence 1's first queries see no key
    window = (causal & (pos[:, None] - pos[None, :] < 7))[None, None]
    return {
        "causal": (None, True, causal),
        "bidirectional": (None, False, torch.ones(N, N, dtype=torch.bool)),
        "padding": (padded, True, padded),
        "window": (window, True, window[0, 0]),
    }


@pytest.mark.parametrize("kind", ["causal", "bidirectional", "padding", "window"])
def test_tiles_give_the_output_lse_and_maxima_of_the_scores(kind, monkeypatch):
    """Tiles of 16 rows a product (eight of each query head of a key head: seven tiles of
    a 50-row sequence): the output equals SDPA's, the log-sum-exp the
    scores' ``logsumexp`` and the maxima their ``amax`` over every key and over each key
    set: keys but the first (a leading set), keys but the first and a hole (a set put
    back after its maximum), every key, and a set that hides every key of sequence 1."""
    monkeypatch.setattr(tiles, "MIN_TILE_ROWS", 16)
    monkeypatch.setattr(tiles, "TILE_BYTES", 1)
    q, k, v = _inputs()
    mask, causal, allowed = _masks()[kind]
    allowed = allowed.expand(2, 1, N, N) if allowed.dim() == 4 else allowed[None, None]
    ordinary = torch.ones(2, N, dtype=torch.bool)
    ordinary[:, 0] = False
    holed = ordinary.clone()
    holed[:, [5, 33]] = False
    nothing = torch.ones(2, N, dtype=torch.bool)
    nothing[1] = False
    sets = [ordinary, holed, torch.ones(2, N, dtype=torch.bool), nothing]
    scale = 0.3  # not a power of two: the scores are scaled after the product
    got = tiles.attend(q, k, v, mask, scale, causal, sets)

    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kr.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    seen = allowed.any(-1)  # [batch, 1, q]: rows with a key
    ref = torch.softmax(s, -1).nan_to_num(0.0) @ vr
    torch.testing.assert_close(got.out, ref.transpose(1, 2), atol=1e-5, rtol=0)
    lse = s.logsumexp(-1)
    torch.testing.assert_close(got.lse[seen.expand_as(lse)], lse[seen.expand_as(lse)])
    assert bool((got.lse[~seen.expand_as(lse)] == float("inf")).all())
    torch.testing.assert_close(got.every, s.amax(-1), atol=1e-6, rtol=0)
    for keys, m in zip(sets, got.sets, strict=True):
        want = s.masked_fill(~keys[:, None, None], float("-inf")).amax(-1)
        torch.testing.assert_close(m, want, atol=1e-6, rtol=0)
    if kind == "padding":
        assert not bool(seen.all())  # rows without a key were met


def test_a_power_of_two_scale_and_one_head_per_key_head():
    """A scale of 1/4 multiplies the queries instead (no pass over the scores): the
    same output and maxima; without grouped-query heads, one key head a query head."""
    q, k, v = _inputs(n_heads=2, n_kv=2, seed=1)
    got = tiles.attend(q, k, v, None, 0.25, True)
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(
        ~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf")
    )
    torch.testing.assert_close(got.out, (torch.softmax(s, -1) @ v).transpose(1, 2))
    assert torch.equal(got.every, s.amax(-1))
    assert got.sets == []


def test_three_query_heads_a_key_head_in_one_product(monkeypatch):
    """Three query heads of a key head share each product (16 rows: six of each head,
    nine tiles of 50 rows, the last of two): every head's output, LSE and maxima are its
    own, equal to the explicit scores' under a causal mask; the largest probability of a
    row, ``exp(max − LSE)``, is ``1 / Σ exp(s − max)`` as the softmax's."""
    monkeypatch.setattr(tiles, "MIN_TILE_ROWS", 16)
    monkeypatch.setattr(tiles, "TILE_BYTES", 1)
    q, k, v = _inputs(n_heads=6, n_kv=2, seed=2)
    got = tiles.attend(q, k, v, None, 0.125, True)
    kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    s = (q @ kr.transpose(-1, -2) * 0.125).masked_fill(
        ~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf")
    )
    torch.testing.assert_close(got.out, (torch.softmax(s, -1) @ vr).transpose(1, 2))
    torch.testing.assert_close(got.every, s.amax(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(got.lse, s.logsumexp(-1))
    torch.testing.assert_close(torch.exp(got.every - got.lse), torch.softmax(s, -1).amax(-1))


def _batch(model):
    """Induction's probe (BOS, random tokens, the same again), sequence 1 padded at the
    end: the BOS is special, so the ordinary keys are a set of their own."""
    options = ProbeOptions(n_sequences=2, half_len=14, batch_size=2)
    batch = build_probe("repeated_random", model, options).batches[0]
    batch.attention_mask[1, -6:] = 0
    batch.special[1, -6:] = True
    return batch


def test_a_pass_of_points_and_maxima_runs_on_tiles(tiny_models, monkeypatch):
    """Confidence, positional and the target types need points and maxima alone: on a
    CPU each layer's output, log-sum-exp and maxima come from tiles (no fused kernel, no
    score block, no maxima computed again: the key sets the statistics ask are the ones
    the pass declares), the layer's output equals SDPA's, and every statistic equals
    the maxima route's with the kernel's LSE and explicit maxima."""
    model = tiny_models["llama"]
    batch = _batch(model)
    reducers = [confidence_reducer()]
    for name in ("positional", "previous_token", "induction", "attention_sink"):
        reducers += get_head_type(name)().reducers()
    calls, outputs = [], []
    real_attend, real_explicit = tiles.attend, maxima.explicit_maxima

    def attend(q, k, v, mask, scale, causal, key_sets=(), buffers=None):
        done = real_attend(q, k, v, mask, scale, causal, key_sets, buffers)
        outputs.append((q, k, v, mask, scale, done.out.clone()))
        return done

    def explicit(call, every=None, known=()):
        rows = real_explicit(call, every, known)
        real = rows._compute
        rows._compute = lambda keys: calls.append(keys) or real(keys)
        return rows

    monkeypatch.setattr(tiles, "attend", attend)
    monkeypatch.setattr(maxima, "explicit_maxima", explicit)
    monkeypatch.setattr(attention_call, "_with_lse", lambda *a, **k: pytest.fail("a kernel ran"))
    monkeypatch.setattr(passes, "RowBlock", lambda *a, **k: pytest.fail("a score block"))
    got = stream_statistics(model, [batch], reducers, attention="blocks")
    monkeypatch.undo()
    assert len(outputs) == int(model.cfg.n_layers) and calls == []
    for q, k, v, mask, scale, out in outputs:
        rep = q.shape[1] // k.shape[1]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q,
            k.repeat_interleave(rep, 1),
            v.repeat_interleave(rep, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        ).transpose(1, 2)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)

    monkeypatch.setattr(attention_call, "TILED_MAXIMA", False)
    with maxima.row_maxima("explicit"):
        want = stream_statistics(model, [batch], reducers, attention="blocks")
    assert set(got.sums) == set(want.sums)
    for key in want.sums:
        torch.testing.assert_close(got.sums[key], want.sums[key], atol=1e-5, rtol=0, msg=key)
    assert float(want.mean("positional.special_argmax").max()) > 0  # the comparison bites
    assert float(want.mean("confidence.max").min()) > 0


def test_a_statistic_that_reads_rows_keeps_the_row_path(tiny_models, monkeypatch):
    """Rare-word heads read rows: with them in the pass, no tiles run (the row path's
    shared scores compute the output)."""
    model = tiny_models["llama"]
    reducers = [confidence_reducer(), *get_head_type("rare_word")().reducers()]
    assert any(r.points is None and r.from_maxima is None for r in reducers)
    monkeypatch.setattr(tiles, "attend", lambda *a, **k: pytest.fail("tiles ran"))
    batch = build_probe("prose", model, ProbeOptions(n_sequences=2)).batches[0]
    stats = stream_statistics(model, [batch], reducers, attention="blocks")
    assert "confidence.max" in stats.sums
