"""The importance methods: each a function ``(model, task, batches, cost, options,
progress) -> MethodOutput`` registered in :data:`headmech.core.registry.METHODS` with a
dataclass of typed options.

Attribution patching reports, on every run, its agreement with exact activation patching
on a sample of heads (the ``check_heads`` heads it scores highest plus as many random
ones): Pearson r and the overlap of the top halves, with a warning when r < 0.5. A
first-order estimate can be far off where the metric is not linear in a head's output
(toy-induction's previous-token head: an estimate near 0 for an exact effect near 5).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.attribution.ablation import ablation_importance
from headmech.attribution.confidence import confidence
from headmech.attribution.logit import direct_logit_attribution
from headmech.attribution.mask_gradient import mask_gradient_importance
from headmech.attribution.patching import exact_patching, patching_importance
from headmech.core.registry import METHODS
from headmech.interventions import Cost
from headmech.stream.engine import ProbeBatch
from headmech.stream.uncertainty import UnitValues
from headmech.tasks import Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "AblationOptions",
    "DLAOptions",
    "LRPOptions",
    "MaskGradientOptions",
    "MethodOutput",
    "PatchingOptions",
    "patching_agreement",
]


@dataclass
class MethodOutput:
    """What an importance method returns.

    Attributes:
        score: ``[n_layers, n_heads]``, higher = more important.
        metric_clean: the task's metric on the unmodified (or base) run, or None.
        description: what was measured.
        units: per-unit values for the bootstrap interval (None: no interval).
        details: extras recorded in ``importance.json``.
    """

    score: Tensor
    metric_clean: float | None
    description: str
    units: UnitValues | None = None
    details: dict[str, Any] = field(default_factory=dict)


MethodFn = Callable[["TransformerBridge", Task, list[ProbeBatch], Cost, Any, bool], MethodOutput]


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
        check_heads: attribution patching only: exact patching of this many of its top
            heads and as many random ones, to report (and warn about) its agreement (0:
            no check).
    """

    direction: str = "noising"
    seed: int = 0
    chunk: int | None = None
    check_heads: int = 4


@dataclass
class MaskGradientOptions:
    """Options of ``mask_gradient``.

    Attributes:
        per: where the gradient's absolute value is taken: ``example`` (Michel et al.'s
            definition, ``E_x |∂L(x)/∂ξ_h|``), ``token`` (their released code) or
            ``batch`` (the bertology script).
        normalize_layers: divide each layer's scores by their ℓ2 norm.
    """

    per: str = "example"
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
        score, clean, units = ablation_importance(
            model, task, batches, mode, chunk=o.chunk, cost=cost, progress=progress and mode
        )
        return MethodOutput(score, clean, task.description, units)

    return run


