"""CRI heads: restoring the head alone brings back the answer the removed document gave (LOCOS's causal retrieval importance)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.core.placement import model_device
from headmech.headtypes.base import (
    SignTestedHead,
    above_zero,
    best_heads,
    first_examples,
    unconfirmed,
)
from headmech.stream.engine import HeadStats, ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.tasks import LogitDiffTask


def _answer_step(batch: ProbeBatch) -> Tensor:
    """``Bool[batch, pos]``: the answer step (the prompt's last token) of each question."""
    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
    query = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    query[rows, batch.extras["end_pos"].to(query.device)] = True
    return query


def _contrast(batch: ProbeBatch) -> tuple[Tensor, Tensor, Tensor]:
    """At the answer step, the answer against the removed run's favourite other token."""
    query = _answer_step(batch)
    good, bad = torch.zeros_like(batch.input_ids), torch.zeros_like(batch.input_ids)
    good[query] = batch.extras["answer"].to(good.device)
    bad[query] = batch.extras["counterfactual"].to(bad.device)
    return query, good, bad


def remove_needle(batch: ProbeBatch, model: Any, seed: int = 0) -> ProbeBatch:
    """The authors' ``remove`` corruption: each question's needle (the gold document,
    :func:`headmech.interventions.sources.needle_span`) overwritten by the filler period
    token, length kept, and ``extras["counterfactual"]``: the token the removed run ranks
    first at the answer step, the answer left out (the authors' counterfactual, fixed for
    every patched run). ``seed`` is not used: the corruption draws nothing."""
    from headmech.interventions.sources import needle_span
    from headmech.models.unembedding import unembed
    from headmech.stream.engine import run_blocks

    (filler,) = model.tokenizer.encode(".", add_special_tokens=False)
    lo, hi = needle_span(batch)
    pos = torch.arange(batch.input_ids.shape[1])
    needle = (pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])
    ids = batch.input_ids.masked_fill(needle, filler)
    removed = replace(batch, input_ids=ids)
    dev = model_device(model)
    query = _answer_step(removed)
    with torch.no_grad():
        resid = run_blocks(model, ids.to(dev), batch.attention_mask.to(dev), rows=query.to(dev))
        logits = unembed(model, resid[query.to(dev)]).float()  # [batch, d_vocab]
    rows = torch.arange(len(logits), device=logits.device)
    logits[rows, batch.extras["answer"].to(logits.device)] = float("-inf")
    return replace(removed, extras={**batch.extras, "counterfactual": logits.argmax(-1).cpu()})


def cri_task() -> LogitDiffTask:
    """The authors' metric as a loss: at the answer step the counterfactual's logit minus
    the answer's, on the ``documents`` probe, corrupted by :func:`remove_needle`."""
    from headmech.tasks import LogitDiffTask

    return LogitDiffTask(
        "cri", "documents", _contrast,
        "logit of the removed run's top other token minus the gold city's, at the answer step",
        corrupt=remove_needle,
    )  # fmt: skip


N_EXACT = 24
"""Heads CRI patches exactly by default: the first by its first-order estimate."""


def cri_estimates(
    model: TransformerBridge,
    clean: Sequence[ProbeBatch],
    removed: Sequence[ProbeBatch],
    clean_z: Sequence[Tensor] | None = None,
) -> Tensor:
    """``[questions, n_layers, n_heads]``: each head's CRI to first order (attribution
    patching, Syed et al. 2023): ``(z_clean - z_removed) · ∂(answer - counterfactual
    logit)/∂z`` in the removed run, one forward and backward pass a batch (``clean_z``:
    each clean batch's head outputs, captured already)."""
    from headmech.interventions import capture_z, gradients

    task, out = cri_task(), []
    for i, (c, r) in enumerate(zip(clean, removed, strict=True)):
        # [n_layers, batch, pos, n_heads, d_head]
        z_src = capture_z(model, c) if clean_z is None else clean_z[i]
        z, grad, _, _ = gradients(model, task, r)
        # the task is a loss (counterfactual minus answer): the gain is minus its change
        out.append(-((z_src - z.detach()) * grad).sum((-1, 2)).permute(1, 0, 2).double().cpu())
    return torch.cat(out)


