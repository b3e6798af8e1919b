"""Run an importance method: the work behind :meth:`ImportanceSpec.run <headmech.attribution.spec.ImportanceSpec.run>`.

:func:`run_spec` builds the task's probe (unless batches are given), runs the method with
its checked options, each batch a unit of a resumable run (:mod:`headmech.runs.resume`),
and returns an :class:`~headmech.attribution.result.ImportanceResult` with its bootstrap
interval and provenance.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from headmech.attribution.methods import MethodOutput, check_baseline
from headmech.attribution.result import ImportanceResult
from headmech.core.registry import METHODS
from headmech.interventions import Cost
from headmech.probes import ProbeOptions
from headmech.runs.resume import counting, recording
from headmech.stream.engine import ProbeBatch
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.runs.resume import Units

__all__ = ["result_of", "run_spec"]


def run_spec(
    spec: Any,
    model: TransformerBridge,
    *,
    batches: list[ProbeBatch] | None = None,
    progress: bool = True,
    units: Units | None = None,
) -> ImportanceResult:
    """Score every head of ``model`` as ``spec`` (an
    :class:`~headmech.attribution.spec.ImportanceSpec`, whose :meth:`run` calls this) says."""
    entry = METHODS.entry(spec.method)
    options = spec.option_values()
    check_baseline(options.get("baseline"), model)  # the cheap check before the probe
    t = get_task(spec.task, model)
    if batches is None:
        batches = t.batches(model, spec.probe or ProbeOptions())
    cost = Cost(sequences=sum(int(b.input_ids.shape[0]) for b in batches))
    torch_state = torch.is_grad_enabled()
    t0 = time.perf_counter()
    try:
        with recording(units), counting(cost):  # finished batches: stored, or read back
            out: MethodOutput = entry.obj(model, t, list(batches), cost, spec.options, progress)
    finally:
        torch.set_grad_enabled(torch_state)
    seconds = time.perf_counter() - t0
    settings = {"method": spec.method, "options": options}
    settings.update(task=t.name, n_boot=spec.n_boot)
    result = result_of(model, out, t, batches, spec.probe, settings, spec.n_boot, dict(spec.given))
    result.seconds, result.forward_equivalents = seconds, cost.forward_equivalents
    result.details["n_sequences"] = cost.sequences
    return result


def result_of(
    model: TransformerBridge,
    out: MethodOutput,
    task: Task,
    batches: list[ProbeBatch],
    probe_options: ProbeOptions | None,
    settings: dict[str, Any],
    n_boot: int,
    options: dict[str, Any],
) -> ImportanceResult:
    """The result with its bootstrap interval and provenance (timings filled by the caller)."""
    from headmech.models import model_info
    from headmech.runs.provenance import provenance

    score, units = out.score.detach().float().cpu(), out.units
    seed = int(options.get("seed", 0))
    interval = units.interval(n_boot=n_boot, seed=seed) if units is not None and n_boot else None
    return ImportanceResult(
        method=settings["method"],
        task=task.name,
        score=score,
        metric_clean=out.metric_clean,
        metric_description=out.description,
        seconds=0.0,
        forward_equivalents=0.0,
        model=model_info(model).name,
        details={**options, **out.details},
        low=None if interval is None else interval[0].reshape(score.shape),
        high=None if interval is None else interval[1].reshape(score.shape),
        provenance=provenance(
            model, probes={task.probe: batches}, options=probe_options, settings=settings
        ),
    )
