"""Many KV plans at once (headmech.kv.evaluate_many) and the model's own sliding windows
computed as a band: both must equal the one-plan-at-a-time evaluation exactly."""

from __future__ import annotations

import pytest
import torch

from headmech.kv import KVPlan, evaluate, evaluate_many, needle_batches, planned, prose_batches
from headmech.kv.attention import attention_modules
from headmech.kv.budget import model_shape


@pytest.fixture(scope="module")
def llama():
    from headmech.testing import tiny_model

    return tiny_model("causal")  # LLaMA, 2 layers, 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 (plain Hugging Face): layer 0 has a 6-token window, layer 1 none."""
    import transformers

    from headmech.models.tiny import build_tiny

    path = build_tiny("gemma3", tmp_path_factory.mktemp("gemma3"))
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _one_windowed(model, layer: int, kv: int, sinks: int = 1, window: int = 5) -> KVPlan:
    name, n_layers, n_heads, n_kv = model_shape(model)
    full = torch.ones(n_layers, n_kv, dtype=torch.bool)
    full[layer, kv] = False
    return KVPlan(full, n_heads, sinks, window, name, {"kind": "one_windowed"})


def _same(got, want) -> None:
    assert len(got.trials) == len(want.trials)
    for g, w in zip(got.trials, want.trials, strict=True):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-5)
    assert got.n_tokens == want.n_tokens
    assert got.nll_sum == pytest.approx(want.nll_sum, rel=1e-5)
    assert got.plan == want.plan


def _attention_calls(model) -> tuple[list[int], list]:
    from headmech.kv import hf_model

    calls = [0]
    hooks = [
        m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for m in attention_modules(hf_model(model))
    ]
    return calls, hooks


def test_evaluate_many_equals_evaluate_and_shares_the_layers_before_a_difference(llama):
    """The base and the four one-windowed plans of a 2-layer model (one duplicated, one
    windowing the whole model): each result equals evaluate's, and the attention layers
    run 9 times per batch, not 2 x 6: layer 0 once for the plans that window only layer
    1, then layer 1 once per distinct plan; the duplicate costs nothing."""
    plans = [None, *(_one_windowed(llama, la, k) for la in (0, 1) for k in (0, 1))]
    plans += [plans[3], KVPlan.windowed(llama, sinks=1, window=5)]
    needle = needle_batches(llama, 96, depths=(0.3, 0.7))
    prose = prose_batches(llama, 80, n=1)
    calls, hooks = _attention_calls(llama)
    try:
        got = evaluate_many(llama, plans, needle, prose)
    finally:
        for h in hooks:
            h.remove()
    # layer 0: once for {base, (1,0), (1,1)}, once each for (0,0), (0,1), all-windowed;
    # layer 1: once for each of the 6 distinct plans
    assert calls[0] == (4 + 6) * 3
    want = [evaluate(llama, p, needle, prose) for p in plans]
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    assert got[3] is got[5]
    # the plans differ: a windowed head changes what the model predicts
    assert abs(want[1].nll_sum - want[0].nll_sum) > 1e-3


def test_the_models_own_window_computed_as_a_band_is_exact(gemma3, monkeypatch):
    """Gemma 3's sliding layer over a sequence longer than 2 blocks goes through the band
    path (blocks of 16 here): the planned model's logits equal transformers' own SDPA
    forward, and a windowed global head evaluates the same through evaluate_many."""
    import headmech.kv.attention as attention

    monkeypatch.setattr(attention, "_BLOCK", 16)
    band = []
    real = attention._local
    monkeypatch.setattr(attention, "_local", lambda *a, **k: band.append(a[4]) or real(*a, **k))
    ids = torch.randint(
        0, gemma3.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        want = gemma3(ids).logits
        with planned(gemma3, None) as hf:
            got = hf(ids).logits
    assert band and all(lp.window == gemma3.config.sliding_window for lp in band)
    assert (got - want).abs().max() < 1e-5
    # without a plan on a short sequence the plain path runs (no band)
    band.clear()
    with torch.inference_mode(), planned(gemma3, None) as hf:
        hf(ids[:, :30])
    assert not band

    from types import SimpleNamespace

    from headmech.models.tiny import tiny_tokenizer

    shim = SimpleNamespace(tokenizer=tiny_tokenizer(True), cfg=SimpleNamespace(n_ctx=512))
    prose = prose_batches(shim, 120, n=1)
    plans = [None, _one_windowed(gemma3, 1, 0, sinks=1, window=3)]
    got2 = evaluate_many(gemma3, plans, prose=prose)
    for g, p in zip(got2, plans, strict=True):
        _same(g, evaluate(gemma3, p, prose=prose))
    assert got2[1].nll_sum != pytest.approx(got2[0].nll_sum, rel=1e-6)


def test_a_wide_window_over_a_long_sequence_runs_in_blocks_exactly(llama, monkeypatch):
    """A window wider than a quarter of the sequence goes through the dense band mask,
    unless that mask would be too large (``_DENSE`` entries: 1 GiB at 32k tokens); then
    through blocks of queries. Both give the same logits."""
    import headmech.kv.attention as attention

    monkeypatch.setattr(attention, "_BLOCK", 16)
    plan = KVPlan.windowed(llama, sinks=2, window=40)
    ids = torch.randint(0, 1000, (1, 100), generator=torch.Generator().manual_seed(1))
    calls = []
    real = attention._local
    monkeypatch.setattr(attention, "_local", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode(), planned(llama, plan) as hf:
        dense = hf(ids).logits
        assert not calls
        monkeypatch.setattr(attention, "_DENSE", 100 * 99)
        blocks = hf(ids).logits
    assert calls
    assert (dense - blocks).abs().max() < 1e-5
    with torch.inference_mode():
        assert (dense - llama(ids)).abs().max() > 1e-3  # the window bites
