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
when used).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.attribution.ablation import Cost, ablate_sets, ablation_importance
from headmech.attribution.confidence import confidence
from headmech.attribution.logit import direct_logit_attribution
from headmech.attribution.mask_gradient import mask_gradient_importance
from headmech.attribution.patching import (
    activation_patching,
    attribution_patching,
    patching_importance,
    spearman,
)
from headmech.engine import ProbeBatch
from headmech.errors import HeadmechError
from headmech.probes import ProbeOptions
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "METHODS",
    "ImportanceResult",
    "UnknownMethodError",
    "ablate_sets",
    "activation_patching",
    "attribution_patching",
    "importance",
    "spearman",
]


class UnknownMethodError(HeadmechError):
    """An attribution method name that is not registered."""


@dataclass
class ImportanceResult:
    """A per-head importance score and how it was obtained.

    Attributes:
        method, task: names.
        score: ``[n_layers, n_heads]``, higher = more important.
        metric_clean: the task's damage on the unmodified model (the metric the method
            used; for patching, of the unpatched base run).
        metric: what was measured.
        seconds: wall time of the method (probe building excluded).
        forward_equivalents: compute in passes over the probe (a backward pass counts as
            two forward passes).
        details: method-specific extras.
    """

    method: str
    task: str
    score: Float[Tensor, "n_layers n_heads"]
    metric_clean: float | None
    metric: str
    seconds: float
    forward_equivalents: float
    model: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "task": self.task,
            "metric_clean": self.metric_clean,
            "score": [[round(float(v), 6) for v in row] for row in self.score],
            "metric": self.metric,
            "model": self.model,
            "seconds": round(self.seconds, 3),
            "forward_equivalents": round(self.forward_equivalents, 3),
            "details": self.details,
        }

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/importance.json`` and ``out/importance.png``; returns the JSON path."""
        import matplotlib.pyplot as plt

        from headmech.plot import head_heatmap

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "importance.json"
        path.write_text(json.dumps(self.to_dict(), indent=1))
        n_layers, n_heads = self.score.shape
        fig, ax = plt.subplots(figsize=(1.6 + 0.35 * n_heads, 1.2 + 0.22 * n_layers))
        head_heatmap(self.score, ax=ax, title=f"{self.model} {self.method} / {self.task}")
        fig.tight_layout()
        fig.savefig(out / "importance.png", dpi=110)
        plt.close(fig)
        return path

    def top(self, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` highest-scoring heads as ``(layer, head)``."""
        flat = torch.nan_to_num(self.score.flatten(), nan=-float("inf"))
        idx = flat.argsort(descending=True)[:k]
        n_heads = self.score.shape[1]
        return [(int(i) // n_heads, int(i) % n_heads) for i in idx]


# method(model, task, batches, cost, options) -> (score, metric_clean, metric description)
MethodFn = Callable[
    ["TransformerBridge", Task, list[ProbeBatch], Cost, dict[str, Any]],
    tuple[Tensor, float | None, str],
]
METHODS: dict[str, MethodFn] = {}


def _ablation(mode: str) -> MethodFn:
    def run(model, task, batches, cost, options):
        score, clean = ablation_importance(
            model,
            task,
            batches,
            mode,
            chunk=options.get("chunk", 8),
            cost=cost,  # type: ignore[arg-type]
            progress=options.get("progress", False) and f"{mode} ablation",
        )
        return score, clean, task.metric

    return run


for _mode in ("zero", "mean", "resample", "uniform"):
    METHODS[_mode] = _ablation(_mode)


def _patching(approximate: bool) -> MethodFn:
    def run(model, task, batches, cost, options):
        score, base = patching_importance(
            model,
            task,
            batches,
            direction=options.get("direction", "noising"),
            approximate=approximate,
            seed=options.get("seed", 0),
            chunk=options.get("chunk", 8),
            cost=cost,
            progress=options.get("progress", False) and "patching",
        )
        return score, base, (task.gradient_metric if approximate else task.metric)

    return run


METHODS["patching"] = _patching(False)
METHODS["attribution_patching"] = _patching(True)


def _mask_gradient(model, task, batches, cost, options):
    score, clean = mask_gradient_importance(
        model,
        task,
        batches,
        per_token=options.get("per_token", True),
        normalize_layers=options.get("normalize_layers", False),
        cost=cost,
        progress=options.get("progress", False) and "mask gradient",
    )
    return score, clean, task.gradient_metric


def _dla(model, task, batches, cost, options):
    score = direct_logit_attribution(
        model,
        task,
        batches,
        baseline=options.get("baseline"),
        cost=cost,
        progress=options.get("progress", False) and "DLA",
    )
    what = (
        "direct contribution to the correct token's logit minus the vocabulary mean"
        if task.causal_only
        else "direct contribution to e.e0/|e0|^2 (frozen post-LN scales)"
    )
    return score, None, what


def _confidence(model, task, batches, cost, options):
    cost.add(sum(int(b.input_ids.shape[0]) for b in batches))
    return confidence(model, batches), None, "mean max attention weight (special tokens excluded)"


def _lrp(model, task, batches, cost, options):
    try:
        from headmech.attribution import lrp
    except ImportError as e:
        raise UnknownMethodError(f"method 'lrp' is not available: {e}") from e
    score = lrp.lrp_head_relevance(model, batches, progress=bool(options.get("progress", False)))
    cost.add(sum(int(b.input_ids.shape[0]) for b in batches), backward=True)
    return score, None, str(getattr(lrp, "METRIC", "LRP head relevance"))


METHODS["mask_gradient"] = _mask_gradient
METHODS["dla"] = _dla
METHODS["confidence"] = _confidence
METHODS["lrp"] = _lrp


def importance(
    model: TransformerBridge,
    method: str,
    task: str | Task = "lm",
    *,
    batches: list[ProbeBatch] | None = None,
    probe_options: ProbeOptions | None = None,
    progress: bool = False,
    **options: Any,
) -> ImportanceResult:
    """Per-head importance of ``model`` for ``task`` by ``method``.

    Args:
        model: a ``TransformerBridge``.
        method: a key of :data:`METHODS`.
        task: ``lm``, ``induction``, ``retrieval`` or a :class:`headmech.tasks.Task`.
        batches: probe batches to use (default: the task's probe under ``probe_options``).
        probe_options: sizes of the probe.
        progress: show progress bars.
        **options: method options (``chunk``, ``direction``, ``per_token``,
            ``normalize_layers``, ``baseline``, ``seed``).

    Returns:
        An :class:`ImportanceResult`; ``.save(dir)`` writes ``importance.json``.

    Raises:
        UnknownMethodError, UnknownTaskError: one-line reasons.

    Examples:
        >>> r = importance(model, "zero", "induction", probe_options=ProbeOptions(n_sequences=4))  # doctest: +SKIP
        >>> r.top(3)  # doctest: +SKIP
    """
    if method not in METHODS:
        raise UnknownMethodError(f"unknown method '{method}' (have: {', '.join(METHODS)})")
    t = get_task(task, model)
    if batches is None:
        batches = t.batches(model, probe_options or ProbeOptions())
    cost = Cost(sequences=sum(int(b.input_ids.shape[0]) for b in batches))
    torch_state = torch.is_grad_enabled()
    t0 = time.perf_counter()
    try:
        score, clean, metric = METHODS[method](
            model, t, list(batches), cost, {**options, "progress": progress}
        )
    finally:
        torch.set_grad_enabled(torch_state)
    seconds = time.perf_counter() - t0
    from headmech.models import model_info

    return ImportanceResult(
        method=method,
        task=t.name,
        score=score.detach().float().cpu(),
        metric_clean=clean,
        metric=metric,
        seconds=seconds,
        forward_equivalents=cost.forward_equivalents,
        model=model_info(model).name,
        details={
            "n_sequences": cost.sequences,
            **({k: v for k, v in options.items() if isinstance(v, (int, float, str, bool))}),
        },
    )
