"""Head attribution: a ``[n_layers, n_heads]`` importance score for a task, many ways.

``importance(model, method, task)`` runs one method from :data:`METHODS` and returns an
:class:`ImportanceResult` that writes ``importance.json`` (the public contract:
``{"method", "task", "metric_clean", "score"}`` plus the metric each method used, its
cost in seconds and forward-pass equivalents) and a heatmap. Convention: higher means the
head matters more for the task (ablation: the damage its removal causes).

Methods: ``zero``, ``mean``, ``resample``, ``uniform`` (ablation), ``patching`` and
``attribution_patching`` (between the task's clean and corrupted inputs),
``mask_gradient`` (Michel et al. 2019), ``dla`` (direct logit attribution),
``confidence`` (Voita et al. 2019) and ``lrp`` (:mod:`headmech.attribution.lrp`, imported
when used). Methods live in :data:`headmech.core.registry.METHODS`, each with a dataclass of
typed options; a plug-in package adds one through the entry-point group
``headmech.methods`` (a function ``(model, task, batches, cost, options, progress) ->
(score, metric_clean, metric_description)`` with an ``options`` attribute naming its
dataclass, or None).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.attribution.methods import (
    AblationOptions,
    DLAOptions,
    LRPOptions,
    MaskGradientOptions,
    MethodOutput,
    PatchingOptions,
)
from headmech.attribution.patching import activation_patching, attribution_patching, spearman
from headmech.core.checks import method_options
from headmech.core.errors import UnknownMethodError
from headmech.core.options import build_options
from headmech.core.registry import METHODS
from headmech.interventions import Cost
from headmech.probes import ProbeOptions
from headmech.runs.files import FileSchema, ResultFile
from headmech.runs.provenance import SCHEMA_VERSION
from headmech.runs.resume import counting, recording
from headmech.stream.engine import ProbeBatch
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.runs.resume import Units

__all__ = [
    "AblationOptions",
    "DLAOptions",
    "ImportanceResult",
    "LRPOptions",
    "MaskGradientOptions",
    "MethodOutput",
    "PatchingOptions",
    "UnknownMethodError",
    "activation_patching",
    "attribution_patching",
    "importance",
    "spearman",
]

# importance.json: its header names no headmech version
IMPORTANCE_FILE = FileSchema(
    "importance result", "importance.json", SCHEMA_VERSION, required=("method", "task", "score"),
    headmech_version=False,
)  # fmt: skip


@dataclass(eq=False)
class ImportanceResult(ResultFile):
    """A per-head importance score and how it was obtained.

    Attributes:
        method, task: names.
        score: ``[n_layers, n_heads]``, higher = more important.
        metric_clean: the task's metric on the unmodified model (for patching, on the
            unpatched base run); None for methods that measure no metric.
        metric_description: what was measured.
        seconds: wall time of the method (probe building excluded; not written to JSON,
            so a rerun writes the same bytes).
        forward_equivalents: compute in passes over the probe (a backward pass counts as
            two forward passes).
        model: the model's short name.
        details: method-specific extras (its options, the probe size).
        low, high: the bootstrap interval of ``score`` over probe examples (None where the
            method gives no per-example values).
        provenance: weights, probe data, versions, settings (:mod:`headmech.runs.provenance`).
    """

    method: str
    task: str
    score: Float[Tensor, "n_layers n_heads"]
    metric_clean: float | None
    metric_description: str
    seconds: float
    forward_equivalents: float
    model: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    low: Float[Tensor, "n_layers n_heads"] | None = None
    high: Float[Tensor, "n_layers n_heads"] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    SCHEMA = IMPORTANCE_FILE

    def _body(self) -> dict[str, Any]:
        out = {
            "method": self.method,
            "task": self.task,
            "metric_clean": self.metric_clean,
            "score": self.score.tolist(),
            "metric_description": self.metric_description,
            "model": self.model,
            "forward_equivalents": self.forward_equivalents,
            "details": self.details,
        }
        if self.low is not None and self.high is not None:
            out["interval"] = {"low": self.low.tolist(), "high": self.high.tolist()}
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``importance.json`` contents (:meth:`to_json`)."""
        return self.to_json()

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/importance.json`` and ``out/importance.png`` (``out`` ending in
        ``.json``: that file alone); returns the JSON path."""
        return super().save(out)

    def _figures(self, folder: Path) -> None:
        from headmech.core.plot import score_heatmap

        title = f"{self.model} {self.method} / {self.task}"
        score_heatmap(self.score, title=title, path=folder / "importance.png")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ImportanceResult:
        """Read an ``importance.json`` (or its folder); a one-line error if it is not one."""
        return super().load(path)

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> ImportanceResult:
        interval = d.get("interval") or {}
        return cls(
            d["method"], d["task"], torch.tensor(d["score"]), d["metric_clean"],
            d["metric_description"], 0.0, float(d["forward_equivalents"]), d["model"],
            d["details"],
            torch.tensor(interval["low"]) if interval else None,
            torch.tensor(interval["high"]) if interval else None,
            d.get("provenance", {}),
        )  # fmt: skip

    def top(self, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` highest-scoring heads as ``(layer, head)``."""
        flat = torch.nan_to_num(self.score.flatten(), nan=-float("inf"))
        idx = flat.argsort(descending=True)[:k]
        n_heads = self.score.shape[1]
        return [(int(i) // n_heads, int(i) % n_heads) for i in idx]


def importance(
    model: TransformerBridge,
    method: str,
    task: str | Task = "lm",
    *,
    batches: list[ProbeBatch] | None = None,
    probe_options: ProbeOptions | None = None,
    progress: bool = True,
    n_boot: int = 200,
    units: Units | None = None,
    **options: Any,
) -> ImportanceResult:
    """Per-head importance of ``model`` for ``task`` by ``method``.

    Args:
        model: a ``TransformerBridge``.
        method: a name in :data:`headmech.core.registry.METHODS`.
        task: ``lm``, ``induction``, ``retrieval`` or a :class:`headmech.tasks.Task`.
        batches: probe batches to use (default: the task's probe under ``probe_options``).
        probe_options: sizes of the probe.
        progress: show progress bars on stderr (default; ``False``: silent).
        n_boot: bootstrap resamples of the probe's examples for the score's interval (0:
            none; seeded by the ``seed`` option where the method has one, else 0).
        units: a :class:`headmech.runs.resume.Units` store: each probe batch's work is read
            from it where stored, else stored as it finishes (:mod:`headmech.runs.resume`).
        **options: the method's typed options (:class:`AblationOptions`,
            :class:`PatchingOptions`, :class:`MaskGradientOptions`, :class:`DLAOptions`,
            :class:`LRPOptions`); an option the method does not take is a one-line error.

    Returns:
        An :class:`ImportanceResult`; ``.save(dir)`` writes ``importance.json``.

    Raises:
        UnknownMethodError, UnknownTaskError: one-line reasons.

    Examples:
        >>> r = importance(model, "zero", "induction", probe_options=ProbeOptions(n_sequences=4))  # doctest: +SKIP
        >>> r.top(3)  # doctest: +SKIP
    """
    entry = METHODS.entry(method)
    opts = build_options(entry, method_options(dict(options)))
    t = get_task(task, model)
    if batches is None:
        batches = t.batches(model, probe_options or ProbeOptions())
    cost = Cost(sequences=sum(int(b.input_ids.shape[0]) for b in batches))
    torch_state = torch.is_grad_enabled()
    t0 = time.perf_counter()
    try:
        with recording(units), counting(cost):  # finished batches: stored, or read back
            out: MethodOutput = entry.obj(model, t, list(batches), cost, opts, progress)
    finally:
        torch.set_grad_enabled(torch_state)
    seconds = time.perf_counter() - t0
    settings = {"method": method, "options": vars(opts) if opts is not None else {}}
    settings.update(task=t.name, n_boot=n_boot)
    result = _result(model, out, t, batches, probe_options, settings, n_boot, options)
    result.seconds, result.forward_equivalents = seconds, cost.forward_equivalents
    result.details["n_sequences"] = cost.sequences
    return result


def _result(
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
