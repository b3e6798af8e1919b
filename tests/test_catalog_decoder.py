"""Decoder head types on the bundled SmolLM2-135M (grouped-query attention)."""

from __future__ import annotations

import pytest
import torch

import headmech
from headmech.classification.classify import validate_heads
from headmech.models.weights import head_weights, ov_copying_scores
from headmech.probes import ProbeOptions

OPTIONS = ProbeOptions(n_sentences=48, n_sequences=16, half_len=32, batch_size=16)


@pytest.fixture(scope="module")
def smollm2_catalog(smollm2):
    return headmech.classify(
        smollm2,
        ["induction", "duplicate_token", "attention_sink", "previous_token"],
        **vars(OPTIONS),
    )


@pytest.mark.slow
def test_smollm2_has_induction_heads_in_the_middle_layers(smollm2_catalog):
    r = smollm2_catalog["induction"]
    heads = r.heads
    assert 2 <= len(heads) <= 12, smollm2_catalog.table()
    best = heads[0]
    assert float(r.score[best]) > 0.7  # most of its attention on the induction target
    assert r.details["argmax_hit_rate"][str(best)] > 0.8
    assert all(10 <= h.layer <= 25 for h in heads)  # none in the first or last layers
    # every labelled head copies, measured: ablated alone, it raises the repeated half's
    # loss (the interval above 0); the heads that only prefix-match do not
    for h in heads:
        assert r.details["copying_effect"][str(h)][1] > 0.0
    for layer, head in r.details["prefix_matching_only"]:
        assert r.details["copying_effect"][f"L{layer}H{head}"][1] <= 0.0


@pytest.mark.slow
def test_smollm2_other_decoder_types(smollm2_catalog):
    cat = smollm2_catalog
    assert cat.heads("previous_token"), cat.table()
    assert cat.heads("duplicate_token"), cat.table()
    # attention sinks are everywhere in small LLMs: most heads park most attention on token 0
    n = len(cat.heads("attention_sink"))
    assert n > 0.3 * 30 * 9, cat.table()
    # layer 0 has no attention sink: it has nothing to write yet
    assert all(h.layer > 0 for h in cat.heads("attention_sink")[:20])


@pytest.mark.slow
def test_ablating_induction_heads_hurts_far_more_than_random(smollm2, smollm2_catalog):
    T = headmech.get_head_type("induction")()
    heads = smollm2_catalog.heads("induction")
    # the set and its controls only (one_by_one=[]): each labelled head ablated alone is
    # read by no assertion here (test_smollm2_has_induction_heads_in_the_middle_layers
    # reads the catalog's own per-head ablations), and was half of this test's 16 s of CPU
    v = validate_heads(smollm2, T, heads, OPTIONS, n_random=3, mode="zero", one_by_one=[]).to_json()
    # the repeated half is predictable with induction: low clean loss, high once ablated
    assert v["clean"] < 4.0
    assert v["effect"] > 2.0
    # +8.34 against +1.13, +0.52 and +2.98 for 3 random relabellings of their layers
    # (which may hold some of the labelled heads: the exact test's controls)
    assert v["effect"] > 2 * max(max(v["random_effects"]), 0.05)
    assert v["test"]["exceedances"] == 0


def test_copying_score_matches_full_vocab_eigenvalues(tiny_models):
    """Σλ/Σ|λ| from the small d_head matrix equals the one from the full vocab x vocab OV circuit."""
    model = tiny_models["llama"]
    w = head_weights(model)
    got = ov_copying_scores(model, w)
    vocab = torch.randperm(w.W_E.shape[0], generator=torch.Generator().manual_seed(0))[:300]
    for layer, head in [(0, 0), (1, 3)]:
        # restricted to 300 tokens the nonzero spectrum is the small one built from the same rows
        E, U = w.W_E[vocab], w.W_U[:, vocab]
        M = E @ w.W_V[layer, head] @ w.W_O[layer, head] @ U  # [300, 300]
        eig = torch.linalg.eigvals(M.double())
        small = torch.linalg.eigvals((w.W_O[layer, head] @ U @ E @ w.W_V[layer, head]).double())
        want = float(eig.sum().real / eig.abs().sum())
        assert want == pytest.approx(float(small.sum().real / small.abs().sum()), abs=1e-6)
        # the same identity over the whole vocabulary gives the library's score
        full = torch.linalg.eigvals(
            (w.W_O[layer, head] @ w.W_U @ w.W_E @ w.W_V[layer, head]).double()
        )
        assert float(got[layer, head]) == pytest.approx(
            float(full.sum().real / full.abs().sum()), abs=1e-5
        )
    assert float(got.std()) > 1e-3  # heads differ: a constant score would fail
    assert got.shape == (2, 4) and torch.isfinite(got).all()


def test_gqa_weights_expand_kv_heads(tiny_models):
    model = tiny_models["llama"]  # 4 query heads, 2 KV heads
    w = head_weights(model, fold_norms=False)
    assert w.W_V.shape[:2] == (2, 4)
    torch.testing.assert_close(w.W_V[:, 0], w.W_V[:, 1])  # query heads 0, 1 share KV head 0
    torch.testing.assert_close(w.W_V[:, 2], model.W_V[:, 1].float())
