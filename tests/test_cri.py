"""The cri type (LOCOS's causal retrieval importance): its corruption, its score against the
authors' own patching (a pre-hook on each layer's o_proj of the Hugging Face model, as
aryopg/locos ``locos/detectors/cri.py`` patches), and its labels on the hand-built model."""

from __future__ import annotations

import pytest
import torch

from headmech.core.head_index import HeadIndex
from headmech.headtypes import collect_statistics, get_head_type
from headmech.headtypes.cri import cri_scores, remove_needle
from headmech.interventions.sources import needle_span
from headmech.probes import build_probe
from headmech.testing import CONTROL_OPTIONS
from headmech.testing.controls import PLANTED
from headmech.testing.recall_controls import documents_model


@pytest.fixture(scope="module")
def model():
    return documents_model()


@pytest.fixture(scope="module")
def batches(model):
    return build_probe("documents", model, CONTROL_OPTIONS).batches


def test_remove_needle_overwrites_the_gold_document_with_periods(model, batches):
    batch = batches[0]
    removed = remove_needle(batch, model)
    (period,) = model.tokenizer.encode(".", add_special_tokens=False)
    lo, hi = needle_span(batch)
    pos = torch.arange(batch.input_ids.shape[1])
    needle = (pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])
    assert int(needle.sum(1).min()) >= 4  # a document, not a token
    assert bool((removed.input_ids[needle] == period).all())
    assert torch.equal(removed.input_ids[~needle], batch.input_ids[~needle])
    assert torch.equal(removed.attention_mask, batch.attention_mask)
    # the counterfactual: the removed run's first choice other than the answer
    cf = removed.extras["counterfactual"]
    assert bool((cf != batch.extras["answer"]).all())
    with torch.no_grad():
        logits = model(removed.input_ids)
    rows = torch.arange(len(cf))
    last = logits[rows, batch.extras["end_pos"]]
    last[rows, batch.extras["answer"]] = float("-inf")
    assert torch.equal(last.argmax(-1), cf)


def _authors_cri(model, batch, layer: int, head: int) -> list[float]:
    """Per question, the authors' steps on the Hugging Face model: the clean run's input to
    o_proj captured, the needle-removed run with that head's slice of it put back, the
    answer's logit minus the counterfactual's at the answer step, minus the same
    unpatched (``compute_cri_for_example``, metric ``first_token_logit_diff``)."""
    hf = model.original_model
    removed = remove_needle(batch, model)
    d_head = int(model.cfg.d_head)
    o_proj = hf.model.layers[layer].self_attn.o_proj
    out = []
    for r in range(batch.input_ids.shape[0]):
        n = int(batch.attention_mask[r].sum())
        clean, corrupt = batch.input_ids[r : r + 1, :n], removed.input_ids[r : r + 1, :n]
        end = int(batch.extras["end_pos"][r])
        good, bad = int(batch.extras["answer"][r]), int(removed.extras["counterfactual"][r])
        saved = {}

        def capture(module, args, saved=saved):
            saved["x"] = args[0].detach().clone()

        def patch(module, args, saved=saved):
            x = args[0].clone()
            sl = slice(head * d_head, (head + 1) * d_head)
            x[..., sl] = saved["x"][..., sl]
            return (x,)

        with torch.no_grad():
            handle = o_proj.register_forward_pre_hook(capture)
            hf(clean)
            handle.remove()
            base = hf(corrupt).logits[0, end]
            handle = o_proj.register_forward_pre_hook(patch)
            patched = hf(corrupt).logits[0, end]
            handle.remove()
        out.append(float((patched[good] - patched[bad]) - (base[good] - base[bad])))
    return out


def test_cri_is_the_authors_patching(model, batches):
    """cri_scores against the authors' o_proj patching for PLANTED, the binding head in
    block 0 and a head of neither, question by question (mean and sign share)."""
    got = cri_scores(model, batches)
    n = sum(b.input_ids.shape[0] for b in batches)
    assert float(got["questions"].max()) == n
    for layer, head in [(PLANTED.layer, PLANTED.head), (0, 0), (1, 3)]:
        per = [v for b in batches for v in _authors_cri(model, b, layer, head)]
        assert float(got["cri"][layer, head]) == pytest.approx(sum(per) / n, rel=1e-3, abs=1e-3)
        share = sum(v > 0 for v in per) / n
        assert float(got["positive"][layer, head]) == pytest.approx(share)
    assert float(got["cri"][PLANTED]) > 10.0  # the answer's lead restored: ~12 logits
    assert float(got["removed"].max()) < 0  # without the needle the answer is not first


def test_planted_is_labelled_first_and_the_reasons_given(model, batches):
    cri = get_head_type("cri")()
    stats = collect_statistics([cri], model, batches)
    score = cri.score(stats)
    heads = cri.select(score, stats)
    assert heads[0] == PLANTED
    details = cri.details(stats, score, heads)
    assert details["questions"] == CONTROL_OPTIONS.n_sequences and details["removed"] < 0
    assert details["p"][str(PLANTED)] < 1e-4
    # a strict threshold leaves PLANTED alone
    strict = get_head_type("cri")(threshold=5.0)
    assert strict.select(strict.score(stats), stats) == [PLANTED]


def test_only_the_heads_first_by_the_estimate_are_patched(model, batches):
    """With n_exact=2 the two heads of highest first-order estimate (attribution patching)
    are patched and equal the every-head run; the others keep the estimate, and a head
    above the threshold on an estimate alone is not labelled."""
    every = cri_scores(model, batches, n_exact=None)
    two = cri_scores(model, batches, n_exact=2)
    assert int(two["exact"].sum()) == 2 and bool(every["exact"].all())
    patched = two["exact"].bool()
    assert bool(patched[PLANTED])  # the estimate ranks PLANTED first or second
    torch.testing.assert_close(two["cri"][patched], every["cri"][patched])
    torch.testing.assert_close(two["cri"][~patched], two["estimate"][~patched])
    torch.testing.assert_close(two["estimate"], every["estimate"])
    cri = get_head_type("cri")(threshold=-1000.0, n_exact=2)  # every head above the threshold
    stats = collect_statistics([cri], model, batches)
    why = cri.rejected(cri.score(stats), stats)
    estimated = [HeadIndex(la, h) for la, h in (~patched).nonzero().tolist()]
    assert all("only estimated to first order" in why[h] for h in estimated)
    assert set(cri.select(cri.score(stats), stats)) <= {
        HeadIndex(la, h) for la, h in patched.nonzero().tolist()
    }
