"""The batched runner: many interventions on the same inputs in few forward passes.

Exact methods need many interventions on the same inputs (one per head, a control set,
...). :func:`run_variants` stacks ``k`` copies of a batch along the batch dimension and
the hooks apply variant ``i``'s interventions to copy ``i`` only, so one forward pass
serves ``k`` interventions; the clean run rides along as variant 0. The task
(:mod:`headmech.tasks`) turns each copy's output into its metric. :func:`evaluate` is the
one-variant case, :func:`gradients` one forward and backward pass with every head's
output tapped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from headmech.engine import ProbeBatch
from headmech.errors import HeadmechError
from headmech.interventions.effects import Scale, Tap
from headmech.interventions.hooks import Intervention, applied

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.tasks import Task

__all__ = ["Cost", "evaluate", "gradients", "run_variants"]


@dataclass
class Cost:
    """Compute spent, in sequence-forward passes (a backward pass counts as two)."""

    sequences: int = 0  # sequences in the probe (the unit of one "forward-pass equivalent")
    forward: int = 0  # sequences run forward
    backward: int = 0  # sequences run backward
    t0: float = field(default_factory=time.perf_counter)

    def add(self, n_seq: int, backward: bool = False) -> None:
        """Count ``n_seq`` sequences run forward (and backward)."""
        self.forward += n_seq
        if backward:
            self.backward += n_seq

    @property
    def forward_equivalents(self) -> float:
        """Forward passes over the whole probe that the work equals."""
        return (self.forward + 2 * self.backward) / max(self.sequences, 1)


VariantsFor = Callable[[int, ProbeBatch], Sequence[Sequence[Intervention]]]


def run_variants(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    variants: VariantsFor | Sequence[Sequence[Intervention]],
    *,
    chunk: int = 8,
    references: Sequence[Any] | None = None,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, " n_variants"], float]:
    """The task's mean metric under each variant, and under none (the clean run).

    Args:
        model: a ``TransformerBridge``.
        task: what is measured (:class:`headmech.tasks.Task`; higher is worse).
        batches: the probe batches.
        variants: a list of variants (each a list of interventions), or
            ``variants(batch_index, batch)`` building them per batch (for sources that
            depend on the batch, such as patching from a corrupted run).
        chunk: variants per forward pass (copies of the batch); the clean run is one more.
        references: per batch, the task's clean reference (default: computed).
        cost: accumulates the compute spent.
        progress: a tqdm bar over batches (a string names it).

    Returns:
        ``(metric per variant, clean metric)``.
    """
    fixed = None if callable(variants) else list(variants)
    sums = counts = None
    it: Iterable[int] = range(len(batches))
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=progress if isinstance(progress, str) else "batches", leave=False)
    with torch.no_grad():
        for bi in it:
            batch = batches[bi]
            ref = references[bi] if references is not None else task.reference(model, batch)
            todo = fixed if fixed is not None else variants(bi, batch)  # type: ignore[operator]
            all_variants: list[Sequence[Intervention]] = [(), *todo]
            if sums is None:
                sums = torch.zeros(len(all_variants), dtype=torch.float64)
                counts = torch.zeros(len(all_variants), dtype=torch.float64)
            for start in range(0, len(all_variants), chunk):
                group = all_variants[start : start + chunk]
                with applied(model, group):
                    s, c = task.metric(model, batch, copies=len(group), reference=ref)
                sums[start : start + len(group)] += s.double().cpu()
                counts[start : start + len(group)] += c.double().cpu()  # type: ignore[index]
                if cost is not None:
                    cost.add(len(group) * batch.input_ids.shape[0])
    if sums is None or counts is None:
        raise HeadmechError("no batches to run")
    mean = sums / counts.clamp(min=1)
    return mean[1:].float(), float(mean[0])


def evaluate(
    model: TransformerBridge,
    task: Task,
    batches: Iterable[ProbeBatch],
    interventions: Sequence[Intervention] = (),
    *,
    references: Sequence[Any] | None = None,
) -> float:
    """The task's mean metric over the batches with ``interventions`` applied (references:
    the clean model's, computed per batch unless given)."""
    total, n = 0.0, 0.0
    with torch.no_grad():
        for i, b in enumerate(batches):
            ref = references[i] if references is not None else task.reference(model, b)
            with applied(model, list(interventions)):
                s, c = task.metric(model, b, reference=ref)
            total += float(s.sum())
            n += float(c.sum())
    return total / max(n, 1.0)


def gradients(
    model: TransformerBridge,
    task: Task,
    batch: ProbeBatch,
    *,
    reference: Any = None,
    scale: Tensor | None = None,
    linear: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One forward and backward pass: every head's output and the metric's gradient.

    Args:
        model: a ``TransformerBridge``.
        task: the metric (its gradient form with ``linear``: see :mod:`headmech.tasks`).
        batch: one probe batch.
        reference: the task's clean reference for this batch.
        scale: optional ``[n_layers, n_heads]`` leaf multiplying each head's output
            (Michel et al.'s ξ); its gradient is accumulated into ``scale.grad``.
        linear: use the task's gradient metric.

    Returns:
        ``(z, grad, metric_sum, count)``: ``z`` (after ``scale``) and ``∂(metric sum)/∂z``,
        both ``[n_layers, batch, pos, n_heads, d_head]``.
    """
    n_layers = int(model.cfg.n_layers)
    store: dict[int, tuple[Tensor, Tensor]] = {}
    ivs = [] if scale is None else [Intervention.all_heads(model, Scale(scale))]
    ivs.append(Intervention.all_heads(model, Tap(store)))
    with torch.enable_grad():
        with applied(model, ivs):
            s, c = task.metric(model, batch, reference=reference, linear=linear)
        leaves = [store[la][1] for la in range(n_layers)]
        if scale is not None:
            leaves.append(scale)
        grads = torch.autograd.grad(s.sum(), leaves, allow_unused=True)
    g = [torch.zeros_like(leaves[i]) if grads[i] is None else grads[i] for i in range(len(leaves))]
    # heads first [batch, head, pos, d] -> hook layout [batch, pos, head, d]
    z = torch.stack([rearrange(store[la][0], "b h p d -> b p h d") for la in range(n_layers)])
    grad = torch.stack([rearrange(gi, "b h p d -> b p h d") for gi in g[:n_layers]])
    if scale is not None:
        scale.grad = g[-1] if scale.grad is None else scale.grad + g[-1]
    return z, grad, s.detach().sum(), c.sum()
