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
    score = qrhead_scores(roomy, batches=probe.batches, calibrated=False)
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


def _question_rows(model, ids: list[int], start: int, end: int) -> torch.Tensor:
    """``[n_layers, n_heads, key]``: the eager pattern's rows of the question's tokens,
    averaged, for one prompt run alone (no padding)."""
    from headmech.core.stats import ProbeBatch

    t = torch.tensor([ids])
    one = ProbeBatch(t, torch.ones_like(t), torch.zeros_like(t, dtype=torch.bool))
    n_layers = int(model.cfg.n_layers)
    names = [f"blocks.{la}.attn.hook_pattern" for la in range(n_layers)]
    store = capture(model, one, names)
    return torch.stack([store[n][0, :, start:end].mean(1) for n in names])


def test_qrhead_calibrated_is_the_authors_detection_score_by_hand(roomy, bpe_tokenizer):
    """QRHead's detection score as princeton-pli/QRHead computes it
    (``score_docs_per_head_for_detection``), by hand, each prompt run alone: the question
    tokens' mean attention to each key, minus the same with the question replaced by
    "Question: N/A"; on the gold document the calibrated scores at or below their mean
    minus two standard deviations dropped, the rest summed; averaged over the questions."""
    probe = build_probe("documents", roomy, ProbeOptions(n_sequences=6, batch_size=4))
    score = qrhead_scores(roomy, batches=probe.batches)
    null = bpe_tokenizer.encode("Question: N/A", add_special_tokens=False)
    total, n = torch.zeros(score.shape, dtype=torch.float64), 0
    for b in probe.batches:
        for r in range(b.input_ids.shape[0]):
            e = {k: v[r] for k, v in b.extras.items()}
            length = int(b.attention_mask[r].sum())
            ids = b.input_ids[r, :length].tolist()
            qs, qe = int(e["query_start"]), int(e["query_end"])
            real = _question_rows(roomy, ids, qs, qe)
            base = _question_rows(roomy, ids[:qs] + null, qs, qs + len(null))
            g = int(e["gold"])
            lo, hi = int(e["doc_start"][g]), int(e["doc_end"][g])
            for la in range(score.shape[0]):
                for h in range(score.shape[1]):
                    cal = [float(real[la, h, k] - base[la, h, k]) for k in range(lo, hi)]
                    mean = sum(cal) / len(cal)
                    std = (sum((c - mean) ** 2 for c in cal) / (len(cal) - 1)) ** 0.5
                    total[la, h] += sum(c for c in cal if c > mean - 2 * std)
            n += 1
    assert n == 6
    torch.testing.assert_close(score.double(), total / n, atol=1e-5, rtol=1e-4)
    assert float(score.abs().max()) > 1e-3  # something measured, not zeros


def test_top_k_and_jaccard():
    score = torch.tensor([[0.1, float("nan"), 0.9], [0.5, 0.9, 0.0]])
    assert top_k(score, 3) == [HeadIndex(0, 2), HeadIndex(1, 1), HeadIndex(1, 0)]
    assert top_k(score, 6)[-1] == HeadIndex(0, 1)  # NaN last
    a, b = top_k(score, 2), top_k(score, 3)
    assert jaccard(a, b) == pytest.approx(2 / 3) and jaccard([], []) == 1.0


@pytest.mark.parametrize("name", ["nonliteral", "literal"])
def test_the_needle_name_tasks_are_the_names_loss_and_corruption_renames_the_needle(roomy, name):
    from headmech.probes.ioi import ioi_names

    task, batch = _task_is_the_answers_loss_at_the_end(name, roomy, 4)
    e, rows = batch.extras, torch.arange(4)
    assert (batch.input_ids[rows, e["name_pos"]] == e["answer"]).all()
    bad = task.corrupt(batch, roomy, 0)
    changed = (bad.input_ids != batch.input_ids).nonzero().tolist()
    assert changed == [[r, int(e["name_pos"][r])] for r in range(4)]  # the name alone
    names = set(ioi_names(roomy.tokenizer))
    assert all(int(t) in names for t in bad.input_ids[rows, e["name_pos"]])


