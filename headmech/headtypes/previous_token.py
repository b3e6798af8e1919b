"""Previous-token heads: attend from each token to the one right before it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch


class PreviousTokenHead(HeadType):
    """Attention from position i goes to position i-1.

    Score: mean attention mass on the previous token over real query tokens whose previous
    token is also real (special tokens and padding are neither queries nor targets). The
    head's argmax hit rate on i-1 is kept as evidence. This is the ``previous_token_head``
    pattern of TransformerLens' head detector; ``<name>.rows`` reproduces its "mul" score.

    Behavioural metric (Olsson et al.): previous-token heads matter through the induction
    heads whose keys they feed (K-composition). Validation ablates them on the induction
    task (loss on the repeated half of random-token sequences), and patches their writes
    from a run with fresh first halves into the induction heads' keys only (path
    patching), each against the control sets. On an encoder (no induction task) the
    ``lm`` task stands in.

    References:
        Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits";
        Olsson et al. 2022, "In-context Learning and Induction Heads";
        TransformerLens ``head_detector.py`` (``previous_token_head``).
    """

    name = "previous_token"
    reference = "Olsson et al. 2022"
    citation = (
        "Olsson et al. 2022, In-context Learning and Induction Heads, Transformer Circuits Thread; "
        "TransformerLens head_detector previous_token_head"
    )
    description = "attends from each token to the token right before it"
    probe = "prose"
    # headmech's choice (the detector has no threshold): the majority of the head's attention.
    default_threshold = 0.5
    threshold_note = "mass ≥ 0.5 on the previous token (no cut published; a majority of the head's attention); null: uniform attention over a sentence's prefix, about 0.05 at 20 tokens"
    task = "induction"
    # primary: their role in the paper that defines them, feeding induction heads' keys
    claims = ("k_composition", "ablation")
    circuit = ("induction",)  # Olsson et al.'s induction circuit: the two roles together
    claim = (
        "Olsson et al.: ablating the heads hurts induction (repeated-half loss) more than "
        "ablating as many random heads"
    )

    def broad_targets(self, batch: ProbeBatch) -> Tensor:
        return self.targets(batch)  # the previous token, in any text

    def targets(self, batch: ProbeBatch) -> Tensor:
        pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        prev = (pos - 1).expand_as(batch.input_ids).clone()  # [batch, query_pos]
        ok = ~batch.special & (pos > 0)
        ok[:, 1:] &= ~batch.special[:, :-1]
        return prev.masked_fill(~ok, -1)

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        hit = stats.mean(f"{self.name}.hit")
        return {
            "argmax_hit_rate": {str(h): round(float(hit[h]), 4) for h in heads},
            "n_queries": int(stats.counts[f"{self.name}.mass"][0, 0]),
        }