def cri_scores(
    model: TransformerBridge, batches: Sequence[ProbeBatch], n_exact: int | None = N_EXACT
) -> dict[str, Tensor]:
    """LOCOS's causal retrieval importance of every head (aryopg/locos,
    ``locos/detectors/cri.py``, its default metric): per question, the answer's first-token
    logit difference against the counterfactual (:func:`remove_needle`) in the run with the
    needle removed and the head's output patched from the clean run, minus the same
    without the patch; averaged over every question (the authors average over all their
    examples).

    The authors patch every head (a pass per head and question); here the ``n_exact``
    heads of highest first-order estimate (:func:`cri_estimates`) are patched exactly and
    the rest keep the estimate (``None``: every head exactly, the authors' loop). The
    patched runs are batched by :func:`headmech.interventions.run_variants` (each from the
    patched layer on).

    Returns ``{"cri", "positive"}`` grids ``[n_layers, n_heads]`` (the mean and the share
    of questions above 0), ``"estimate"`` (the first-order mean), ``"exact"`` (1 where
    patched), ``"removed"`` (the removed run's mean answer-minus-counterfactual logit
    difference, a grid of one value) and ``"questions"``."""
    from headmech.core.head_index import top_k
    from headmech.interventions import Intervention, Patch, capture_z, run_variants

    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    task = cri_task()
    clean = list(batches)
    removed = [task.corrupt(b, model, 0) for b in clean]
    clean_z = [capture_z(model, c) for c in clean]  # every head's clean output, once
    estimate = cri_estimates(model, clean, removed, clean_z)  # [questions, n_layers, n_heads]
    every = [(la, h) for la in range(n_layers) for h in range(n_heads)]
    heads = every if n_exact is None else [(h.layer, h.head) for h in top_k(estimate.mean(0), n_exact)]  # fmt: skip

    def variants(bi: int, batch: ProbeBatch) -> list[list[Intervention]]:
        patch = Patch(clean_z[bi])
        return [[Intervention.on([h], patch)] for h in heads]

    _, base, sums, counts = run_variants(model, task, removed, variants, per_unit=True)
    gain = estimate.clone()
    exact = (sums[0] - sums[1:]).T.double() / counts[0].double()[:, None]  # [questions, heads]
    rows, cols = torch.tensor([h[0] for h in heads]), torch.tensor([h[1] for h in heads])
    gain[:, rows, cols] = exact
    patched = torch.zeros(n_layers, n_heads)
    patched[rows, cols] = 1.0
    score = gain.mean(0).float()
    return {
        "cri": score,
        "positive": (gain > 0).double().mean(0).float(),
        "estimate": estimate.mean(0).float(),
        "exact": patched,
        "removed": torch.full_like(score, -float(base)),
        "questions": torch.full_like(score, float(gain.shape[0])),
    }


