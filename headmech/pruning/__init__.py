"""Head pruning: masks, physical removal, iterative pruning and gates.

``HeadMask`` gates heads through a :class:`~headmech.interventions.Scale` intervention,
:func:`prune_heads` builds a smaller Hugging Face model, and three pruning methods —
registered in :data:`headmech.core.registry.PRUNING_METHODS` — return a
:class:`PruningResult` that writes ``pruning.json`` (docs/architecture.md):

* ``michel`` — Michel et al. 2019's iterative pruning by mask-gradient importance;
* ``l0`` — Voita et al. 2019's Hard Concrete L0 gates over a λ sweep;
* ``mae`` — Peng et al. 2020's input-dependent mixture-of-heads gates against fine-tuning.

:func:`prune` runs any of them by name, as :func:`headmech.attribution.importance` does
for importance methods.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS.
    Voita et al. 2019, "Analyzing Multi-Head Self-Attention", ACL.
    Peng et al. 2020, "A Mixture of h − 1 Heads is Better than h Heads", ACL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headmech.core.registry import PRUNING_METHODS
from headmech.probes import ProbeOptions
from headmech.pruning.l0 import L0Options, l0_prune
from headmech.pruning.mae import MAEOptions, mae_prune
from headmech.pruning.mask import (
    HeadMask,
    UnsupportedPruningError,
    head_mask,
    head_mask_hooks,
    prune_heads,
)
from headmech.pruning.michel import MichelOptions, masked_importance, masked_metric, michel_prune
from headmech.pruning.result import PruningResult
from headmech.tasks import Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.classify import HeadCatalog
    from headmech.runs.resume import Units

__all__ = [
    "HeadMask",
    "PruningResult",
    "UnsupportedPruningError",
    "head_mask",
    "head_mask_hooks",
    "masked_importance",
    "masked_metric",
    "michel_prune",
    "prune",
    "prune_heads",
]

PRUNING_METHODS.register(
    "michel",
    michel_prune,
    summary="Michel et al. 2019: drop the 10% least important heads by mask gradient, repeat",
    options=MichelOptions,
)
PRUNING_METHODS.register(
    "l0",
    l0_prune,
    summary="Voita et al. 2019: Hard Concrete L0 gates distilled to the model, a λ sweep",
    options=L0Options,
)
PRUNING_METHODS.register(
    "mae",
    mae_prune,
    summary="Peng et al. 2020: input-dependent gates over 'all heads but one' vs fine-tuning",
    options=MAEOptions,
)


def prune(
    model: TransformerBridge,
    method: str,
    task: str | Task = "lm",
    *,
    catalog: HeadCatalog | None = None,
    probe_options: ProbeOptions | None = None,
    progress: bool = True,
    units: Units | None = None,
    **options: Any,
) -> PruningResult:
    """Prune ``model``'s heads for ``task`` with a registered method.

    Args:
        model: a ``TransformerBridge``.
        method: ``michel``, ``l0``, ``mae`` or a plug-in's name
            (:data:`headmech.core.registry.PRUNING_METHODS`).
        task: a task name or :class:`headmech.tasks.Task`.
        catalog: fills ``survival`` per head type.
        probe_options: probe sizes.
        progress: report progress on stderr (default; ``False``: silent).
        units: a :class:`headmech.runs.resume.Units` store: each step (michel), λ (l0) or run
            (mae) is read from it where stored, else stored as it finishes
            (:mod:`headmech.runs.resume`).
        **options: the method's options (its dataclass: :class:`MichelOptions`,
            :class:`L0Options`, :class:`MAEOptions`).

    Returns:
        A :class:`PruningResult`; ``.save(dir)`` writes ``pruning.json``.
    """
    from headmech.pruning.spec import PruneSpec

    spec = PruneSpec.create(method, task, probe_options=probe_options, **options)
    return spec.run(model, catalog=catalog, progress=progress, units=units)
