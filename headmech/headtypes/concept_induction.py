"""Concept induction heads: copy a whole multi-token word by attending to its last token."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer, target_reducer


class ConceptInductionHead(HeadType):
    """Induction over words, not tokens (Feucht et al. 2025).

    Probe: ``repeated_words`` (:mod:`headmech.probes.words`): BOS + a list of corpus
    words, about half of them several tokens long, + the same list again. At the token
    just before a multi-token word of the second copy, a token-level induction head
    attends to the token after the earlier occurrence of the current token — the *first*
    token of the word's first occurrence — while a concept induction head attends to the
    *last* token of that word's first occurrence, where the whole word is represented
    ("concept induction heads learn to attend to the ends of multi-token words").

    Score: mean attention mass on the concept target (the last token of the earlier
    occurrence of the word about to be copied) over those queries. A head is labelled
    when it reaches ``threshold`` *and* puts more mass there than on the token-level
    target at the same queries (which sets it apart from token induction heads, reported
    beside it in ``details["token_induction"]``).

    Threshold: 0.4, the catalog's induction bar (prefix-matching mass) applied to the
    concept target; Feucht et al. rank heads by a causal concept copying score and
    publish no attention cut.

    Behavioural metric: the ``word_copying`` task, mean next-token loss on the tokens of
    the repeated multi-token words (the whole word's copy), which zero-ablating the
    labelled heads should raise more than as many random heads.

    References:
        Feucht, Todd, Wallace, Bau 2025, "The Dual-Route Model of Induction",
        arXiv:2504.03022 (COLM 2025; dualroute.baulab.info).
    """

    name = "concept_induction"
    reference = "Feucht et al. 2025"
    citation = (
        "Feucht, Todd, Wallace, Bau 2025, The Dual-Route Model of Induction, arXiv:2504.03022"
    )
    description = "attends to the last token of an earlier multi-token word about to be copied"
    probe = "repeated_words"
    default_threshold = 0.4
    threshold_note = "mass ≥ 0.4 on the last token of the earlier copy of a multi-token word (the induction bar applied to the concept target), above the head's mass on the token-level induction target; null: uniform attention over the prefix (about 0.02 at the probe's lengths)"
    causal_only = True
    task = "word_copying"
    claim = (
        "zero-ablating the labelled heads raises the loss of copying repeated multi-token "
        "words more than as many random heads (Feucht et al. ablate concept heads and "
        "measure word-level copying)"
    )

    def targets(self, batch: ProbeBatch) -> Tensor:
        return batch.extras["concept_target"].masked_fill(batch.special, -1)

    def token_targets(self, batch: ProbeBatch) -> Tensor:
        """The token-level induction target at the same queries."""
        return batch.extras["token_target"].masked_fill(batch.special, -1)

    def reducers(self) -> list[Reducer]:
        return [
            target_reducer(self.name, self.targets),
            target_reducer(f"{self.name}.token", self.token_targets, hits=False),
        ]

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        token = stats.mean(f"{self.name}.token.mass")
        return {
            HeadIndex(a, b): f"concept mass {float(score[a, b]):.2f} <= token-induction mass "
            f"{float(token[a, b]):.2f} (Feucht et al.: a token induction head, not a concept one)"
            for a, b in (~(score > token)).nonzero().tolist()
        }

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        token = stats.mean(f"{self.name}.token.mass")
        hit = stats.mean(f"{self.name}.hit")
        tok = torch.nan_to_num(token, nan=float("-inf"))
        idx = ((tok >= self.threshold) & (tok > torch.nan_to_num(score))).nonzero().tolist()
        token_heads = sorted((HeadIndex(a, b) for a, b in idx), key=lambda h: -float(tok[h]))
        return {
            "concept_mass": {str(h): round(float(score[h]), 4) for h in heads},
            "token_mass": {str(h): round(float(token[h]), 4) for h in heads},
            "argmax_hit_rate": {str(h): round(float(hit[h]), 4) for h in heads},
            "token_induction": {
                str(h): {
                    "token_mass": round(float(token[h]), 4),
                    "concept_mass": round(float(score[h]), 4),
                }
                for h in token_heads
            },
        }