class CRIHead(SignTestedHead):
    """Patched alone from the clean run into one without the needle, the head brings the
    answer back.

    Probe: ``documents`` (:mod:`headmech.probes.documents`), the gold document as the
    needle: five short documents, a question about one of them, the answer begun ("Answer:
    Mary lives in"), whose next token is the gold document's city. The authors score
    needles in a haystack (NIAH, NoLiMa); the bundled models answer the documents probe.

    Score: causal retrieval importance as LOCOS ships it (aryopg/locos,
    ``locos/detectors/cri.py``; :func:`cri_scores`). The needle is removed (its tokens
    overwritten by periods, length kept: the ``remove`` corruption); the counterfactual is
    the token the removed run ranks first at the answer step, the answer left out. A
    head's CRI is the answer's logit minus the counterfactual's in the removed run with
    the head's output patched from the clean run, minus the same unpatched (the authors'
    default ``first_token_logit_diff``), averaged over every question. The authors patch
    every head; the type patches the ``n_exact`` heads its first-order estimate ranks
    highest (attribution patching, one backward pass a batch) and keeps the estimate for
    the rest, which cannot be labelled on it (:func:`cri_scores`).

    Threshold: 1.0, one logit of the answer's lead restored by the head alone (LOCOS
    ranks heads by CRI and publishes no cut; the same unit and cut as the ``locos``
    type's). A head is labelled when its score reaches it and the questions agree: the
    exact sign test of its per-question CRI against 0, Benjamini-Hochberg across every
    head at ``alpha``.

    Behaviour: the ``documents`` task, the gold city's loss, which mean-ablating the heads
    should raise (LOCOS mean-ablates the heads its detectors rank).

    Args:
        threshold: the logit difference restored (default 1.0).
        alpha: the false discovery rate (default 0.05).
        max_questions: score on the probe's first questions only (default: all): a patched
            pass per head and question (the authors' estimate: heads + 2 passes an example).
        n_exact: heads patched exactly, the first by the estimate (default 24; None: every
            head, the authors' loop).

    References:
        LOCOS, arXiv:2607.01002, 2026 (code: aryopg/locos, ``locos/detectors/cri.py``:
        its baseline detector of retrieval heads).
    """

    name = "cri"
    reference = "LOCOS 2026 (CRI)"
    citation = (
        "LOCOS, arXiv:2607.01002, 2026 (code aryopg/locos, locos/detectors/cri.py: causal "
        "retrieval importance, activation patching of each head into a run without the needle)"
    )
    description = "patched alone into a run without the needle, it restores the answer"
    probe = "documents"
    default_threshold = 1.0
    threshold_note = "LOCOS's causal retrieval importance: the answer's first-token logit lead over the removed run's favourite, with the head patched from the clean run into the run without the needle, minus unpatched, over every question, ≥ 1.0 (no published cut); null: 0, with a sign test over questions and Benjamini-Hochberg across heads"
    causal_only = True
    task = "documents"
    ablation = "mean"
    claim = (
        "mean-ablating the labelled heads raises the loss of the gold document's city more "
        "than as many random heads (the heads that restore the answer are needed for it)"
    )
    score_range = (-1000.0, 1000.0)  # logit differences
    threshold_range = (-1000.0, 1000.0)

    def __init__(
        self,
        threshold: float | None = None,
        alpha: float = 0.05,
        max_questions: int | None = None,
        n_exact: int | None = N_EXACT,
        *,
        probe: str | None = None,
    ) -> None:
        super().__init__(threshold, alpha, probe=probe)
        self.max_questions = None if max_questions is None else int(max_questions)
        self.n_exact = None if n_exact is None else int(n_exact)

    def __repr__(self) -> str:
        bound = "" if self.max_questions is None else f", max_questions={self.max_questions}"
        return (
            f"{type(self).__name__}(threshold={self.threshold}, alpha={self.alpha}{bound}, "
            f"n_exact={self.n_exact})"
        )

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """From the answer step to the needle (the gold document): where the head reads
        (the attention evidence kept beside the score)."""
        from headmech.interventions.sources import needle_span

        lo, hi = needle_span(batch)
        pos = torch.arange(batch.input_ids.shape[1], device=lo.device)
        needle = (pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])
        return _answer_step(batch)[:, :, None] & needle[:, None, :]

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        if self.max_questions is not None:
            batches = first_examples(batches, self.max_questions)
        return cri_scores(model, batches, self.n_exact)

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.cri").nan_to_num(0.0)

    def significance(self, stats: HeadStats) -> tuple[Tensor, Tensor]:
        """Per head ``[n_layers, n_heads]``: the exact one-sided sign test of the
        per-question CRI against 0 and its Benjamini-Hochberg q across every head
        (:func:`headmech.headtypes.base.above_zero`)."""
        n = stats.mean(f"{self.name}.questions").nan_to_num(0.0)
        return above_zero(stats.mean(f"{self.name}.positive"), n)

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        """Heads at the threshold whose questions do not agree (the sign test does not
        survive Benjamini-Hochberg), and those only estimated (not patched exactly)."""
        n = int(stats.mean(f"{self.name}.questions").nan_to_num(0.0).max())
        why = f"the answer it restores over the {n} questions is not above 0 beyond chance"
        out = unconfirmed(score, self.threshold, self.significance(stats)[1], self.alpha, why)
        exact = stats.mean(f"{self.name}.exact").nan_to_num(0.0) > 0
        for la, h in ((score >= self.threshold) & ~exact).nonzero().tolist():
            out[HeadIndex(la, h)] = (
                f"only estimated to first order ({float(score[la, h]):.3g}): not among the "
                f"{self.n_exact} heads patched exactly (raise n_exact)"
            )
        return out

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        top = best_heads(score, 16)
        return {
            "cri": {str(h): round(float(score[h]), 4) for h in top},
            "estimate": self.top_values(stats, "estimate", top),
            "positive": self.top_values(stats, "positive", top),
            "attention": self.top_values(stats, "mass", top),
            **self.top_tests(stats, top),
            "removed": round(float(stats.mean(f"{self.name}.removed").nan_to_num(0.0).max()), 4),
            "questions": int(stats.mean(f"{self.name}.questions").nan_to_num(0.0).max()),
            "patched": int(stats.mean(f"{self.name}.exact").nan_to_num(0.0).sum()),
            "alpha": self.alpha,
        }