@pytest.mark.slow
def test_smollm2s_calibrated_qrhead_heads_are_mid_depth_and_share_wus(smollm2):
    """docs/findings.md, "Retrieval heads by four definitions": on 40 questions SmolLM2's
    16 QRHead heads by the authors' calibrated score sit at mean relative depth 0.54
    (layers 4-23) and share 8 of their heads with the top 16 by the published catalog's
    retrieval score (Jaccard 0.33). Without the calibration (what the matrices used before
    2026-11-30) the top 16 lay in layers 0-9 and shared none: attention the question gives
    the gold document whatever it asks, which the "N/A" pass subtracts."""
    import json
    from pathlib import Path

    qr = top_k(qrhead_scores(smollm2, 40), 16)
    path = Path(__file__).resolve().parent.parent / "catalog" / "smollm2-135m" / "catalog.json"
    wu = top_k(torch.tensor(json.loads(path.read_text())["types"]["retrieval"]["score"]), 16)
    assert jaccard(qr, wu) >= 0.25
    assert 0.4 <= sum(h.layer for h in qr) / 16 / 29 <= 0.7


def _task_is_the_answers_loss_at_the_end(name: str, model, n: int):
    """The task's batch of ``n`` prompts, once its metric is checked: the NLL of
    ``extras["answer"]`` at ``extras["end_pos"]``, by hand from the model's logits."""
    import torch.nn.functional as F

    from headmech.tasks import get_task

    task = get_task(name, model)
    (batch,) = task.batches(model, ProbeOptions(n_sequences=n, batch_size=n))
    sums, counts = task.metric(model, batch)
    with torch.no_grad():
        logits = model(batch.input_ids).float()
    e = batch.extras
    nll = F.cross_entropy(logits[torch.arange(n), e["end_pos"]], e["answer"], reduction="none")
    assert torch.allclose(sums.flatten() / counts.flatten(), nll, atol=1e-4)
    return task, batch


def test_the_documents_task_is_the_citys_loss_and_its_corruption_removes_the_city(roomy):
    task, batch = _task_is_the_answers_loss_at_the_end("documents", roomy, 4)
    rows = torch.arange(4)
    bad = task.corrupt(batch, roomy, 0)
    changed = (bad.input_ids != batch.input_ids).nonzero().tolist()
    assert changed == [[r, int(batch.extras["answer_pos"][r])] for r in range(4)]
    assert not (bad.input_ids[rows, batch.extras["answer_pos"]] == batch.extras["answer"]).any()


def test_the_facts_task_is_the_answers_loss_and_its_corruption_replaces_the_subject(roomy):
    task, batch = _task_is_the_answers_loss_at_the_end("facts", roomy, 8)
    e = batch.extras
    bad = task.corrupt(batch, roomy, 0)
    changed = bad.input_ids != batch.input_ids
    assert not (changed & ~e["subject"]).any()  # the relation and the start tokens stay
    assert changed.sum() >= 0.9 * e["subject"].sum()  # (a random token may repeat one)


@pytest.mark.slow
def test_smollm2s_subject_and_relation_heads_are_different_heads(smollm2):
    """Chughtai et al.'s split on the facts SmolLM2 completes (36 of 64): the answer is
    written from the subject's tokens by heads of layer 23 (L23H4 +1.08 nats, L23H5 +0.54)
    and from the relation's by L29H1 (+1.75), not the same heads. Mean-ablating each top
    4 against 19 same-layer control sets (docs/findings.md): subject heads +1.80 nats of
    answer loss (controls' median +0.88), relation heads +0.43 (+0.04), p = 0.05 each."""
    from headmech.attribution.logit import subject_relation_scores

    r = subject_relation_scores(smollm2, 64)
    assert r["known"] >= 30 and r["asked"] == 64
    subject, relation = top_k(r["subject"], 4), top_k(r["relation"], 4)
    assert subject[0] == HeadIndex(23, 4) and relation[0] == HeadIndex(29, 1)
    assert not set(subject) & set(relation)
    assert float(r["subject"][23, 4]) > 0.8 and float(r["relation"][29, 1]) > 1.2


