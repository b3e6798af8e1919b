"""LOCOS's headline test (headmech.compare.share): on the hand-built documents model, whose
head PLANTED alone reads the gold document's city, the top share by LOCOS's score is
PLANTED, ablating it takes the recall away, random heads do not, and the exact p says so."""

from __future__ import annotations

import pytest
import torch

from headmech.compare.share import _pick, share_ablation
from headmech.core.errors import InputError
from headmech.probes import build_probe
from headmech.probes.facts import answer_is_top
from headmech.testing import CONTROL_OPTIONS
from headmech.testing.controls import PLANTED
from headmech.testing.recall_controls import documents_model


@pytest.fixture(scope="module")
def model():
    return documents_model()


def test_the_top_share_is_the_planted_head_and_its_ablation_takes_recall_away(model):
    n = int(model.cfg.n_layers) * int(model.cfg.n_heads)
    got = share_ablation(model, probe="documents", n_questions=16, n_facts=0, share=1 / n, draws=4)
    assert got["k"] == 1 and got["heads"] == [str(PLANTED)]
    assert got["answered"] >= 12 and got["recall"] == got["answered"] / got["trials"]
    assert got["fall"] >= 0.8  # LOCOS's bar: recall falls by 80% or more
    # a random head costs recall only where it is one of block 0's binding heads (L0H0
    # looks three tokens back, L0H1 two), which PLANTED reads through
    assert len(got["random_sets"]) == 4 and all(str(PLANTED) not in s for s in got["random_sets"])
    for heads, fall in zip(got["random_sets"], got["random_fall"], strict=True):
        assert (fall > 0.5) == bool({"L0H0", "L0H1"} & set(heads)), (heads, fall)
    as_far = sum(f >= got["fall"] for f in got["random_fall"])
    assert got["p"] == pytest.approx((1 + as_far) / 5) and as_far < 4
    assert got["facts_answered"] == 0 and got["facts_fall"] != got["facts_fall"]  # not asked


def test_picked_rows_keep_every_per_row_extra(model):
    batches = build_probe("documents", model, CONTROL_OPTIONS).batches
    answered = answer_is_top(model, batches)
    keep = torch.arange(len(answered)) % 2 == 0
    picked = _pick(batches, keep)
    assert sum(b.input_ids.shape[0] for b in picked) == int(keep.sum())
    assert torch.equal(answer_is_top(model, picked), answered[keep])
    first = picked[0]
    assert first.extras["gold"].shape[0] == first.input_ids.shape[0]


def test_a_model_that_answers_nothing_or_a_share_of_no_head_is_refused(model):
    with pytest.raises(InputError, match="is 0 heads"):
        share_ablation(model, probe="documents", share=1e-6)
    with pytest.raises(InputError, match="answers none of the"):
        share_ablation(model, probe="nonliteral", n_questions=4, n_facts=0, share=0.1)
