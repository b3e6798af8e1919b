"""Attention-sink heads: park most attention on the first token."""

from __future__ import annotations

import torch
from torch import Tensor

from headmech.engine import ProbeBatch
from headmech.heads import HeadType


class AttentionSinkHead(HeadType):
    """Most of the head's attention goes to the first token of the sequence.

    Score: mean attention mass on position 0 (BOS/[CLS] or the first word) over real
    queries from position ``min_query_pos`` on (early queries see few keys, so they
    attend to position 0 by necessity, not by role).

    References:
        Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks",
        ICLR 2024; Clark et al. 2019, "What Does BERT Look At?" (attention to [CLS]/[SEP]).
    """

    name = "attention_sink"
    reference = "Xiao et al. 2024"
    citation = (
        "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks, ICLR 2024"
    )
    description = "puts most of its attention on the first token"
    probe = "prose"
    # headmech's choice: the majority of the head's attention
    default_threshold = 0.5
    min_query_pos = 4

    def targets(self, batch: ProbeBatch) -> Tensor:
        pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        ok = ~batch.special & (pos >= self.min_query_pos)
        return torch.zeros_like(batch.input_ids).masked_fill(~ok, -1)
