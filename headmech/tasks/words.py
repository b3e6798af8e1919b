"""Tasks of the word-level head types: ``word_copying`` and ``relation_tail``.

``word_copying``: copying repeated multi-token words whole (Feucht et al. 2025).

On the ``repeated_words`` probe (:mod:`headmech.probes.words`), the mean next-token loss
over every token of the multi-token words of the second copy, each predicted from the
token before it (the token before the word predicts its first token, and so on): the
whole word's log-probability, spread over its tokens. Concept induction heads, which
attend to the end of the word to be copied, should serve it.

``relation_tail``: on the ``prose`` probe, the next-token loss of each dependency
relation's tail token at the token before it, for the head-before-tail cases of
:mod:`headmech.probes.relations` (Ren et al. 2024's semantic induction heads raise the
tail's logit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headmech.core.registry import TASKS
from headmech.stream.engine import ProbeBatch
from headmech.tasks import Task, TokenLossTask

__all__ = ["select_relation_tail", "select_word_copying"]


def select_word_copying(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    """Queries (the positions whose next token belongs to a repeated multi-token word) and
    the token each should predict."""
    query = batch.extras["copy_query"] == 1  # never the last position: a word follows
    target = batch.input_ids.roll(-1, dims=1)
    return query, target


def select_relation_tail(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    """Queries (the token before each case's tail) and the tail token each should predict."""
    from headmech.probes.relations import RELATIONS, relation_cases

    c = relation_cases(batch, RELATIONS)
    dev = batch.input_ids.device
    query = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    target = torch.zeros_like(batch.input_ids)
    query[c.seq.to(dev), c.query.to(dev)] = True
    target[c.seq.to(dev), c.query.to(dev)] = c.tail.to(dev)
    return query, target


def _relation_tail(model: Any) -> Task:
    return TokenLossTask(
        "relation_tail",
        "prose",
        select_relation_tail,
        "mean loss of dependency tails at the token before them, head word earlier (prose)",
    )


def _word_copying(model: Any) -> Task:
    return TokenLossTask(
        "word_copying",
        "repeated_words",
        select_word_copying,
        "mean loss on the tokens of repeated multi-token words (second copy of a word list)",
    )


TASKS.register(
    "word_copying",
    _word_copying,
    summary="loss on the tokens of repeated multi-token words (decoders)",
)
TASKS.register(
    "relation_tail",
    _relation_tail,
    summary="loss of dependency tails whose head word came earlier, on prose (decoders)",
)
