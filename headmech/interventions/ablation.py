"""Head ablation: zero, mean, resample and uniform-attention, as interventions.

Four ways to take a head out, which can disagree (Michel et al. 2019; Wu et al. 2024):

* ``zero`` — the head's output ``hook_z`` is 0 (Michel et al. 2019's mask ξ_h = 0);
* ``mean`` — ``hook_z`` is its mean over a probe (keeps the average contribution,
  removes the input dependence);
* ``resample`` — ``hook_z`` is the head's output on *another* probe input at the same
  position (the next sequence of the batch; Chan et al. 2022's resampling ablation);
* ``uniform`` — the head attends uniformly to every key it may see (Wu et al. 2024 mask
  retrieval heads this way); its value path stays. Only where the bridge honours
  ``hook_pattern`` edits (not BERT's).

:func:`ablation` builds the :class:`~headmech.interventions.Intervention`;
:func:`ablation_variants` builds, per batch, the interventions of many head sets for the
batched runner (resampling needs the batch's own head outputs). :func:`random_heads`
draws control sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex, check_heads
from headmech.interventions import (
    Cost,
    Intervention,
    Mean,
    Patch,
    Uniform,
    Zero,
    capture_z,
    hooks,
    mean_outputs,
)
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "ABLATION_MODES",
    "AblationMode",
    "ablation",
    "ablation_hooks",
    "ablation_variants",
    "mean_head_outputs",
    "own_effects",
    "random_heads",
]

AblationMode = Literal["zero", "mean", "resample", "uniform"]
ABLATION_MODES: tuple[str, ...] = ("zero", "mean", "resample", "uniform")

mean_head_outputs = mean_outputs  # the name tutorials and papers use


def ablation(
    heads: Iterable[HeadIndex | Sequence[int]],
    mode: str = "zero",
    means: Float[Tensor, "n_layers n_heads d_head"] | None = None,
    source_z: Tensor | None = None,
) -> Intervention:
    """The intervention that ablates ``heads``.

    Args:
        heads: ``(layer, head)`` pairs or ``"L18H6"`` strings (query heads under
            grouped-query attention).
        mode: ``zero``, ``mean``, ``resample`` or ``uniform``.
        means: per-head mean ``hook_z`` for ``mean`` (:func:`mean_head_outputs`).
        source_z: for ``resample``, the other inputs' ``hook_z``
            (``[n_layers, batch, pos, n_heads, d_head]``).
    """
    if mode == "zero":
        return Intervention.on(heads, Zero())
    if mode == "mean":
        if means is None:
            raise HeadmechError(
                "mean ablation needs `means` (headmech.interventions.ablation.mean_head_outputs)"
            )
        return Intervention.on(heads, Mean(means))
    if mode == "resample":
        if source_z is None:
            raise HeadmechError("resample ablation needs `source_z`, another input's hook_z")
        return Intervention.on(heads, Patch(source_z))
    if mode == "uniform":
        return Intervention.on(heads, Uniform(), site="pattern")
    raise HeadmechError(f"unknown ablation mode '{mode}' (have: {', '.join(ABLATION_MODES)})")


def ablation_hooks(
    model: TransformerBridge,
    heads: Iterable[HeadIndex | Sequence[int]],
    mode: str = "zero",
    means: Float[Tensor, "n_layers n_heads d_head"] | None = None,
) -> list[tuple[str, Callable[..., Any]]]:
    """TransformerLens ``fwd_hooks`` that ablate ``heads`` (for ``model.hooks`` or
    ``run_with_hooks``); ``zero``, ``mean`` or ``uniform``."""
    heads = check_heads(heads, int(model.cfg.n_layers), int(model.cfg.n_heads), "ablation_hooks")
    return hooks(model, [ablation(heads, mode, means)]) if heads else []


def ablation_variants(
    model: TransformerBridge,
    batches: Sequence[ProbeBatch],
    head_sets: Sequence[Iterable[HeadIndex | Sequence[int]]],
    mode: str = "zero",
    cost: Cost | None = None,
) -> Callable[[int, ProbeBatch], list[list[Intervention]]]:
    """Per batch, one ablation per head set (for :func:`headmech.interventions.run_variants`).

    ``mean`` ablation computes the probe's mean outputs once; ``resample`` captures each
    batch's outputs and gives every sequence the next sequence's (a roll by one).
    """
    if mode not in ABLATION_MODES:
        raise HeadmechError(f"unknown ablation mode '{mode}' (have: {', '.join(ABLATION_MODES)})")
    sets = [check_heads(s, None, None, "head_sets") for s in head_sets]
    means = None
    if mode == "mean":
        means = mean_outputs(model, batches)  # [n_layers, n_heads, d_head]
        if cost is not None:
            cost.add(sum(int(b.input_ids.shape[0]) for b in batches))

    def for_batch(bi: int, batch: ProbeBatch) -> list[list[Intervention]]:
        source = None
        if mode == "resample":
            if batch.input_ids.shape[0] < 2:
                raise HeadmechError(
                    "resample ablation needs at least 2 sequences per batch (another input's "
                    "head output); raise the batch size"
                )
            source = capture_z(model, batch).roll(1, dims=1)  # [n_layers, batch, pos, heads, d]
            if cost is not None:
                cost.add(int(batch.input_ids.shape[0]))
        return [[ablation(s, mode, means, source)] if s else [] for s in sets]

    return for_batch


def own_effects(
    model: TransformerBridge,
    task: Any,
    batches: Sequence[ProbeBatch],
    heads: Sequence[HeadIndex],
    mode: str = "zero",
    *,
    seed: int = 0,
) -> dict[str, Float[Tensor, "n_layers n_heads"]]:
    """Each of ``heads`` ablated alone (``mode``), all in the same batched passes: the
    task metric's change, ablated minus clean (higher: the head helps the task), and its
    95% bootstrap interval over the probe's units (paired with the clean run).

    Returns:
        ``{"effect", "low", "high"}``, ``[n_layers, n_heads]`` each; NaN for heads not in
        ``heads`` (and for an interval no unit scored).
    """
    from headmech.interventions import run_variants
    from headmech.stream.uncertainty import UnitValues

    shape = (int(model.cfg.n_layers), int(model.cfg.n_heads))
    out = {k: torch.full(shape, float("nan")) for k in ("effect", "low", "high")}
    if not heads:
        return out
    variants = ablation_variants(model, batches, [[h] for h in heads], mode)
    values, clean, sums, counts = run_variants(model, task, batches, variants, per_unit=True)
    for i, h in enumerate(heads):
        out["effect"][h.layer, h.head] = float(values[i]) - clean
        interval = UnitValues(sums[1 + i] - sums[0], counts[0]).interval(seed=seed)
        if interval is not None:
            out["low"][h.layer, h.head], out["high"][h.layer, h.head] = map(float, interval)
    return out


def random_heads(
    n_layers: int,
    n_heads: int,
    k: int,
    *,
    exclude: Iterable[HeadIndex | Sequence[int]] = (),
    generator: torch.Generator,
    like: Sequence[HeadIndex | Sequence[int]] | None = None,
) -> list[HeadIndex]:
    """``k`` distinct heads drawn uniformly from those not in ``exclude``.

    With ``like`` (a head set to mimic), draw layer-matched controls instead: for each
    layer, as many heads from that layer as ``like`` has there (topping up from other
    layers where a layer has too few unexcluded heads). Ablation effects depend strongly on
    depth, so a layer-matched control is the fair comparison for labelled heads.
    """
    banned = {(int(a), int(b)) for a, b in exclude}
    free = [
        HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads) if (la, h) not in banned
    ]
    if k > len(free):
        raise HeadmechError(f"cannot draw {k} heads from {len(free)}")

    def draw(pool: list[HeadIndex], m: int) -> list[HeadIndex]:
        perm = torch.randperm(len(pool), generator=generator)[:m]
        return [pool[int(i)] for i in perm]

    if like is None:
        return draw(free, k)
    per_layer: dict[int, int] = {}
    for layer, _ in like:
        per_layer[int(layer)] = per_layer.get(int(layer), 0) + 1
    chosen: list[HeadIndex] = []
    for layer, n in sorted(per_layer.items()):
        pool = [h for h in free if h.layer == layer]
        chosen += draw(pool, min(n, len(pool)))
    rest = [h for h in free if h not in chosen]
    return chosen + draw(rest, k - len(chosen))
