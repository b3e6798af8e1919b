"""Duplicate-token heads: attend from a token to earlier copies of the same token."""

from __future__ import annotations

from torch import Tensor

from headmech.headtypes.registry import HeadType
from headmech.stream.engine import ProbeBatch


class DuplicateTokenHead(HeadType):
    """Attention from a token goes to earlier occurrences of the same token.

    Probe: repeated random tokens, where every token of the second half has an earlier
    copy. Score: mean attention mass on the earlier copies (all of them), over queries
    that have one; special tokens are neither queries nor targets. This is the
    ``duplicate_token_head`` pattern of TransformerLens' head detector (its "mul" score
    is the streamed ``duplicate_token.rows`` statistic when no special token intervenes).

    References:
        Wang et al. 2022, "Interpretability in the Wild: a Circuit for Indirect Object
        Identification in GPT-2 small"; TransformerLens ``head_detector.py``.
    """

    name = "duplicate_token"
    reference = "Wang et al. 2022"
    citation = (
        "Wang et al. 2022, Interpretability in the Wild: a Circuit for Indirect Object "
        "Identification in GPT-2 small, ICLR 2023; TransformerLens head_detector duplicate_token_head"
    )
    description = "attends from a token to earlier copies of the same token"
    probe = "repeated_random"
    # headmech's choice (the detector has no threshold), as for induction
    default_threshold = 0.4
    threshold_note = "mass ≥ 0.4 on earlier copies of the current token in repeated random sequences (no cut published; Wang et al.'s duplicate heads put most of their attention there); null: uniform attention, 1/position, about 0.02 in the repeated half"
    task = "induction"  # loss on the repeated half of random-token sequences

    def broad_targets(self, batch: ProbeBatch) -> Tensor:
        return self.targets(batch)  # earlier copies of the current token, in any text

    def targets(self, batch: ProbeBatch) -> Tensor:
        ids = batch.input_ids
        # [batch, query_pos, key_pos], built in place: one T x T mask, not four
        same = (ids[:, :, None] == ids[:, None, :]).tril_(-1)  # earlier keys only
        real = ~batch.special
        same &= real[:, :, None]
        same &= real[:, None, :]
        return same
