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
when used). Methods live in :data:`headmech.registry.METHODS`, each with a dataclass of
typed options; a plug-in package adds one through the entry-point group
``headmech.methods`` (a function ``(model, task, batches, cost, options, progress) ->
(score, metric_clean, metric_description)`` with an ``options`` attribute naming its
dataclass, or None).
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

from headmech.attribution.ablation import ablation_importance
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
from headmech.errors import UnknownMethodError
from headmech.interventions import Cost
from headmech.probes import ProbeOptions
from headmech.registry import METHODS, build_options
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "AblationOptions",
    "DLAOptions",
    "ImportanceResult",
    "LRPOptions",
    "MaskGradientOptions",
    "PatchingOptions",
    "UnknownMethodError",
    "activation_patching",
    "attribution_patching",
    "importance",
    "spearman",
]


@dataclass
class ImportanceResult:
    """A per-head importance score and how it was obtained.

    Attributes:
        method, task: names.
        score: ``[n_layers, n_heads]``, higher = more important.
        metric_clean: the task's metric on the unmodified model (for patching, on the
            unpatched base run); None for methods that measure no metric.
        metric_description: what was measured.
        seconds: wall time of the method (probe building excluded).
        forward_equivalents: compute in passes over the probe (a backward pass counts as
            two forward passes).
        model: the model's short name.
        details: method-specific extras (its options, the probe size).
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

    def to_dict(self) -> dict[str, Any]:
        """The ``importance.json`` contents."""
        return {
            "method": self.method,
            "task": self.task,
            "metric_clean": self.metric_clean,
            "score": [[round(float(v), 6) for v in row] for row in self.score],
            "metric_description": self.metric_description,
            "model": self.model,
            "seconds": round(self.seconds, 3),
            "forward_equivalents": round(self.forward_equivalents, 3),
            "details": self.details,
        }

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/importance.json`` and ``out/importance.png``; returns the JSON path."""
        from headmech.plot import score_heatmap

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "importance.json"
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        title = f"{self.model} {self.method} / {self.task}"
        score_heatmap(self.score, title=title, path=out / "importance.png")
        return path

    def top(self, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` highest-scoring heads as ``(layer, head)``."""
        flat = torch.nan_to_num(self.score.flatten(), nan=-float("inf"))
        idx = flat.argsort(descending=True)[:k]
        n_heads = self.score.shape[1]
        return [(int(i) // n_heads, int(i) % n_heads) for i in idx]


# method(model, task, batches, cost, options, progress) -> (score, metric_clean, description)
MethodFn = Callable[
    ["TransformerBridge", Task, list[ProbeBatch], Cost, Any, bool],
    tuple[Tensor, float | None, str],
]


@dataclass
class AblationOptions:
    """Options of the ablation methods.

    Attributes:
        chunk: ablations per forward pass (copies of a batch; None: as many as the
            runner's memory budget allows).
    """

    chunk: int | None = None


@dataclass
class PatchingOptions:
    """Options of ``patching`` and ``attribution_patching``.

    Attributes:
        direction: ``noising`` (corrupted outputs into the clean run) or ``denoising``.
        seed: seeds the corrupted inputs.
        chunk: patched runs per forward pass (None: from the memory budget).
    """

    direction: str = "noising"
    seed: int = 0
    chunk: int | None = None


@dataclass
class MaskGradientOptions:
    """Options of ``mask_gradient``.

    Attributes:
        per_token: absolute value of the gradient per token (Michel et al.'s code) rather
            than per batch.
        normalize_layers: divide each layer's scores by their ℓ2 norm.
    """

    per_token: bool = True
    normalize_layers: bool = False


@dataclass
class DLAOptions:
    """Options of ``dla``.

    Attributes:
        baseline: a token id to compare the correct token with (None: the vocabulary mean).
    """

    baseline: int | None = None


@dataclass
class LRPOptions:
    """Options of ``lrp``.

    Attributes:
        normalise: normalise relevance within each layer (Voita et al. 2019).
        per_prediction: normalise each prediction before averaging (one backward pass
            per position).
    """

    normalise: bool = True
    per_prediction: bool = False


def _ablation(mode: str) -> MethodFn:
    def run(model, task, batches, cost, o, progress):
        score, clean = ablation_importance(
            model, task, batches, mode, chunk=o.chunk, cost=cost, progress=progress and mode
        )
        return score, clean, task.description

    return run


def _patching(approximate: bool) -> MethodFn:
    def run(model, task, batches, cost, o, progress):
        score, base = patching_importance(
            model,
            task,
            batches,
            direction=o.direction,
            approximate=approximate,
            seed=o.seed,
            chunk=o.chunk,
            cost=cost,
            progress=progress and "patching",
        )
        return score, base, (task.gradient_description if approximate else task.description)

    return run


def _mask_gradient(model, task, batches, cost, o, progress):
    score, clean = mask_gradient_importance(
        model,
        task,
        batches,
        per_token=o.per_token,
        normalize_layers=o.normalize_layers,
        cost=cost,
        progress=progress and "mask gradient",
    )
    return score, clean, task.gradient_description


def _dla(model, task, batches, cost, o, progress):
    score = direct_logit_attribution(
        model, task, batches, baseline=o.baseline, cost=cost, progress=progress and "DLA"
    )
    what = (
        "direct contribution to the correct token's logit minus the vocabulary mean"
        if task.causal_only
        else "direct contribution to e.e0/|e0|^2 (frozen post-LN scales)"
    )
    return score, None, what


def _confidence(model, task, batches, cost, o, progress):
    cost.add(sum(int(b.input_ids.shape[0]) for b in batches))
    return confidence(model, batches), None, "mean max attention weight (special tokens excluded)"


def _lrp(model, task, batches, cost, o, progress):
    from headmech.attribution import lrp

    score = lrp.lrp_head_relevance(
        model,
        batches,
        normalise=o.normalise,
        per_prediction=o.per_prediction,
        progress=progress,
    )
    cost.add(sum(int(b.input_ids.shape[0]) for b in batches), backward=True)
    what = (
        lrp.METRIC
        if o.normalise
        else "AttnLRP head relevance (hook_z x modified gradient), logit units"
    )
    return score, None, what


_ABLATIONS = {
    "zero": "zero-ablate each head (hook_z = 0) and measure the metric's change",
    "mean": "replace each head's output by its mean over the probe",
    "resample": "replace each head's output by another input's (the next sequence)",
    "uniform": "make each head attend uniformly to the keys it may see (Wu et al. 2024)",
}
for _mode, _summary in _ABLATIONS.items():
    METHODS.register(_mode, _ablation(_mode), summary=_summary, options=AblationOptions)
METHODS.register(
    "patching",
    _patching(False),
    summary="activation patching of each head between clean and corrupted inputs",
    options=PatchingOptions,
)
METHODS.register(
    "attribution_patching",
    _patching(True),
    summary="first-order patching, (z_clean - z_corrupt)·∂metric/∂z",
    options=PatchingOptions,
)
METHODS.register(
    "mask_gradient",
    _mask_gradient,
    summary="Michel et al. 2019: E|∂L/∂ξ_h| of a mask on each head",
    options=MaskGradientOptions,
)
METHODS.register(
    "dla",
    _dla,
    summary="direct logit attribution through the frozen final norm",
    options=DLAOptions,
)
METHODS.register(
    "confidence", _confidence, summary="Voita et al. 2019: mean maximum attention weight"
)
METHODS.register(
    "lrp", _lrp, summary="AttnLRP head relevance (Achtibat et al. 2024)", options=LRPOptions
)


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
        method: a name in :data:`headmech.registry.METHODS`.
        task: ``lm``, ``induction``, ``retrieval`` or a :class:`headmech.tasks.Task`.
        batches: probe batches to use (default: the task's probe under ``probe_options``).
        probe_options: sizes of the probe.
        progress: show progress bars.
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
    opts = build_options(entry, options)
    t = get_task(task, model)
    if batches is None:
        batches = t.batches(model, probe_options or ProbeOptions())
    cost = Cost(sequences=sum(int(b.input_ids.shape[0]) for b in batches))
    torch_state = torch.is_grad_enabled()
    t0 = time.perf_counter()
    try:
        score, clean, metric = entry.obj(model, t, list(batches), cost, opts, progress)
    finally:
        torch.set_grad_enabled(torch_state)
    from headmech.models import model_info

    return ImportanceResult(
        method=method,
        task=t.name,
        score=score.detach().float().cpu(),
        metric_clean=clean,
        metric_description=metric,
        seconds=time.perf_counter() - t0,
        forward_equivalents=cost.forward_equivalents,
        model=model_info(model).name,
        details={"n_sequences": cost.sequences, **options},
    )
