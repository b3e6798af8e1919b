"""Subject heads: write a fact's answer from the subject's tokens (Chughtai et al. 2024)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.base import SignTestedHead, above_zero, best_heads, unconfirmed
from headmech.models import ModelInfo
from headmech.stream.engine import HeadStats, ProbeBatch


class FactSourceHead(SignTestedHead):
    """What the subject and relation types share: a head's direct logit attribution to a
    fact's answer from one group of the prompt's tokens (:attr:`group`), averaged over the
    facts the model completes, labelled at the threshold when the facts agree (a sign
    test, Benjamini-Hochberg across heads). Not a type itself (no ``name``)."""

    group: ClassVar[str] = "subject"
    probe = "facts"
    causal_only = True
    task = "facts"
    ablation = "mean"
    default_threshold = 0.25  # a quarter of a nat of the answer's logit, from the group alone
    score_range = (-20.0, 20.0)  # nats of one head's direct effect on one logit
    threshold_range = (-20.0, 20.0)

    def check_model(self, info: ModelInfo) -> str | None:
        if not info.linear_readout:
            return (
                f"head type '{self.name}' reads direct logit attribution, which does not "
                "hold here: a norm follows each attention block or the logits are soft-capped"
            )
        return super().check_model(info)

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """From the last token to the group's tokens: where the head reads (the attention
        evidence kept beside the score)."""
        n = batch.input_ids.shape[1]
        end = batch.extras["end_pos"]
        last = torch.arange(n, device=end.device)[None] == end[:, None]  # [batch, pos]
        return last[:, :, None] & batch.extras[self.group][:, None, :]

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        from headmech.interventions.sources import subject_relation_scores

        out = subject_relation_scores(model, batches=list(batches))
        known = torch.full_like(out[self.group], float(out["known"]))
        return {
            "dla": out[self.group],
            "positive": out[f"{self.group}_positive"],
            "known": known,
            "asked": torch.full_like(known, float(out["asked"])),
        }

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.dla").nan_to_num(0.0)

    def significance(self, stats: HeadStats) -> tuple[Tensor, Tensor]:
        """Per head ``[n_layers, n_heads]``: the exact one-sided sign test of the head's
        effect from the group over the known facts against 0 and its Benjamini-Hochberg q
        across every head (:func:`headmech.headtypes.base.above_zero`; p = 1 with no fact
        known)."""
        n = stats.mean(f"{self.name}.known").nan_to_num(0.0)
        return above_zero(stats.mean(f"{self.name}.positive"), n)

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        """Heads at the threshold whose effect the facts do not agree on (the sign test
        does not survive Benjamini-Hochberg)."""
        known = int(stats.mean(f"{self.name}.known").nan_to_num(0.0).max())
        why = (
            f"its effect from the {self.group} is not above 0 in enough of the {known} facts "
            "the model completes"
        )
        return unconfirmed(score, self.threshold, self.significance(stats)[1], self.alpha, why)

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        p, q = self.significance(stats)
        top = best_heads(score, 8)
        mass = stats.mean(f"{self.name}.mass")
        return {
            "dla": {str(h): round(float(score[h]), 4) for h in top},
            "positive": {
                str(h): round(float(stats.mean(f"{self.name}.positive")[h]), 4) for h in top
            },  # fmt: skip
            "attention": {str(h): round(float(mass[h]), 4) for h in top},
            "p": {str(h): float(f"{float(p[h]):.3g}") for h in top},
            "q": {str(h): float(f"{float(q[h]):.3g}") for h in top},
            "known": int(stats.mean(f"{self.name}.known").nan_to_num(0.0).max()),
            "asked": int(stats.mean(f"{self.name}.asked").nan_to_num(0.0).max()),
            "group": self.group,
            "alpha": self.alpha,
        }


class SubjectHead(FactSourceHead):
    """At a fact's last token, the head writes the answer from the subject's tokens.

    Probe: ``facts`` (:mod:`headmech.probes.facts`): "The Eiffel Tower is located in the
    city of" → " Paris", 64 facts a small model may know; the subject ("The Eiffel Tower")
    and the relation ("is located in the city of") are the two groups of tokens.

    Score: Chughtai et al.'s split of direct logit attribution by source
    (:func:`headmech.interventions.sources.direct_effects_by_source`). With the final
    norm's scale frozen, a head's direct effect on the answer's logit (against the
    vocabulary's mean) is a sum over the keys it reads, ``α_j (v_j W_O) · d``; the
    subject's share sums the subject's keys. Averaged over the facts the model completes
    (its top next token is the answer's first): a head cannot be shown to recall what the
    model does not. A model that knows none has no verdict (every score 0).

    Threshold: 0.25 nats from the subject alone (Chughtai et al. rank heads and publish no
    cut; their subject heads in Pythia-2.8B and GPT-J write one nat and more). A head is
    labelled when its score reaches it and the facts agree: the exact sign test of its
    per-fact effect against 0, Benjamini-Hochberg across every head at ``alpha``. Refused
    where DLA does not hold (Gemma 2/3: a norm follows each attention block). Evidence
    kept: the last token's attention to the subject.

    Behaviour: the ``facts`` task, the answer's loss after subject and relation, which
    mean-ablating the heads should raise.

    Args:
        threshold: the effect from the subject needed, in nats (default 0.25).
        alpha: the false discovery rate (default 0.05).

    References:
        Chughtai, Cooney, Nanda 2024, "Summing Up the Facts: Additive Mechanisms Behind
        Factual Recall in LLMs", arXiv:2402.07321 (subject heads).
    """

    name = "subject"
    group = "subject"
    reference = "Chughtai et al. 2024"
    citation = (
        "Chughtai, Cooney, Nanda 2024, Summing Up the Facts: Additive Mechanisms Behind "
        "Factual Recall in LLMs, arXiv:2402.07321"
    )
    description = "writes a fact's answer from the subject's tokens (direct logit attribution)"
    threshold_note = "direct logit attribution to the answer from the subject's tokens at the last position, over the facts the model completes, ≥ 0.25 nats (Chughtai et al. rank heads; no published cut); null: 0, with a sign test over facts and Benjamini-Hochberg across heads"
    claim = (
        "mean-ablating the labelled heads raises the loss of a fact's answer more than as "
        "many random heads (Chughtai et al.: the answer is written from the subject)"
    )
