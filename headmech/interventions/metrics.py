"""Task metrics as plain floats, under any TransformerLens hooks.

Convention (as everywhere in headmech): a metric is a loss, higher is worse, so the effect
of an intervention is ``metric(intervened) - metric(clean)``. The metrics themselves are
defined once, as tasks (:mod:`headmech.tasks`); these functions average a task's metric
over probe batches while the caller's ``fwd_hooks`` are active, for code that speaks in
TransformerLens hooks (inside headmech, use :func:`headmech.interventions.evaluate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from headmech.interventions import evaluate
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.tasks import Task

__all__ = ["embedding_distortion", "lm_loss", "repeated_half_loss", "task_metric"]

Hooks = Sequence[tuple[Any, Any]]


def task_metric(
    model: TransformerBridge, task: str | Task, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """Mean metric of ``task`` over the batches with ``fwd_hooks`` active (references, where
    the task needs them, come from the clean model)."""
    from headmech.tasks import get_task

    t = get_task(task, model)
    batches = list(batches)
    refs = [t.reference(model, b) for b in batches]
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        return evaluate(model, t, batches, references=refs)


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
