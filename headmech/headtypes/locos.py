"""LOCOS heads: write the answer toward the logits from the needle (LOCOS, 2026)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.base import SignTestedHead, above_zero, best_heads, unconfirmed
from headmech.stream.engine import HeadStats, ProbeBatch


class LocosHead(SignTestedHead):
    """At the answer step, the head writes the answer's logit from the needle's keys.

    Probe: ``documents`` (:mod:`headmech.probes.documents`), the gold document as the
    needle: five short documents, a question about one of them, the answer begun ("Answer:
    Mary lives in"), whose next token is the gold document's city. LOCOS scores heads on
    non-literal needles (NoLiMa's design); at 135M-0.5B the bundled models answer none of
    those (docs/findings.md, "What the models can do"), so the type reads the documents
    probe, where they do; ``probe="nonliteral"`` reads LOCOS's own setting on a model
    that answers it.

    Score: LOCOS's logit contribution (aryopg/locos, ``locos/detectors/logit_contrib.py``;
    :func:`headmech.interventions.sources.locos_scores`). At the answer step each
    key ``j`` gets ``φ_j = α_j · u_yᵀ W_O v_j``, the head's attention times what its value
    there writes toward the answer's unembedding (no final norm, as the authors' code);
    ``L+`` sums ``φ`` over the needle's keys, ``L-`` over every other key, rescaled to the
    needle's length; the score is ``L+ - L-`` averaged over the questions the model
    answers (its top token is the answer).

    Threshold: 1.0, one logit unit written toward the answer from the needle beyond the
    rest (LOCOS keeps a top share, 50 of Qwen3-8B's 1,152 heads, 4.3%, and publishes no
    cut). A head is labelled when its score reaches it and the questions agree: the exact
    sign test of its per-question ``L+ - L-`` against 0, Benjamini-Hochberg across every
    head at ``alpha``.

    Behaviour: the ``documents`` task, the gold city's loss, which mean-ablating the heads
    should raise (LOCOS mean-ablates its heads; on Qwen3-8B its top 50 take non-literal
    recall from 0.40 to 0.00).

    Args:
        threshold: the logit contribution needed (default 1.0).
        alpha: the false discovery rate (default 0.05).

    References:
        LOCOS, arXiv:2607.01002, 2026 (code: aryopg/locos, ``locos/detectors/logit_contrib.py``).
        Modarressi et al. 2025, "NoLiMa: Long-Context Evaluation Beyond Literal Matching",
        ICML 2025 (the non-literal needles).
    """

    name = "locos"
    reference = "LOCOS 2026"
    citation = (
        "LOCOS, arXiv:2607.01002, 2026 (code aryopg/locos: logit contribution of non-literal "
        "retrieval heads); Modarressi et al. 2025, NoLiMa: Long-Context Evaluation Beyond "
        "Literal Matching, ICML 2025"
    )
    description = "writes the answer's logit from the needle (the gold document) at the answer step"
    probe = "documents"
    default_threshold = 1.0
    threshold_note = "LOCOS's logit contribution: attention times what the value writes toward the answer's unembedding, summed over the needle minus the rest rescaled to its length, over the questions the model answers, ≥ 1.0 (LOCOS keeps a top 4.3%; no published cut); null: 0, with a sign test over questions and Benjamini-Hochberg across heads"
    causal_only = True
    task = "documents"
    ablation = "mean"
    claim = (
        "mean-ablating the labelled heads raises the loss of the gold document's city more "
        "than as many random heads (LOCOS: mean ablation of the top heads removes recall)"
    )
    score_range = (-1000.0, 1000.0)  # logit units, without the final norm
    threshold_range = (-1000.0, 1000.0)

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """From the answer step to the needle (the gold document): where the head reads
        (the attention evidence kept beside the score)."""
        from headmech.interventions.sources import needle_span

        n = batch.input_ids.shape[1]
        end = batch.extras["end_pos"]
        lo, hi = needle_span(batch)
        pos = torch.arange(n, device=end.device)
        last = pos[None] == end[:, None]  # [batch, pos]
        needle = (pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])
        return last[:, :, None] & needle[:, None, :]

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        from headmech.interventions.sources import locos_scores

        out = locos_scores(model, batches=list(batches))
        answered = torch.full_like(out["score"], float(out["answered"]))
        return {
            "contribution": out["score"],
            "L_plus": out["L_plus"],
            "L_minus": out["L_minus"],
            "positive": out["positive"],
            "answered": answered,
            "asked": torch.full_like(answered, float(out["asked"])),
        }

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.contribution").nan_to_num(0.0)

    def significance(self, stats: HeadStats) -> tuple[Tensor, Tensor]:
        """Per head ``[n_layers, n_heads]``: the exact one-sided sign test of the
        per-question ``L+ - L-`` over the answered questions against 0 and its
        Benjamini-Hochberg q across every head (:func:`headmech.headtypes.base.above_zero`)."""
        n = stats.mean(f"{self.name}.answered").nan_to_num(0.0)
        return above_zero(stats.mean(f"{self.name}.positive"), n)

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        """Heads at the threshold whose questions do not agree (the sign test does not
        survive Benjamini-Hochberg)."""
        n = int(stats.mean(f"{self.name}.answered").nan_to_num(0.0).max())
        why = f"its contribution over the {n} questions the model answers is not above 0 beyond chance"  # fmt: skip
        return unconfirmed(score, self.threshold, self.significance(stats)[1], self.alpha, why)

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        top = best_heads(score, 16)
        return {
            "contribution": {str(h): round(float(score[h]), 4) for h in top},
            "L_plus": self.top_values(stats, "L_plus", top),
            "L_minus": self.top_values(stats, "L_minus", top),
            "positive": self.top_values(stats, "positive", top),
            "attention": self.top_values(stats, "mass", top),
            **self.top_tests(stats, top),
            "answered": int(stats.mean(f"{self.name}.answered").nan_to_num(0.0).max()),
            "asked": int(stats.mean(f"{self.name}.asked").nan_to_num(0.0).max()),
            "alpha": self.alpha,
        }