def _patching(approximate: bool) -> MethodFn:
    def run(model, task, batches, cost, o, progress):
        score, base, units = patching_importance(
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
        what = task.gradient_description if approximate else task.description
        details = {}
        if approximate and o.check_heads:
            details["agreement"] = patching_agreement(
                model, task, batches, score, o.direction, o.seed, o.check_heads
            )
        return MethodOutput(score, base, what, units, details)

    return run


def _mask_gradient(model, task, batches, cost, o, progress):
    score, clean, units = mask_gradient_importance(
        model,
        task,
        batches,
        per=o.per,
        normalize_layers=o.normalize_layers,
        cost=cost,
        progress=progress and "mask gradient",
    )
    units = None if o.normalize_layers else units
    return MethodOutput(score, clean, task.gradient_description, units)


def _reads_weights(fn: MethodFn) -> MethodFn:
    """Methods that read weights directly between forward passes (DLA's W_O/W_U, LRP's
    rules) refuse a model whose weights accelerate offloads (``device_map``)."""

    def run(model, task, batches, cost, o, progress):
        from headmech.core.errors import HeadmechError
        from headmech.core.placement import is_offloaded

        if is_offloaded(model):
            raise HeadmechError(
                f"{fn.__name__.lstrip('_')} reads weights directly and does not support "
                "offloaded models yet: load the model without --device-map/--max-memory"
            )
        return fn(model, task, batches, cost, o, progress)

    return run


def check_baseline(baseline: int | None, model: Any) -> None:
    """Raise a one-line :class:`~headmech.core.errors.InputError` when DLA's baseline token
    is outside the model's vocabulary (the importance run checks it before building the
    probe; DLA itself again, for its direct callers)."""
    from headmech.core.errors import InputError

    vocab = int(model.cfg.d_vocab)
    if baseline is not None and not 0 <= baseline < vocab:
        raise InputError(f"baseline token {baseline} is outside the vocabulary (0..{vocab - 1})")


@_reads_weights
def _dla(model, task, batches, cost, o, progress):
    check_baseline(o.baseline, model)
    score, units = direct_logit_attribution(
        model, task, batches, baseline=o.baseline, cost=cost, progress=progress and "DLA"
    )
    what = (
        "direct contribution to the correct token's logit minus the vocabulary mean"
        if task.causal_only
        else "direct contribution to e.e0/|e0|^2 (frozen post-LN scales)"
    )
    return MethodOutput(score, None, what, units)


def _confidence(model, task, batches, cost, o, progress):
    cost.add(sum(int(b.input_ids.shape[0]) for b in batches))
    score, units = confidence(model, batches, return_units=True)
    return MethodOutput(score, None, "mean max attention weight (special tokens excluded)", units)


@_reads_weights
def _lrp(model, task, batches, cost, o, progress):
    from headmech.attribution import lrp

    score, units = lrp.lrp_head_relevance(
        model,
        batches,
        normalise=o.normalise,
        per_prediction=o.per_prediction,
        progress=progress,
        return_units=True,
    )
    cost.add(sum(int(b.input_ids.shape[0]) for b in batches), backward=True)
    what = (
        lrp.METRIC
        if o.normalise
        else "AttnLRP head relevance (hook_z x modified gradient), logit units"
    )
    return MethodOutput(score, None, what, units)


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


def patching_agreement(
    model: TransformerBridge,
    task: Task,
    batches: list[ProbeBatch],
    approx: Tensor,
    direction: str,
    seed: int,
    k: int,
) -> dict[str, Any]:
    """Exact patching of the ``k`` heads ``approx`` ranks highest and ``k`` random others;
    Pearson r between the two scores on them, the overlap of their top halves and the scale
    of the estimates (their summed magnitude over the exact scores'). Warns (one line) when
    r < 0.5, the top halves share less than half, or the scale is off by more than 10x
    either way (the toy's previous-token head L0H3: estimate 0.046, exact 4.4, ranked
    first by both)."""
    n_layers, n_heads = approx.shape
    flat = approx.flatten()
    top = flat.abs().argsort(descending=True)[:k].tolist()
    g = torch.Generator().manual_seed(seed)
    rest = [i for i in torch.randperm(flat.numel(), generator=g).tolist() if i not in top]
    picked = top + rest[:k]
    heads = [(i // n_heads, i % n_heads) for i in picked]
    exact = exact_patching(model, task, batches, heads, direction=direction, seed=seed)  # type: ignore[arg-type]
    a, e = flat[picked].double(), exact.double()
    r = float(torch.corrcoef(torch.stack([a, e]))[0, 1]) if len(picked) > 2 else float("nan")
    half = max(len(picked) // 2, 1)
    top_a = set(a.argsort(descending=True)[:half].tolist())
    top_e = set(e.argsort(descending=True)[:half].tolist())
    overlap = len(top_a & top_e) / half
    scale = float(a.abs().sum() / e.abs().sum().clamp_min(1e-12))
    if not r >= 0.5 or overlap < 0.5 or not 0.1 <= scale <= 10:
        worst = int((a - e).abs().argmax())
        warnings.warn(
            f"attribution patching disagrees with exact patching on {len(picked)} checked heads "
            f"(Pearson r {r:.2f}, top-half overlap {overlap:.2f}, estimates {scale:.2g}x the "
            f"exact effects; worst L{heads[worst][0]}"
            f"H{heads[worst][1]}: estimate {float(a[worst]):.3g}, exact {float(e[worst]):.3g})",
            stacklevel=2,
        )
    return {
        "heads": [list(h) for h in heads],
        "estimate": a.tolist(),
        "exact": e.tolist(),
        "pearson_r": r,
        "top_half_overlap": overlap,
        "scale": scale,
    }
