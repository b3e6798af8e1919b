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

from typing import TYPE_CHECKING, Any

from headmech.attribution.methods import (
    AblationOptions,
    DLAOptions,
    LRPOptions,
    MaskGradientOptions,
    MethodOutput,
    PatchingOptions,
)
from headmech.attribution.patching import activation_patching, attribution_patching, spearman
from headmech.attribution.result import IMPORTANCE_FILE, ImportanceResult
from headmech.attribution.spec import ImportanceSpec
from headmech.core.errors import UnknownMethodError
from headmech.core.registry import METHODS
from headmech.probes import ProbeOptions
from headmech.stream.engine import ProbeBatch
from headmech.tasks import Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.runs.resume import Units

__all__ = [
    "AblationOptions",
    "DLAOptions",
    "IMPORTANCE_FILE",
    "ImportanceResult",
    "ImportanceSpec",
    "LRPOptions",
    "METHODS",
    "MaskGradientOptions",
    "MethodOutput",
    "PatchingOptions",
    "UnknownMethodError",
    "activation_patching",
    "attribution_patching",
    "importance",
    "spearman",
]


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
    spec = ImportanceSpec.create(
        method, task, probe_options=probe_options, n_boot=n_boot, **options
    )
    return spec.run(model, batches=batches, progress=progress, units=units)
