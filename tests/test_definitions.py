"""Competing definitions of retrieval heads: QRHead's score against a hand computation
from the eager attention pattern, and the top-k overlap the agreement matrix reports."""

from __future__ import annotations

import pytest
import torch

from headmech.classification.definitions import jaccard, qrhead_scores, query_to_gold, top_k
from headmech.core.head_index import HeadIndex
from headmech.interventions import capture
from headmech.probes import ProbeOptions, build_probe


@pytest.fixture(scope="module")
def roomy(bpe_tokenizer):
    """A tiny LLaMA whose 512 positions hold the documents probe's five documents."""
    from headmech.models.tiny import tiny_model

    return tiny_model("llama", n_ctx=512, tokenizer=bpe_tokenizer, pad_token_id=None, seed=1)


def test_qrhead_is_the_questions_attention_to_the_gold_document(roomy):
    """By hand: every question token's pattern row summed over the gold document's keys,
    averaged over the question tokens of every question."""
    probe = build_probe("documents", roomy, ProbeOptions(n_sequences=10, batch_size=4))
    score = qrhead_scores(roomy, batches=probe.batches)
    n_layers = int(roomy.cfg.n_layers)
    total, rows = torch.zeros(score.shape, dtype=torch.float64), 0
    for b in probe.batches:
        names = [f"blocks.{la}.attn.hook_pattern" for la in range(n_layers)]
        store = capture(roomy, b, names)
        for r in range(b.input_ids.shape[0]):
            e = {k: v[r] for k, v in b.extras.items()}
            g = int(e["gold"])
            keys = slice(int(e["doc_start"][g]), int(e["doc_end"][g]))
            for q in range(int(e["query_start"]), int(e["query_end"])):
                for la in range(n_layers):
                    total[la] += store[names[la]][r, :, q, keys].sum(-1).double()
                rows += 1
    assert torch.allclose(score.double(), total / rows, atol=1e-5)
    # the targets: question rows only, gold keys only
    t = query_to_gold(probe.batches[0])
    e = probe.batches[0].extras
    assert int(t.any(-1).sum(-1)[0]) == int(e["query_end"][0] - e["query_start"][0])


def test_top_k_and_jaccard():
    score = torch.tensor([[0.1, float("nan"), 0.9], [0.5, 0.9, 0.0]])
    assert top_k(score, 3) == [HeadIndex(0, 2), HeadIndex(1, 1), HeadIndex(1, 0)]
    assert top_k(score, 6)[-1] == HeadIndex(0, 1)  # NaN last
    a, b = top_k(score, 2), top_k(score, 3)
    assert jaccard(a, b) == pytest.approx(2 / 3) and jaccard([], []) == 1.0


@pytest.mark.slow
def test_smollm2s_qrhead_heads_are_early_and_not_wu_retrieval_heads(smollm2):
    """docs/findings.md, "Retrieval heads by two definitions": on 40 questions SmolLM2's
    16 QRHead heads lie in layers 0-9 (mean relative depth 0.14), none of them among the
    top 16 by the published catalog's retrieval score (Jaccard 0; Gemma 3 0.28, Qwen2.5
    0.19): the question's name meets its copy in the gold document early, the copy-paste
    heads of Wu et al. are the induction band of layers 14-23."""
    import json
    from pathlib import Path

    score = qrhead_scores(smollm2, 40)
    qr = top_k(score, 16)
    path = Path(__file__).resolve().parent.parent / "catalog" / "smollm2-135m" / "catalog.json"
    wu = top_k(torch.tensor(json.loads(path.read_text())["types"]["retrieval"]["score"]), 16)
    assert jaccard(qr, wu) < 0.1
    assert max(h.layer for h in qr) <= 12 and sum(h.layer for h in qr) / 16 / 29 < 0.3


def test_the_documents_task_is_the_citys_loss_and_its_corruption_removes_the_city(roomy):
    import torch.nn.functional as F

    from headmech.tasks import get_task

    task = get_task("documents", roomy)
    (batch,) = task.batches(roomy, ProbeOptions(n_sequences=4, batch_size=4))
    sums, counts = task.metric(roomy, batch)
    with torch.no_grad():
        logits = roomy(batch.input_ids).float()
    rows = torch.arange(4)
    nll = F.cross_entropy(
        logits[rows, batch.extras["end_pos"]], batch.extras["answer"], reduction="none"
    )
    assert torch.allclose(sums.flatten() / counts.flatten(), nll, atol=1e-4)
    bad = task.corrupt(batch, roomy, 0)
    changed = (bad.input_ids != batch.input_ids).nonzero().tolist()
    assert changed == [[r, int(batch.extras["answer_pos"][r])] for r in range(4)]
    assert not (bad.input_ids[rows, batch.extras["answer_pos"]] == batch.extras["answer"]).any()