def _locos_by_hand(model, batch, layer: int, head: int, spans) -> list:
    """Per sequence, ``φ_j = α_j u_yᵀ W_O v_j`` at the answer step from an eager forward,
    summed over the needle's span minus the other keys' sum rescaled by the span's length
    over theirs (the authors' ``compute_logit_contribution_per_step``)."""
    names = [f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_v"]
    st = capture(model, batch, names)
    e, out = batch.extras, []
    for r, (lo, hi) in enumerate(spans):
        end = int(e["end_pos"][r])
        v = st[names[1]][r, : end + 1, head // 2]  # GQA: 2 query heads a value
        u = model.W_U[:, int(e["answer"][r])]
        phi = st[names[0]][r, head, end, : end + 1] * (v @ model.blocks[layer].attn.W_O[head] @ u)
        on = phi[lo:hi].sum()
        out.append(on - (phi.sum() - on) * (hi - lo) / (end + 1 - (hi - lo)))
    return out


def test_locos_is_the_answers_logit_contribution_from_the_gold_document(roomy, monkeypatch):
    """LOCOS's score by the authors' formula (``compute_logit_contribution_per_step``),
    by hand for one head from an eager forward: ``φ_j = α_j u_yᵀ W_O v_j`` at the answer
    step, summed over the gold document minus the other keys' sum rescaled by the
    document's length over theirs; by default averaged over the questions the model
    answers only (``document_recall``'s mask, here made up: the second of two)."""
    from headmech.classification.definitions import locos_scores

    (batch,) = build_probe("documents", roomy, ProbeOptions(n_sequences=2, batch_size=2)).batches
    got = locos_scores(roomy, batches=[batch], answered_only=False)
    assert got["answered"] == got["asked"] == 2
    torch.testing.assert_close(got["score"], got["L_plus"] - got["L_minus"])
    layer, head = 1, 3
    e = batch.extras
    gold = e["gold"]
    spans = [(int(e["doc_start"][r, gold[r]]), int(e["doc_end"][r, gold[r]])) for r in range(2)]
    want = _locos_by_hand(roomy, batch, layer, head, spans)
    mean = float(sum(want).detach()) / 2
    assert float(got["score"][layer, head]) == pytest.approx(mean, rel=1e-4, abs=1e-7)
    assert got["score"].abs().sum() > 0
    import headmech.probes.facts as facts

    monkeypatch.setattr(facts, "answer_is_top", lambda model, bs: torch.tensor([False, True]))
    only = locos_scores(roomy, batches=[batch])
    assert (only["answered"], only["asked"]) == (1, 2)
    assert float(only["score"][layer, head]) == pytest.approx(float(want[1]), rel=1e-4, abs=1e-7)
    monkeypatch.setattr(facts, "answer_is_top", lambda model, bs: torch.tensor([False, False]))
    none = locos_scores(roomy, batches=[batch])  # nothing answered: zeros, not NaN
    assert none["answered"] == 0 and not none["score"].any()


def test_locos_on_non_literal_needles_reads_the_needle_sentence(roomy):
    """LOCOS's own setting: on the ``nonliteral`` probe the needle is the sentence that
    hides the name (``needle_start`` to ``needle_end``), the answer the name; by hand for
    one head, as above."""
    from headmech.classification.definitions import locos_scores, needle_span

    opts = ProbeOptions(n_sequences=2, batch_size=2)
    (batch,) = build_probe("nonliteral", roomy, opts).batches
    lo_all, hi_all = needle_span(batch)
    assert (lo_all == batch.extras["needle_start"]).all() and (
        hi_all == batch.extras["needle_end"]
    ).all()
    got = locos_scores(roomy, batches=[batch], answered_only=False)
    layer, head = 0, 2
    spans = [(int(lo_all[r]), int(hi_all[r])) for r in range(2)]
    mean = float(sum(_locos_by_hand(roomy, batch, layer, head, spans)).detach()) / 2
    assert float(got["score"][layer, head]) == pytest.approx(mean, rel=1e-4, abs=1e-7)
    assert locos_scores(roomy, batches=[batch])["answered"] == 0  # a random model: no name
