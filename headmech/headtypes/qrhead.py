"""Query-focused retrieval heads: the question's attention to the document that answers it (Zhang et al. 2025)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.base import SignTestedHead, above_zero, best_heads, unconfirmed
from headmech.probes.documents import query_to_gold
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer


class QRHead(SignTestedHead):
    """The question's tokens attend to the gold document, beyond what any question would.

    Probe: ``query_documents`` (:mod:`headmech.probes.documents`): five short documents,
    each a fact about a different person ("Mary lives in Lisbon."), then "Question: Where
    does Mary live?"; the gold document is the one that answers it and moves through the
    positions. Each prompt is run twice in the same batch: with its question and, as the
    authors calibrate, with the question replaced by "N/A" (its null twin).

    Score: QRHead's retrieval score as the authors' detection computes it
    (princeton-pli/QRHead, ``attn_retriever.py``, ``score_docs_per_head_for_detection``).
    For each key, the head's attention averaged over the question's tokens, minus the same
    from the null query (:func:`calibrated_gold`); on the gold document the calibrated
    token scores at or below their mean minus two standard deviations are dropped (a
    document whose calibrated scores are all equal has no outlier: the authors' code would
    drop them all) and the rest summed; averaged over the questions. A head that reads the
    documents the same whatever is asked scores 0.

    Threshold: 0.10, ten points of the question's attention moved onto the gold document
    by what the question asks (the paper keeps the top 16 of Llama-3.1-8B's 1,024 heads and
    publishes no cut). A head is labelled when its score reaches it and its questions
    agree: the exact sign test of the per-question scores against 0 (as many negative as
    positive under the null), Benjamini-Hochberg across every head at ``alpha``. Evidence
    kept: the uncalibrated mass on the gold document, the null query's, and the share of
    questions scored above 0.

    Behaviour: the ``documents`` task, the gold city's loss at the end of the prompt
    (multi-document recall), which mean-ablating the heads should raise. QRHead itself is
    evaluated as a re-ranker, not by ablation; mean ablation is LOCOS's, as in the
    agreement matrix of retrieval definitions (:mod:`headmech.compare`).

    Args:
        threshold: the calibrated score needed (default 0.10).
        alpha: the false discovery rate (default 0.05).

    References:
        Zhang, Yin, Yen, Chen, Ye 2025, "Query-Focused Retrieval Heads Improve Long-Context
        Reasoning and Re-ranking", EMNLP 2025, arXiv:2506.09944 (code: princeton-pli/QRHead).
    """

    name = "qrhead"
    reference = "Zhang et al. 2025"
    citation = (
        "Zhang, Yin, Yen, Chen, Ye 2025, Query-Focused Retrieval Heads Improve Long-Context "
        "Reasoning and Re-ranking, EMNLP 2025, arXiv:2506.09944"
    )
    description = "its attention from the question goes to the document that answers it"
    probe = "query_documents"
    default_threshold = 0.10
    threshold_note = "the question's attention to the gold document minus a null ('N/A') question's, outlying tokens dropped (the authors' calibrated score) ≥ 0.10; null: 0, a head that reads the documents whatever is asked, with a sign test over the questions and Benjamini-Hochberg across heads"
    causal_only = True
    task = "documents"
    ablation = "mean"
    claim = (
        "mean-ablating the labelled heads raises the loss of the gold document's city after "
        "five documents more than as many random heads"
    )
    score_range = (-1.0, 1.0)  # a difference of attention shares

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Bool[Tensor, "batch query_pos key_pos"]:
        """From the question's tokens to the gold document's, on the questions (not their
        null twins)."""
        return query_to_gold(batch) & ~batch.extras["null"][:, None, None]

    def _reduce(
        self,
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
        batch: ProbeBatch,
        prepared: Any,
        layer: int,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        dev = pattern.device
        e = {k: v.to(dev) if isinstance(v, Tensor) else v for k, v in batch.extras.items()}
        null = e["null"]
        if pattern.shape[0] % 2 or not bool(null[1::2].all()) or bool(null[0::2].any()):
            raise ValueError(
                "a query_documents batch must interleave each question with its null twin "
                "(headmech.probes.documents.with_null_twins)"
            )
        pos = torch.arange(pattern.shape[-1], device=dev)
        asks = ((pos >= e["query_start"][:, None]) & (pos < e["query_end"][:, None])).float()
        weights = asks / asks.sum(1, keepdim=True)  # [batch, query_pos]
        read = torch.einsum("bhqk,bq->bhk", pattern.float(), weights)  # [batch, head, key]
        rows = torch.arange(pattern.shape[0], device=dev)[0::2]
        gold = e["gold"][rows]
        lo, hi = e["doc_start"][rows, gold], e["doc_end"][rows, gold]
        on_gold = (pos >= lo[:, None]) & (pos < hi[:, None])  # [n, key]
        real, base = read[0::2].double(), read[1::2].double()
        score = calibrated_gold(real, base, on_gold)  # [n, head]
        twice = torch.zeros(pattern.shape[0], pattern.shape[1], dtype=torch.float64, device=dev)
        weight = (~null).double()

        def per_row(values: Tensor) -> tuple[Tensor, Tensor]:
            out = twice.clone()
            out[0::2] = values
            return out, weight

        g = on_gold[:, None].double()
        return {
            "score": per_row(score),
            "positive": per_row((score > 0).double()),
            "mass": per_row((real * g).sum(-1)),
            "null_mass": per_row((base * g).sum(-1)),
        }

    def reducers(self) -> list[Reducer]:
        return [Reducer(self.name, self._reduce)]

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.score").nan_to_num(0.0)

    def significance(self, stats: HeadStats) -> tuple[Tensor, Tensor]:
        """Per head ``[n_layers, n_heads]``: the exact one-sided sign test of the
        per-question scores against 0 (p = P(Bin(n, 1/2) >= questions scored above 0)) and
        its Benjamini-Hochberg q across every head (:func:`headmech.headtypes.base.above_zero`)."""
        positive = f"{self.name}.positive"
        return above_zero(stats.mean(positive), stats.counts[positive])

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        """Heads at the threshold whose questions do not agree: the sign test's gain does
        not survive Benjamini-Hochberg."""
        n = int(stats.counts[f"{self.name}.positive"].max())
        why = f"its {n} questions' calibrated scores are not above 0 beyond chance"
        return unconfirmed(score, self.threshold, self.significance(stats)[1], self.alpha, why)

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        p, q = self.significance(stats)
        top = best_heads(score, 16)

        def per_head(values: Tensor, digits: int = 4) -> dict[str, float]:
            return {str(h): round(float(values[h]), digits) for h in top}

        return {
            "top_16": [str(h) for h in top],  # the paper's set at its own size
            "score": per_head(score),
            "mass": per_head(stats.mean(f"{self.name}.mass")),
            "null_mass": per_head(stats.mean(f"{self.name}.null_mass")),
            "positive": per_head(stats.mean(f"{self.name}.positive")),
            "p": {str(h): float(f"{float(p[h]):.3g}") for h in top},
            "q": {str(h): float(f"{float(q[h]):.3g}") for h in top},
            "questions": int(stats.counts[f"{self.name}.positive"].max()),
            "alpha": self.alpha,
        }


def calibrated_gold(
    real: Float[Tensor, "n ... key"],
    null: Float[Tensor, "n ... key"],
    gold: Bool[Tensor, "n key"],
) -> Float[Tensor, "n ..."]:
    """QRHead's per-question score: on the gold document's keys (``gold``), each key's
    attention from the question (``real``, averaged over its tokens) minus the null
    query's (``null``); the calibrated scores at or below their mean minus two (unbiased)
    standard deviations are dropped, unless all are equal, and the rest summed."""
    g = gold.reshape(gold.shape[0], *([1] * (real.dim() - 2)), gold.shape[-1]).to(real.dtype)
    cal = (real - null) * g
    n = g.sum(-1, keepdim=True)
    mean = cal.sum(-1, keepdim=True) / n
    std = (((cal - mean) * g).pow(2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    keep = (cal > mean - 2 * std) | (std == 0)
    return (cal * keep * g).sum(-1)
