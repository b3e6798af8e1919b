"""Causal validation of head labels: do the labelled heads matter for their type's task?

:func:`validate_heads` ablates a type's labelled heads, and random control sets of as many
unlabelled heads drawn from the same layers, and measures the type's task metric (higher
is worse) each time; :func:`headmech.classify` runs it for every type with
``validate=True`` (``details["validation"]`` of ``catalog.json``). Not to be confused with
:mod:`headmech.checks`, the checks of user input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from headmech.heads import HeadIndex, HeadType
from headmech.models import ModelInfo, model_info
from headmech.probes import ProbeOptions

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["validate_heads"]


def _controls(
    info: ModelInfo, heads: Sequence[HeadIndex], n_random: int, seed: int
) -> tuple[list[list[HeadIndex]], str, str]:
    """Control head sets: as many heads per layer as ``heads`` has there, none of them
    labelled. Where a layer has too few unlabelled heads, the sets fall back to any layer
    (with a warning); where the model has too few unlabelled heads at all, there is no
    control. Returns ``(sets, kind, note)``."""
    import warnings

    from headmech.ablation import random_heads

    free = info.n_layers * info.n_heads - len(set(heads))
    if not heads or n_random < 1:
        return [], "none", "no labelled heads" if not heads else "n_random is 0"
    if free < len(heads):
        note = (
            f"no control possible: {len(heads)} of {info.n_layers * info.n_heads} heads are "
            f"labelled, and a random set of as many unlabelled heads does not exist"
        )
        return [], "none", note
    per_layer: dict[int, int] = {}
    for h in heads:
        per_layer[h.layer] = per_layer.get(h.layer, 0) + 1
    short = [la for la, n in per_layer.items() if info.n_heads - n < n]
    g = torch.Generator().manual_seed(seed)
    like = None if short else list(heads)
    kind, note = "same_layers", ""
    if short:
        kind = "any_layer"
        note = (
            f"layers {sorted(short)} have fewer unlabelled than labelled heads: controls drawn "
            "from every layer"
        )
        warnings.warn(note, stacklevel=3)
    sets = [
        random_heads(info.n_layers, info.n_heads, len(heads), exclude=heads, generator=g, like=like)
        for _ in range(n_random)
    ]
    return sets, kind, note


def validate_heads(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    *,
    n_random: int = 5,
    mode: str | None = None,
) -> dict[str, Any]:
    """Ablate the labelled heads, and ``n_random`` control sets of as many unlabelled
    heads from the same layers (per-layer counts matched), and measure the type's task
    metric (higher is worse) each time.

    All sets ride in the same batched forward passes
    (:func:`headmech.interventions.run_variants`). The effect of the labelled heads is
    reported against the median and the range of the control effects, with the drawn
    control sets; a bootstrap interval over probe examples accompanies the labelled
    effect.

    Returns:
        ``{"metric", "mode", "control", "control_note", "clean", "ablated", "effect",
        "effect_interval", "control_sets", "random_effects", "random_mean",
        "random_median", "random_range", "n_heads", "expected"}``; ``effect`` is ablated
        minus clean; ``expected``: ``raise`` (the type serves the task) or ``lower``;
        ``control`` is ``same_layers``, ``any_layer`` (fallback) or ``none``.
    """
    from headmech.ablation import ablation_variants
    from headmech.interventions import run_variants
    from headmech.progress import active
    from headmech.tasks import get_task
    from headmech.uncertainty import UnitValues

    mode = mode or head_type.ablation
    info = model_info(model)
    task = get_task(head_type.task, model)
    batches = task.batches(model, options)
    controls, kind, note = _controls(info, heads, n_random, options.seed)
    sets = [list(heads), *controls] if heads else []
    variants = ablation_variants(model, batches, sets, mode)
    desc = f"validate {head_type.name} (labelled + {len(controls)} control sets)"
    values, clean, sums, counts = run_variants(
        model, task, batches, variants, per_unit=True, progress=desc if active() else False
    )
    interval = None
    if heads:
        paired = UnitValues(sums[1] - sums[0], counts[0]).interval(seed=options.seed)
        interval = None if paired is None else [float(paired[0]), float(paired[1])]
    record = {"metric": task.description, "mode": mode, "control": kind, "control_note": note}
    return {**record, **_effects(head_type, heads, controls, values, clean, interval)}


def _effects(
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    controls: list[list[HeadIndex]],
    values: torch.Tensor,
    clean: float,
    interval: list[float] | None,
) -> dict[str, Any]:
    """:func:`validate_heads`' effects: the labelled set's (``values[0]``, where there are
    labelled heads) and the control sets' (the rest), each minus the clean metric."""
    ablated = float(values[0]) if heads else clean
    rand = sorted(float(v) - clean for v in values[1:])
    return {
        "clean": clean,
        "ablated": ablated,
        "effect": ablated - clean,
        "effect_interval": interval,
        "control_sets": [[[h.layer, h.head] for h in c] for c in controls],
        "random_effects": [float(v) - clean for v in values[1:]],
        "random_mean": sum(rand) / len(rand) if rand else None,
        "random_median": float(torch.tensor(rand).median()) if rand else None,
        "random_range": [rand[0], rand[-1]] if rand else None,
        "n_heads": len(heads),
        "expected": "raise" if head_type.helps_task else "lower",
    }


def _validation(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    n_random: int,
) -> dict[str, Any]:
    """:func:`validate_heads`, or, where the type's task cannot run on the model (the
    induction task's next-token loss for ``duplicate_token`` on an encoder), a record that
    says so: ``effect`` None and the reason in ``control_note``."""
    from headmech.registry import TASKS
    from headmech.tasks import is_causal

    task = TASKS.get(str(head_type.task))(model)
    if not (task.causal_only and not is_causal(model)):
        return validate_heads(model, head_type, heads, options, n_random=n_random)
    none = dict.fromkeys(("clean", "ablated", "effect", "effect_interval", "random_mean"))
    none.update(dict.fromkeys(("random_median", "random_range")))
    return {
        **none,
        "metric": task.description,
        "mode": head_type.ablation,
        "control": "none",
        "control_note": f"not validated: task '{task.name}' needs a causal (decoder) model",
        "control_sets": [],
        "random_effects": [],
        "n_heads": len(heads),
        "expected": "raise" if head_type.helps_task else "lower",
    }
