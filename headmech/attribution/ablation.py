"""Ablation importance: take a head out and measure how much the task gets worse.

The importance of a head (or a set of heads) is ``metric(ablated) - metric(clean)`` on
the task's probe, with any of the ablations of :mod:`headmech.interventions.ablation` (zero, mean,
resample, uniform attention).

Batching: the intervention runner (:func:`headmech.interventions.run_variants`) stacks a
probe batch ``k`` times along the batch dimension and copy ``i`` carries ablation ``i``,
so one forward pass serves ``k`` ablations; ``n`` heads cost ``n + 1`` probe passes in
``ceil((n + 1) / k)`` forward calls.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS.
    Chan et al. 2022, "Causal Scrubbing" (Alignment Forum).
    Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.interventions import Cost, run_variants
from headmech.interventions.ablation import ABLATION_MODES, AblationMode, ablation_variants
from headmech.stream.engine import ProbeBatch
from headmech.stream.uncertainty import UnitValues
from headmech.tasks import Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["ABLATION_MODES", "Cost", "ablate_sets", "ablation_importance", "paired_units"]


def ablate_sets(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    head_sets: Sequence[Iterable[HeadIndex | Sequence[int]]],
    mode: AblationMode = "zero",
    *,
    chunk: int | None = None,
    cost: Cost | None = None,
    progress: bool | str = False,
    per_unit: bool = False,
) -> Any:
    """Metric with each set of heads ablated together, and the clean metric.

    Args:
        model: a ``TransformerBridge``.
        task: a :class:`headmech.tasks.Task`.
        batches: the task's probe batches.
        head_sets: sets of ``(layer, head)`` pairs; each is one intervention.
        mode: ``zero``, ``mean``, ``resample`` or ``uniform``.
        chunk: interventions per forward pass (copies of the batch; default: from the
            runner's memory budget).
        cost: accumulates the compute spent.
        progress: tqdm bar over batches.
        per_unit: also return per-unit sums and counts (as
            :func:`headmech.interventions.run_variants`).

    Returns:
        ``(metric per set, clean metric)`` (and the per-unit sums and counts).
    """
    variants = ablation_variants(model, batches, head_sets, mode, cost)
    return run_variants(
        model, task, batches, variants, chunk=chunk, cost=cost, progress=progress,
        per_unit=per_unit,
    )  # fmt: skip


def ablation_importance(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    mode: AblationMode = "zero",
    *,
    chunk: int | None = None,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, "n_layers n_heads"], float, UnitValues]:
    """Per-head ablation importance ``metric(head ablated) - metric(clean)``.

    Returns:
        ``(score [n_layers, n_heads], clean metric, per-unit values)``; the unit values
        are each sequence's paired loss difference, for bootstrap intervals.

    Examples:
        >>> score, clean = ablation_importance(model, get_task("lm", model), batches)  # doctest: +SKIP
    """
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    heads = [[(la, h)] for la in range(n_layers) for h in range(n_heads)]
    metric, clean, sums, counts = ablate_sets(
        model, task, batches, heads, mode, chunk=chunk, cost=cost, progress=progress,
        per_unit=True,
    )  # fmt: skip
    return (metric - clean).view(n_layers, n_heads), clean, paired_units(sums, counts, n_heads)


def paired_units(sums: Tensor, counts: Tensor, n_heads: int) -> UnitValues:
    """Per-unit differences from the clean run (row 0) for a grid of per-head variants:
    ``num [units, n_layers, n_heads]``, ``den`` the clean run's counts."""
    diff = (sums[1:] - sums[0]).T  # [units, n_variants]
    return UnitValues(diff.reshape(diff.shape[0], -1, n_heads), counts[0])
