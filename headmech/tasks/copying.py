"""The ``copy_suppression`` task's data: where the clean model would copy, and what.

``copy_suppression`` scores, on prose, the positions where the clean model's top
prediction is a token already in the context (up to and including the current one): that
token's log-probability (McDougall et al. 2023: copy suppression lowers it; ablating the
heads raises it). Higher is worse: the naive copy the heads should have suppressed.

Importing this module registers it in :data:`headmech.core.registry.TASKS`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from headmech.core.placement import model_device
from headmech.core.registry import TASKS
from headmech.models.unembedding import unembed
from headmech.stream.engine import ProbeBatch, run_blocks
from headmech.tasks import Task, TokenLossTask, corrupt_prose
from headmech.tasks.data import select_lm

__all__ = ["CopyTask", "copy_candidates"]


ROW_CHUNK = 256  # rows of full-vocabulary logits at a time (Gemma 3: 262k columns)


def copy_candidates(
    model: Any, batch: ProbeBatch
) -> tuple[Bool[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """Where the clean model's top next-token prediction is a token already in the context
    (an ordinary token at or before the position), and that token: the copy a
    copy-suppression head acts against (McDougall et al. 2023)."""
    dev = model_device(model)
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    query, _ = select_lm(batch.to(dev))
    with torch.no_grad():
        resid = run_blocks(model, ids, mask, rows=query)[query]
        top = torch.cat([unembed(model, r).argmax(-1) for r in resid.split(ROW_CHUNK)])
    pred = torch.zeros_like(ids)
    pred[query] = top
    seen = (ids[:, None, :] == pred[:, :, None]) & ~batch.special.to(dev)[:, None, :]
    seen &= torch.ones_like(seen[0]).tril()[None]  # key position <= query position
    return query & seen.any(-1), pred


class CopyTask(TokenLossTask):
    """The ``copy_suppression`` task: the log-probability of the in-context token the clean
    model predicts, at the positions where it predicts one (:func:`copy_candidates`,
    computed once per batch with no intervention and kept in the batch's extras)."""

    def __init__(self) -> None:
        super().__init__(
            "copy_suppression",
            "prose",
            lambda b: (b.extras["copy_query"], b.extras["copy_target"]),
            "log-probability of the in-context token the clean model predicts, where its top "
            "prediction is already in the context (prose probe)",
            corrupt_prose,
        )

    def batches(self, model, options):
        out = []
        for batch in super().batches(model, options):
            query, target = copy_candidates(model, batch)
            extras = {**batch.extras, "copy_query": query.cpu(), "copy_target": target.cpu()}
            out.append(replace(batch, extras=extras))
        return out

    def metric(self, model, batch, *, copies=1, reference=None, linear=False):
        sums, counts = super().metric(model, batch, copies=copies, reference=reference)
        return -sums, counts  # minus the loss: the copy's log-probability


def _copy_suppression(model: Any) -> Task:
    return CopyTask()


TASKS.register(
    "copy_suppression",
    _copy_suppression,
    summary="log-probability of the in-context token the model predicts, on prose (decoders)",
)
