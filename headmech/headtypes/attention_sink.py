"""Attention-sink heads: park attention on the first token."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch


class AttentionSinkHead(HeadType):
    """The head parks a large share of its attention on the first token of the sequence.

    Score: mean attention mass on position 0 (BOS/[CLS] or the first word) over the real,
    non-special queries that can see it (from position ``min_query_pos`` = 1 on) — the
    per-head attention score to the first token that Xiao et al. plot and Gu et al.
    threshold (their code, sail-sg/Attention-Sink, averages over every query).

    Threshold: Gu et al.'s ε = 0.3 (their sink metric counts a head as having the sink when
    its mean attention score to the first token exceeds 0.3). This labels most heads of
    decoder LMs — 219 of SmolLM2-135M's 270 (81%), none in layers 0, 1, 10 and 11 — and 47
    of MiniLM's 72: that is the literature's finding, not a loose threshold. Gu et al.
    report sink ratios of this size for every LM they trained or tested, and Xiao et al.
    found the first token receives a large share of attention in all layers but the first
    two. A type that labels most heads is defined sensibly here because being a sink is
    the default state of an attention head; the evidence that sets heads apart is the
    sink share itself (``details["sink_ratio"]``, the fraction of heads at or above ε, and
    the per-head scores). A stricter bar would not match either paper (0.5, this type's
    earlier choice, labelled 150 heads and had no source).

    Validation: no random set of as many heads that are not sinks exists in an LM, so the
    claim tested is Xiao et al.'s: the model relies on the attention its heads park on the
    first token, the more so the higher their sink score. Head sets drawn within
    quantile bins of the score have the first position removed from their attention
    (renormalised), and the rank correlation of a set's score with the loss this costs
    is tested by permutation (:mod:`headmech.classification.sinks`); a bridge that
    ignores attention-pattern edits (BERT's) makes it untestable there.

    References:
        Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks",
        ICLR 2024; Gu et al. 2025, "When Attention Sink Emerges in Language Models: An
        Empirical View", ICLR 2025 (arXiv:2410.10781; sink metric with ε = 0.3); Clark et
        al. 2019, "What Does BERT Look At?" (attention to [CLS]/[SEP]).
    """

    name = "attention_sink"
    reference = "Xiao et al. 2024"
    citation = (
        "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks, ICLR 2024"
    )
    description = "parks a large share of its attention on the first token"
    probe = "prose"
    default_threshold = 0.3  # Gu et al.'s ε (see the docstring)
    threshold_note = "mean attention on the first token ≥ 0.3: Gu et al.'s ε; the null is uniform attention, 1/(position+1), under 0.1 past the tenth token"
    min_query_pos = 1  # every query but the first token (Gu et al.: all queries that see key 0)
    # no equal-sized set of non-sinks exists: a dose-response over sink-score bins
    claims = ("sink_dose",)

    broad_on_first = True

    def broad_targets(self, batch: ProbeBatch) -> Tensor:
        return self.targets(batch)  # the first position, in any text

    def targets(self, batch: ProbeBatch) -> Tensor:
        pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        ok = ~batch.special & (pos >= self.min_query_pos)
        return torch.zeros_like(batch.input_ids).masked_fill(~ok, -1)

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        finite = score[~torch.isnan(score)]
        by_layer = [round(float(v), 4) for v in torch.nan_to_num(score).mean(1)]
        return {
            "sink_ratio": round(len(heads) / max(int(finite.numel()), 1), 4),
            "mean_first_token_mass_by_layer": by_layer,
            "min_query_pos": self.min_query_pos,
        }
