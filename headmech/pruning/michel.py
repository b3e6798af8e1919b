"""Iterative head pruning by mask-gradient importance (Michel et al. 2019).

Each step scores the remaining heads by ``I_h = E_x |∂L/∂ξ_h|`` *under the current mask*
(recomputed every step unless ``recompute=False``), removes the lowest-scoring
``max(1, int(fraction * remaining))`` heads (the paper prunes 10% per step) and records
the task's metric with the new mask. The curve metric-vs-heads-kept and how many heads go
before the metric degrades by 5% are the paper's headline numbers.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS,
    section 4 (iterative pruning, 10% of heads per step, importance recomputed).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from jaxtyping import Float
from torch import Tensor

from headmech.attribution.mask_gradient import masked_importance as _batch_importance
from headmech.interventions import evaluate
from headmech.probes import ProbeOptions
from headmech.pruning.mask import HeadMask, check_mask
from headmech.pruning.result import PruningResult
from headmech.pruning.survival import check_catalog
from headmech.runs.resume import unit
from headmech.stream.engine import ProbeBatch
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.classify import HeadCatalog

__all__ = ["MichelOptions", "PruningResult", "masked_importance", "masked_metric", "michel_prune"]


@dataclass
class MichelOptions:
    """Options of :func:`michel_prune`.

    Attributes:
        fraction: share of the *remaining* heads removed per step (at least one; the
            paper's 10%).
        steps: stop after this many pruning steps (None: until no head is left).
        recompute: rescore the heads under the current mask each step (the paper); else
            use the full model's scores throughout.
        per: where the mask gradient's absolute value is taken (``example``, the paper's
            definition; ``token``, its released code; ``batch``).
    """

    fraction: float = 0.1
    steps: int | None = None
    recompute: bool = True
    per: str = "example"


def masked_metric(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    mask: HeadMask,
    references: Sequence[Any] | None = None,
) -> float:
    """The task's mean metric with ``mask`` applied."""
    check_mask(model, mask)
    iv = mask.intervention()
    return evaluate(model, task, batches, [] if iv is None else [iv], references=references)


def masked_importance(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    mask: HeadMask,
    references: Sequence[Any],
    per: str = "example",
) -> Float[Tensor, "n_layers n_heads"]:
    """Michel et al.'s ``E_x |∂L(x)/∂ξ_h|`` at ξ = ``mask`` (absolute value per example;
    ``per="token"`` as their released code)."""
    check_mask(model, mask)
    total = None
    for batch, ref in zip(batches, references, strict=True):
        _, units, _, _ = _batch_importance(model, task, batch, mask.values, reference=ref, per=per)
        total = units if total is None else total + units
    assert total is not None
    return total.point()


def _record(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    mask: HeadMask,
    refs: Sequence[Any],
) -> dict[str, Any]:
    """One step of the trajectory: the heads kept, the metric and its bootstrap interval."""
    iv = mask.intervention()
    metric, units = evaluate(
        model, task, batches, [iv] if iv else [], references=refs, per_unit=True
    )
    step = {"n_kept": mask.n_kept, "heads_kept": mask.kept(), "metric": metric}
    interval = units.interval()
    if interval is not None:
        step["metric_interval"] = [float(interval[0]), float(interval[1])]
    return step


def _step(mask: HeadMask, score: Tensor, fraction: float) -> HeadMask:
    """Remove the ``max(1, int(fraction * kept))`` lowest-scoring kept heads."""
    score = score.clone()
    score[mask.values == 0] = float("inf")
    k = max(1, int(fraction * mask.n_kept))
    idx = score.flatten().argsort()[:k]
    n_heads = mask.shape[1]
    return mask.remove([(int(i) // n_heads, int(i) % n_heads) for i in idx])


def michel_prune(
    model: TransformerBridge,
    task: str | Task = "lm",
    *,
    fraction: float = 0.1,
    steps: int | None = None,
    recompute: bool = True,
    per: str = "example",
    batches: list[ProbeBatch] | None = None,
    probe_options: ProbeOptions | None = None,
    catalog: HeadCatalog | None = None,
    progress: bool = False,
) -> PruningResult:
    """Prune heads iteratively by mask-gradient importance (Michel et al. 2019).

    Args:
        model: a ``TransformerBridge``.
        task: ``lm``, ``induction``, ``retrieval`` or a :class:`headmech.tasks.Task`.
        fraction, steps, recompute, per: see :class:`MichelOptions`.
        batches: probe batches (default: the task's probe under ``probe_options``).
        probe_options: probe sizes.
        catalog: a :class:`headmech.classification.classify.HeadCatalog`; fills ``survival`` per type.
        progress: print one line per step to stderr.

    Returns:
        A :class:`PruningResult`: step 0 is the unpruned model, then one entry per step.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    check_catalog(catalog, model)
    t, batches, refs = _task_batches(model, task, batches, probe_options)
    mask = HeadMask.for_model(model)
    n_total = mask.n_kept

    # each step is a unit of a resumable run (headmech.runs.resume): the new mask and its record
    history = [unit("step0", partial(_record, model, t, batches, mask, refs))]
    fixed = None
    if not recompute:
        fixed = unit("importance", partial(masked_importance, model, t, batches, mask, refs, per))

    def step(mask: HeadMask) -> dict[str, Any]:
        score = (
            fixed if fixed is not None else masked_importance(model, t, batches, mask, refs, per)
        )
        new = _step(mask, score, fraction)
        return {"mask": new.values, "record": _record(model, t, batches, new, refs)}

    while mask.n_kept > 0 and (steps is None or len(history) <= steps):
        done = unit(f"step{len(history)}", partial(step, mask))
        mask = HeadMask(done["mask"])
        history.append(done["record"])
        if progress:
            print(f"step {len(history) - 1}: {mask.n_kept} heads kept, metric "
                  f"{history[-1]['metric']:.4f}", file=sys.stderr)  # fmt: skip
    settings = {"fraction": fraction, "steps": steps, "recompute": recompute, "per": per}
    return pruning_result(
        "michel", t, model, history, catalog, n_total, batches, probe_options, settings
    )


def _task_batches(
    model: TransformerBridge,
    task: str | Task,
    batches: list[ProbeBatch] | None,
    probe_options: ProbeOptions | None,
) -> tuple[Task, list[ProbeBatch], list[Any]]:
    """The task, its probe batches (the task's own probe under ``probe_options`` unless
    given) and the unpruned model's reference on each."""
    t = get_task(task, model)
    if batches is None:
        batches = t.batches(model, probe_options or ProbeOptions())
    return t, batches, [t.reference(model, b) for b in batches]


def pruning_result(
    method: str,
    task: Task,
    model: TransformerBridge,
    steps: list[dict[str, Any]],
    catalog: HeadCatalog | None,
    n_total: int,
    batches: Sequence[ProbeBatch] = (),
    probe_options: ProbeOptions | None = None,
    settings: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> PruningResult:
    from headmech.models import model_info
    from headmech.pruning.survival import survival
    from headmech.runs.provenance import provenance

    prov = provenance(
        model,
        probes={task.probe: batches} if batches else None,
        options=probe_options,
        settings={"method": method, "task": task.name, **(settings or {})},
    )
    if catalog is not None:
        prov["catalog"] = dict(catalog.provenance.get("model", {}))
    return PruningResult(
        method=method,
        task=task.name,
        steps=steps,
        survival=survival([s["heads_kept"] for s in steps], catalog) if catalog else {},
        n_heads_total=n_total,
        metric=task.description,
        model=model_info(model).name,
        extra=extra or {},
        provenance=prov,
    )
