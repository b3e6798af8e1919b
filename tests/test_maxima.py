"""Row statistics from the rows' maxima (headmech.stream.maxima, issue 62's kernel route,
emulated on CPU with maxima computed from the scores): the maxima against the softmax
rows, argmax hits decided from them against a brute-force argmax, and every statistic of
the sequence types (confidence, positional, the target types) from points alone against
the row path, with no score block built."""

from __future__ import annotations

import pytest
import torch
from test_attention_call import _call, _scores

from headmech.attribution.confidence import confidence_reducer
from headmech.headtypes.registry import get_head_type
from headmech.probes import ProbeOptions, build_probe
from headmech.stream import attention_call, maxima, passes
from headmech.stream.engine import ProbeBatch, stream_statistics
from headmech.stream.points import Points


@pytest.mark.parametrize("window", [None, 6])
def test_explicit_maxima_are_the_softmax_rows_maxima(window):
    call, allowed = _call(window=window, n=40)
    pattern = torch.softmax(_scores(call.q, call.k, call.scale, allowed), -1).nan_to_num(0.0)
    keys = torch.ones(2, 40, dtype=torch.bool)
    keys[:, 0] = False  # the ordinary keys: no first token
    keys[1, 20] = False  # and a hole
    view = Points(type(call)(**{**call.__dict__, "maxima": maxima.explicit_maxima(call)}))
    for mask in (None, keys):
        w = pattern if mask is None else pattern.masked_fill(~mask[:, None, None], 0.0)
        torch.testing.assert_close(view.top(mask), w.amax(-1), atol=1e-6, rtol=0)
    assert view.call.maxima(keys.clone()) is view.call.maxima(keys)  # computed once a set
    few = torch.zeros(2, 40, dtype=torch.bool)  # special tokens, say: maxima from points
    few[:, [0, 5]] = True
    few[1, 30] = True  # a padding key of sequence 1: hidden
    asked = []
    real = view.call.maxima._compute
    view.call.maxima._compute = lambda k: asked.append(k) or real(k)
    want = real(few)
    torch.testing.assert_close(view.max_score(few), want, atol=1e-5, rtol=0)
    assert asked == []  # from points: no maxima computed
    torch.testing.assert_close(view.max_score(keys), view.call.maxima(keys))  # many: the maxima


@pytest.mark.parametrize("window", [None, 6])
def test_hits_from_maxima_equal_the_argmax_without_computing_rows(window, monkeypatch):
    call, allowed = _call(window=window, n=40)
    call = type(call)(**{**call.__dict__, "maxima": maxima.explicit_maxima(call)})
    view = Points(call)
    monkeypatch.setattr(Points, "argmax", lambda self, r: pytest.fail("a row computed whole"))
    top = torch.softmax(_scores(call.q, call.k, call.scale, allowed), -1).argmax(-1)
    rows = allowed[:, 0].any(-1).clone()
    rows[1, 35:] = False
    pos = torch.arange(40)
    g = torch.Generator().manual_seed(3)
    for t in (
        (pos - 1).clamp(min=0).expand(2, -1),
        torch.zeros(2, 40, dtype=torch.long),
        (torch.rand(2, 40, generator=g) * (pos + 1)).long(),
    ):
        hits = view.hits(view.at(t), lambda keys, t=t: keys == t[:, None], rows)
        want = (top == t[:, None]) & rows[:, None]
        assert torch.equal(hits, want)
        assert bool(want.any())  # the comparison bites


def _sequence_batch(model):
    """Induction's probe: BOS, random tokens, the same tokens again (two sequences)."""
    options = ProbeOptions(n_sequences=2, half_len=24, batch_size=2)
    return build_probe("repeated_random", model, options).batches[0]


def test_every_sequence_statistic_from_maxima_equals_the_row_path(tiny_models, monkeypatch):
    """Confidence, positional and the target types (previous token, duplicate token,
    induction, attention sink) on a tiny LLaMA: under ``row_maxima("explicit")`` the pass
    runs from points alone (no score block) and every statistic equals the row path's."""
    model = tiny_models["llama"]
    batch = _sequence_batch(model)
    reducers = [confidence_reducer()]
    for name in ("positional", "previous_token", "duplicate_token", "induction", "attention_sink"):
        reducers += get_head_type(name)().reducers()
    monkeypatch.setattr(attention_call, "TILED_MAXIMA", False)  # tests/test_tiles.py
    rows_path = stream_statistics(model, [batch], reducers, attention="blocks")

    def no_rows(*args, **kwargs):
        raise AssertionError("a score block was built")

    monkeypatch.setattr(passes, "RowBlock", no_rows)
    with maxima.row_maxima("explicit"):
        got = stream_statistics(model, [batch], reducers, attention="blocks")
    assert set(got.sums) == set(rows_path.sums)
    for k, want in rows_path.sums.items():
        torch.testing.assert_close(got.sums[k], want, atol=1e-5, rtol=0, msg=k)
    # the statistics the maxima decide are not all zero: the comparison bites
    assert float(rows_path.mean("positional.offset_-1").max()) > 0
    assert float(rows_path.mean("positional.special_argmax").max()) > 0
    assert float(rows_path.mean("confidence.max").min()) > 0


