"""The qrhead type (Zhang et al. 2025): the null twins its probe adds, its score against the
agreement matrix's QRHead definition, and its sign test against scipy's."""

from __future__ import annotations

import pytest
import torch

from headmech.classification.definitions import qrhead_scores
from headmech.headtypes import collect_statistics, get_head_type
from headmech.headtypes.qrhead import calibrated_gold
from headmech.probes import build_probe
from headmech.probes.documents import null_query_batch, query_to_gold, with_null_twins
from headmech.testing import CONTROL_OPTIONS, planted_statistics, tiny_model
from headmech.testing.controls import PLANTED


@pytest.fixture(scope="module")
def model():
    return tiny_model("causal")


@pytest.fixture(scope="module")
def documents(model):
    return build_probe("documents", model, CONTROL_OPTIONS).batches


def test_each_question_is_followed_by_its_null_twin(model, documents):
    batch = documents[0]
    twins = with_null_twins(batch, model.tokenizer)
    null = null_query_batch(batch, model.tokenizer)
    n = batch.input_ids.shape[0]
    assert twins.input_ids.shape[0] == 2 * n
    assert torch.equal(twins.input_ids[0::2], batch.input_ids)
    assert torch.equal(twins.input_ids[1::2], null.input_ids)
    assert torch.equal(twins.attention_mask[1::2], null.attention_mask)
    assert twins.extras["null"].tolist() == [False, True] * n
    assert torch.equal(twins.extras["query_end"][1::2], null.extras["query_end"])
    assert torch.equal(twins.extras["gold"][0::2], twins.extras["gold"][1::2])
    # the null query asks nothing: its row's text ends with it
    text = model.tokenizer.decode(twins.input_ids[1][twins.attention_mask[1].bool()])
    assert text.endswith("Question: N/A")
    # a cut at an even row keeps the pairs; a batch without its twins is refused
    qr = get_head_type("qrhead")()
    width = twins.input_ids.shape[1]
    pattern = torch.rand(2, 4, width, width).softmax(-1)
    assert set(qr._reduce(pattern, twins.head(2), None, 0)) == {"score", "positive", "mass", "null_mass"}  # fmt: skip
    with pytest.raises(ValueError, match="interleave each question with its null twin"):
        qr._reduce(pattern[:1], twins.head(1), None, 0)


def test_the_type_scores_what_the_matrix_definition_scores(model, documents):
    """The type on its twinned probe scores what qrhead_scores (the agreement matrix's
    QRHead column, given the plain documents batches) scores on the same questions: one
    score, checked against the authors' steps by hand in tests/test_definitions.py."""
    qr = get_head_type("qrhead")()
    twins = [with_null_twins(b, model.tokenizer) for b in documents]
    stats = collect_statistics([qr], model, twins)
    assert torch.allclose(qr.score(stats), qrhead_scores(model, batches=documents), atol=1e-6)
    assert int(stats.counts["qrhead.score"].max()) == CONTROL_OPTIONS.n_sequences


def test_equal_calibrated_scores_are_all_kept():
    """A document whose calibrated scores are all equal has no outlier: the planted head's
    uniform attention to the gold document scores 1, not 0 (the authors' code, with its
    strict mean - 2 std cut, would drop every token)."""
    gold = torch.tensor([[False, True, True, True, True, False]])
    real = torch.tensor([[0.0, 0.25, 0.25, 0.25, 0.25, 0.0]])
    assert calibrated_gold(real, torch.zeros_like(real), gold).item() == pytest.approx(1.0)
    # one key far below the rest is dropped (its calibrated score is an outlier)
    real = torch.tensor([[0.0, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, -2.0, 0.0]])
    gold = torch.tensor([[False] + [True] * 9 + [False]])
    assert calibrated_gold(real, torch.zeros_like(real), gold).item() == pytest.approx(2.4)


def test_sign_test_is_scipys_and_a_head_right_half_the_time_is_not_labelled(model):
    """A head planted to read the gold document on even questions and the first other
    document on odd ones: score 0.5 (calibrated 1 or 0), above 0 in half the questions;
    its p is scipy's binomtest and its q too large, so it is listed as rejected."""
    from scipy.stats import binomtest

    qr = get_head_type("qrhead")()
    probe = build_probe("query_documents", model, CONTROL_OPTIONS)

    def half(batch):
        t = query_to_gold(batch) & ~batch.extras["null"][:, None, None]
        e = batch.extras
        pos = torch.arange(batch.input_ids.shape[1])
        for r in range(0, batch.input_ids.shape[0], 4):  # every other question
            other = 1 if int(e["gold"][r]) == 0 else 0
            wrong = (pos >= e["doc_start"][r, other]) & (pos < e["doc_end"][r, other])
            t[r] = t[r].any(-1, keepdim=True) & wrong[None]
        eye = torch.eye(t.shape[1], dtype=torch.bool).expand_as(t)
        t = torch.where(t.any(-1, keepdim=True), t, eye)
        return t.float() / t.float().sum(-1, keepdim=True)

    stats = planted_statistics(qr, model, probe.batches, pattern=half)
    score = qr.score(stats)
    assert float(score[PLANTED]) == pytest.approx(0.5, abs=1e-5)
    n = int(stats.counts["qrhead.positive"][PLANTED])
    k = round(float(stats.mean("qrhead.positive")[PLANTED]) * n)
    assert (n, k) == (16, 8)
    p, q = qr.significance(stats)
    assert float(p[PLANTED]) == pytest.approx(binomtest(k, n, 0.5, alternative="greater").pvalue)
    assert PLANTED not in qr.select(score, stats)
    assert "Benjamini-Hochberg" in qr.rejected(score, stats)[PLANTED]
