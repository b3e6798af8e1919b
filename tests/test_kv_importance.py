"""Measured KV-head importance (headmech.kv.kv_importance), plans from a ranking
(KVPlan.from_ranking) and the model's own sliding windows (model_windows)."""

from __future__ import annotations

import math

import pytest
import torch

from headmech.core.errors import InputError
from headmech.kv import (
    KVImportance,
    KVPlan,
    evaluate,
    kv_importance,
    model_windows,
    needle_batches,
    prose_batches,
)
from headmech.kv.budget import split_beyond_windows


@pytest.fixture(scope="module")
def llama():
    from headmech.testing import tiny_model

    return tiny_model("causal")  # LLaMA, 2 layers, 4 query heads, 2 KV heads, 256 positions


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 (plain Hugging Face): layer 0 has a 6-token window, layer 1 none."""
    import transformers

    from headmech.models.families import WINDOW
    from headmech.models.tiny import build_tiny

    path = build_tiny("gemma3", tmp_path_factory.mktemp("gemma3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf.config.sliding_window == WINDOW
    return hf


def test_model_windows(llama, gemma3):
    assert model_windows(llama) == (0, 0)
    assert model_windows(gemma3) == (6, 0)


def test_budget_beyond_the_models_own_windows(gemma3, tmp_path):
    # own cache at 40 tokens: 2 KV heads x (6 + 40) = 92 entries, 12 of them layer 0's
    plan = KVPlan.from_ranking(gemma3, [(1, 1), (0, 0), (1, 0)], 0.75, 40, sinks=1, window=4)
    assert plan.windows == (6, 0)
    assert plan.full.tolist() == [[True, True], [False, True]]  # layer 0 keeps its window
    assert plan.window == 16  # (0.75 * 92 - 12 - 40) - 1 sink
    assert plan.own_entries(40) == 92
    assert plan.cache_entries(40) == 12 + 40 + 17
    assert plan.kv_fraction(40) == pytest.approx(0.75)
    assert plan.kv_fraction(3) == 1.0  # nothing evicted yet
    windowed = KVPlan.from_ranking(gemma3, [], 0.75, 40, sinks=1, window=4)
    assert windowed.full.tolist() == [[True, True], [False, False]]
    assert windowed.kv_fraction(40) <= 0.75 and windowed.window == 27
    assert KVPlan.load(plan.save(tmp_path / "plan.json")) == plan
    with pytest.raises(InputError, match="sliding windows hold"):
        KVPlan.from_ranking(gemma3, [(1, 0)], 0.1, 40)


def test_plan_cache_keeps_the_models_own_windows(gemma3):
    """On a model with sliding-window layers the compressed cache generates what the
    masked model does, and holds layer 0's own window (6 - 1 positions, as transformers'
    sliding-window cache) beside the plan's full and windowed KV heads of layer 1."""
    from headmech.kv import PlanCache, generate, planned

    plan = KVPlan.from_ranking(gemma3, [(1, 1)], 0.75, 40, sinks=1, window=4)
    ids = torch.randint(
        3, gemma3.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    gen = generate(gemma3, plan, ids, max_new_tokens=6)
    out, logits = ids, []
    with planned(gemma3, plan) as hf, torch.inference_mode():
        for _ in range(6):  # the masked model over the whole sequence at every step
            logits.append(hf(out).logits[:, -1].float())
            out = torch.cat([out, logits[-1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen.tokens, out[:, 40:])
    assert (gen.logits - torch.stack(logits, 1)).abs().max() < 1e-4
    cache = PlanCache(plan)
    with planned(gemma3, plan) as hf, torch.inference_mode():
        hf(ids, past_key_values=cache, use_cache=True)
    own, last = cache.layers
    assert own.full_keys.shape[1] == 0 and own.win_keys.shape[1:3] == (2, 5)
    assert own.positions.tolist() == [35, 36, 37, 38, 39]
    assert last.full_keys.shape[1:3] == (1, 40) and last.win_keys.shape[1:3] == (1, plan.window + 1)
    # the baseline is the model's own cache: layer 0 keeps 5 positions as a view of the
    # step's 6 (the storage counts), layer 1 all 45
    full = generate(gemma3, None, ids, max_new_tokens=6)
    per_entry = 2 * 2 * gemma3.config.head_dim * 4  # K and V, batch 2, fp32
    assert full.nbytes == 2 * (6 + 45) * per_entry
    assert gen.nbytes < 0.8 * full.nbytes
    assert torch.equal(full.tokens, generate(gemma3, KVPlan.full_cache(gemma3), ids, 6).tokens)


def test_split_beyond_windows_without_windows_is_split_budget():
    from headmech.kv import split_budget

    ranking = [(la, k) for la in range(3) for k in range(2)]
    glob, k, w = split_beyond_windows(0.5, 100, (0, 0, 0), 2, 4, 16, ranking)
    assert glob == {0, 1, 2} and (k, w) == split_budget(0.5, 100, 6, 4, 16)
    with pytest.raises(InputError, match="every layer"):
        split_beyond_windows(0.5, 100, (8, 8), 2, 4, 16, ranking)


def test_importance_is_the_loss_one_windowed_head_adds(llama):
    needle = needle_batches(llama, 100, depths=(0.5,))
    prose = prose_batches(llama, 60, n=1)
    imp = kv_importance(llama, needle, prose, sinks=1, window=3)
    base = evaluate(llama, None, needle, prose)
    for layer, kv in [(0, 1), (1, 0)]:
        heads = [(la, h) for la in range(2) for h in range(4) if (la, h // 2) != (layer, kv)]
        ev = evaluate(llama, KVPlan.from_heads(llama, heads, sinks=1, window=3), needle, prose)
        want_prose = ev.nll_sum / ev.n_tokens - base.nll_sum / base.n_tokens
        want_needle = ev.trials[0]["nll"] - base.trials[0]["nll"]
        assert float(imp.prose[layer, kv]) == pytest.approx(want_prose, abs=1e-5)
        assert float(imp.needle[layer, kv]) == pytest.approx(want_needle, abs=1e-5)
    assert bool((imp.prose.abs() > 1e-6).any())  # the window bites somewhere
    score = imp.score
    ranked = [float(score[la, k]) for la, k in imp.ranking()]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) == 4
    data = imp.to_json()
    assert data["ranking"] == [list(p) for p in imp.ranking()]
    # a window as long as the context restricts nothing: no loss at all
    wide = kv_importance(llama, prose=prose, sinks=0, window=60)
    assert wide.prose.abs().max() == 0 and math.isnan(wide.base_needle)


def test_restored_importance_is_the_loss_one_full_head_removes(llama):
    needle = needle_batches(llama, 100, depths=(0.5,))
    prose = prose_batches(llama, 60, n=1)
    imp = kv_importance(llama, needle, prose, sinks=1, window=3, mode="restored")
    base = evaluate(llama, None, needle, prose)
    none = evaluate(llama, KVPlan.from_heads(llama, [], sinks=1, window=3), needle, prose)
    assert imp.mode == "restored" and imp.base_prose == pytest.approx(base.nll_sum / base.n_tokens)
    assert imp.windowed_prose == pytest.approx(none.nll_sum / none.n_tokens, abs=1e-6)
    assert imp.windowed_needle == pytest.approx(none.trials[0]["nll"], abs=1e-6)
    for layer, kv in [(0, 1), (1, 0)]:
        heads = [(layer, h) for h in range(4) if h // 2 == kv]  # that KV head's query heads
        ev = evaluate(llama, KVPlan.from_heads(llama, heads, sinks=1, window=3), needle, prose)
        want_prose = none.nll_sum / none.n_tokens - ev.nll_sum / ev.n_tokens
        want_needle = none.trials[0]["nll"] - ev.trials[0]["nll"]
        assert float(imp.prose[layer, kv]) == pytest.approx(want_prose, abs=1e-5)
        assert float(imp.needle[layer, kv]) == pytest.approx(want_needle, abs=1e-5)
    # the score: per task, the share of the all-windowed gap the head alone closes
    gap_n, gap_p = imp.windowed_needle - imp.base_needle, imp.windowed_prose - imp.base_prose
    assert gap_p > 0
    want = imp.prose / gap_p + (imp.needle / gap_n if gap_n > 0 else 0)
    assert torch.allclose(imp.score, want)
    scores = [float(imp.score[p]) for p in imp.ranking()]
    assert scores == sorted(imp.score.flatten().tolist(), reverse=True)
    data = imp.to_json()
    assert data["mode"] == "restored" and data["windowed_prose"] == imp.windowed_prose
    # a window as long as the context restricts nothing: no gap, every score 0
    wide = kv_importance(llama, prose=prose, sinks=0, window=60, mode="restored")
    assert wide.prose.abs().max() == 0 and wide.score.abs().max() == 0
    with pytest.raises(InputError, match="unknown importance mode 'x'"):
        kv_importance(llama, prose=prose, mode="x")


def test_ranking_by_task_takes_each_tasks_order_in_turn():
    nan = math.nan
    imp = KVImportance(
        needle=torch.tensor([[nan, nan], [0.5, 0.0], [0.2, 0.1]]),
        prose=torch.tensor([[nan, nan], [0.0, 0.03], [0.01, 0.02]]),
        base_needle=0.1, base_prose=3.0, sinks=4, window=8,
    )  # fmt: skip
    # the sum lets the needle's scale decide; by task: needle 1st, prose 1st, needle 2nd, ...
    assert imp.ranking() == [(1, 0), (2, 0), (2, 1), (1, 1)]
    assert imp.ranking("task") == [(1, 0), (1, 1), (2, 0), (2, 1)]
    prose_first = KVImportance(imp.needle, imp.prose * 100, 0.1, 3.0, 4, 8)
    assert prose_first.ranking() == [(1, 1), (2, 1), (2, 0), (1, 0)]
    assert prose_first.ranking("task") == imp.ranking("task")  # scale-free
    only_prose = KVImportance(torch.full((3, 2), nan), imp.prose, nan, 3.0, 4, 8)
    assert only_prose.ranking("task") == [(1, 1), (2, 1), (2, 0), (1, 0)]
    back = KVImportance.from_json(imp.to_json())
    assert back.ranking("task") == imp.ranking("task") and math.isnan(float(back.needle[0, 0]))
    with pytest.raises(InputError, match="unknown ranking 'x'"):
        imp.ranking("x")
    with pytest.raises(InputError, match="not a KV importance record"):
        KVImportance.from_json({"ranking": [[1, 0]], "from_context": 2048})


def test_importance_leaves_the_models_windowed_layers_alone(gemma3):
    from types import SimpleNamespace

    from headmech.models.tiny import tiny_tokenizer

    shim = SimpleNamespace(tokenizer=tiny_tokenizer(True), cfg=SimpleNamespace(n_ctx=512))
    prose = prose_batches(shim, 40, n=1)
    imp = kv_importance(gemma3, prose=prose, sinks=1, window=3)
    assert torch.isnan(imp.prose[0]).all() and torch.isfinite(imp.prose[1]).all()
    assert {la for la, _ in imp.ranking()} == {1}
    restored = kv_importance(gemma3, prose=prose, sinks=1, window=3, mode="restored")
    assert torch.isnan(restored.prose[0]).all() and torch.isfinite(restored.prose[1]).all()
    assert {la for la, _ in restored.ranking()} == {1}
    with pytest.raises(InputError, match="needs needle trials or prose"):
        kv_importance(gemma3)