def test_a_reducer_without_points_or_maxima_still_reads_rows(tiny_models):
    """Rare-word heads have row statistics only: under row_maxima the pass reads rows as
    before, and the kernel mode on a CPU gives no maxima (torch refuses them there)."""
    model = tiny_models["llama"]
    batch = _sequence_batch(model)
    reducers = [confidence_reducer(), *get_head_type("positional")().reducers()]
    want = stream_statistics(model, [batch], reducers, attention="blocks")
    with maxima.row_maxima("kernel"):
        got = stream_statistics(model, [batch], reducers, attention="blocks")
    for k in want.sums:
        torch.testing.assert_close(got.sums[k], want.sums[k], atol=0, rtol=0, msg=k)
    with pytest.raises(ValueError, match="unknown mode 'fast'"), maxima.row_maxima("fast"):
        pass
    assert maxima.mode() == "off"


@pytest.mark.slow
def test_sequence_statistics_from_maxima_agree_with_the_row_path_on_smollm2(smollm2, monkeypatch):
    """On SmolLM2 (2 x 511 tokens) the maxima route's statistics equal the row path's up
    to near-ties: a row whose top two scores lie within float32 rounding of each other
    (Points.tolerance) may fall either way. Measured: at most 1 query of a head's ~1,000
    (previous-token hits), confidence to 1e-5. The tiles' log-sum-exp and maxima
    (headmech.stream.tiles, the default of such a pass on a CPU) make the same decisions
    as the kernel's LSE with explicit maxima: every count equal, masses to 1e-6."""
    options = ProbeOptions(n_sequences=2, half_len=255, batch_size=2)
    batch = build_probe("repeated_random", smollm2, options).batches[0]
    reducers = [confidence_reducer()]
    for name in ("positional", "previous_token", "duplicate_token", "induction", "attention_sink"):
        reducers += get_head_type(name)().reducers()
    tiled = stream_statistics(smollm2, [batch], reducers, attention="blocks")
    monkeypatch.setattr(attention_call, "TILED_MAXIMA", False)
    want = stream_statistics(smollm2, [batch], reducers, attention="blocks")
    with maxima.row_maxima("explicit"):
        got = stream_statistics(smollm2, [batch], reducers, attention="blocks")
    for k in want.sums:
        diff = (got.mean(k) - want.mean(k)).abs()
        assert float(diff.max()) <= (1e-5 if k.startswith("confidence") else 2e-3), k
        assert float((diff > 1e-6).float().mean()) <= 0.02, k  # a few heads at most
        if k.endswith(".hit") or k.startswith("positional"):  # counts of decided rows
            assert torch.equal(tiled.sums[k], got.sums[k]), k
        torch.testing.assert_close(tiled.mean(k), got.mean(k), atol=1e-6, rtol=0, msg=k)


def _cpu_flex(monkeypatch):
    """FlexAttention as the CUDA route calls it, on CPU: eager flex_attention gives the
    output and the LSE (torch refuses ``max_scores`` on CPU), the maxima come from the
    block mask's own mask_mod over the explicit scores. Returns the calls made."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    calls = []

    def flex(q, k, v, *, block_mask, scale, enable_gqa, return_aux):
        assert return_aux.lse and return_aux.max_scores
        calls.append(block_mask)
        out, aux = flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
            return_aux=AuxRequest(lse=True),
        )  # fmt: skip
        b, h, n_q, _ = q.shape
        n_k = k.shape[2]
        idx = [torch.arange(n)[s] for n, s in zip(
            (b, h, n_q, n_k),
            ((slice(None), None, None, None), (None, slice(None), None, None),
             (None, None, slice(None), None), (None, None, None, slice(None))),
            strict=True,
        )]  # fmt: skip
        allowed = block_mask.mask_mod(*idx).expand(b, h, n_q, n_k)
        kk = k.repeat_interleave(h // k.shape[1], 1)
        scores = (q.float() @ kk.float().transpose(-1, -2)) * scale
        best = scores.masked_fill(~allowed, float("-inf")).amax(-1)
        return out, type("Aux", (), {"lse": aux.lse, "max_scores": best})()

    monkeypatch.setattr(maxima, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(maxima, "_FLEX", [flex])
    return calls


def test_the_kernel_route_glue_on_cpu(tiny_models, monkeypatch):
    """The CUDA route's code (flex_call: FlexAttention's output, LSE and maxima; the block
    masks of the model's mask and of a key set; grouped-query heads) run on CPU with
    eager FlexAttention standing in for the compiled kernel: the model's outputs and every
    statistic equal the row path's, the ordinary keys cost one more call per layer, and
    every layer reuses the pass's block masks."""
    model = tiny_models["llama"]
    full = _sequence_batch(model)
    mask = full.attention_mask.clone()
    mask[1, -5:] = 0  # padding at the end of sequence 1: the model's mask is a tensor
    batch = ProbeBatch(full.input_ids, mask, full.special | (mask == 0), extras=full.extras)
    reducers = [confidence_reducer(), *get_head_type("positional")().reducers()]
    reducers += get_head_type("induction")().reducers()
    want = stream_statistics(model, [batch], reducers, attention="blocks")
    calls = _cpu_flex(monkeypatch)
    with maxima.row_maxima("kernel"):
        got = stream_statistics(model, [batch], reducers, attention="blocks")
    for k in want.sums:
        torch.testing.assert_close(got.sums[k], want.sums[k], atol=1e-5, rtol=0, msg=k)
    n_layers = int(model.cfg.n_layers)
    assert len(calls) == 2 * n_layers  # every key, then the ordinary keys, in each layer
    assert len({id(c) for c in calls}) == 2  # the block masks built once a pass
    assert calls[0].shape[0] == 2  # the padded sequences' own masks
    assert maxima._BLOCKS == []  # forgotten after the pass
