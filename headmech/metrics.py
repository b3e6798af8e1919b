"""Behavioural metrics as plain floats, for catalog validation.

Convention: every metric is a *damage* — higher is worse (a loss, or one minus a fidelity)
— so the effect of an ablation is ``metric(ablated) - metric(clean)`` and a positive
effect means the ablated heads were needed. The damages themselves are defined once, as
tasks (:mod:`headmech.tasks`); these functions average a task's damage over probe batches
under optional ``fwd_hooks``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from headmech.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.tasks import Task

__all__ = ["embedding_distortion", "lm_loss", "repeated_half_loss", "task_metric"]

Hooks = Sequence[tuple[Any, Any]]


def task_metric(
    model: TransformerBridge, task: str | Task, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """Mean damage of ``task`` over the batches (token- or sentence-weighted, as the task counts)."""
    from headmech.tasks import get_task

    t = get_task(task, model)
    total, n = 0.0, 0.0
    with torch.no_grad():
        for b in batches:
            s, c = t.damage(model, b, list(fwd_hooks), reference=t.reference(model, b))
            total += float(s.sum())
            n += float(c.sum())
    return total / max(n, 1.0)


def lm_loss(
    model: TransformerBridge, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """Mean next-token loss over every real target token (causal models)."""
    return task_metric(model, "lm", batches, fwd_hooks)


def repeated_half_loss(
    model: TransformerBridge, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """Mean loss on the repeated half of ``repeated_random`` batches (every repeated token
    but the first, which no induction head can predict)."""
    return task_metric(model, "induction", batches, fwd_hooks)


def embedding_distortion(
    model: TransformerBridge, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """1 - mean cosine similarity of the mean-pooled sentence embedding to the unablated
    model's (encoders); 0 for the clean model."""
    return task_metric(model, "lm", batches, fwd_hooks)
