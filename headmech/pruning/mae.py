"""Input-dependent head gates: a mixture of "all heads but one" experts (Peng et al. 2020).

In each layer, expert ``i`` is the attention block with head ``i`` dropped, and a gate
network reads the mean-pooled layer input ``x̄`` (``blocks.{l}.hook_in``, real tokens only)
and weights the ``n`` experts: ``p = softmax(W₂ tanh(W₁ x̄ + b₁) + b₂)``. Since the attention
output is linear in the head outputs, the mixture ``Σ_i p_i · expert_i`` scales head ``j``'s
output by ``Σ_{i≠j} p_i = 1 − p_j``. Each expert is rescaled by ``n / (n − 1)`` (it has one
head fewer; Peng et al.'s rescaling), so head ``j``'s ``hook_z`` is multiplied by
``(1 − p_j) · n / (n − 1)``. The scales sum to ``n`` in every layer, and with uniform
``p`` every scale is exactly 1: the gate network starts with ``W₂ = 0, b₂ = 0``, so an
untrained MAE model is the base model.

Training is block coordinate descent on the task loss: alternately ``gate_steps`` Adam
steps on the gate networks with the model frozen, then ``model_steps`` steps on the model
with the gates frozen. :func:`compare_mae` measures the task metric on held-out probe
batches against the base model fine-tuned for the same number of model steps without
gates (equal compute in model updates; the MAE run also spends the gate steps).

References:
    Peng, Schwartz, Li, Smith 2020, "A Mixture of h − 1 Heads is Better than h Heads",
    ACL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from headmech.core.errors import HeadmechError
from headmech.core.placement import model_device
from headmech.interventions import Gate, Intervention, applied, hooks
from headmech.models.loaded import model_name
from headmech.probes import ProbeOptions
from headmech.pruning.l0 import frozen
from headmech.pruning.result import PruningResult
from headmech.runs.resume import unit
from headmech.stream.engine import ProbeBatch
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.classify import HeadCatalog

__all__ = [
    "MAEComparison",
    "MAEGates",
    "MAEOptions",
    "compare_mae",
    "mae_hooks",
    "mae_intervention",
    "mae_prune",
    "train_mae",
]


class MAEGates(nn.Module):
    """Per-layer gate networks ``p = softmax(W₂ tanh(W₁ x̄ + b₁) + b₂)`` over the n experts.

    Args:
        n_layers, n_heads, d_model: the model's shape.
        d_hidden: width of the gate networks.
        generator: draws ``W₁`` (the global random stream is left alone).
    """

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        d_model: int,
        d_hidden: int = 32,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if n_heads < 2:
            raise ValueError("a mixture of h - 1 heads needs at least 2 heads")
        self.n_heads = n_heads
        w1 = torch.randn(n_layers, d_model, d_hidden, generator=generator) / d_model**0.5
        self.w1 = nn.Parameter(w1)
        self.b1 = nn.Parameter(torch.zeros(n_layers, d_hidden))
        self.w2 = nn.Parameter(torch.zeros(n_layers, d_hidden, n_heads))
        self.b2 = nn.Parameter(torch.zeros(n_layers, n_heads))

    def probs(
        self, layer: int, x: Float[Tensor, "batch d_model"]
    ) -> Float[Tensor, "batch n_heads"]:
        """Expert weights ``p`` (expert ``i`` drops head ``i``)."""
        h = torch.tanh(x.float() @ self.w1[layer] + self.b1[layer])
        return torch.softmax(h @ self.w2[layer] + self.b2[layer], dim=-1)

    def head_scales(self, p: Float[Tensor, "batch n_heads"]) -> Float[Tensor, "batch n_heads"]:
        """Head ``j``'s output scale ``(1 − p_j) · n / (n − 1)`` (sums to ``n``)."""
        n = self.n_heads
        return (1.0 - p) * (n / (n - 1))


def mae_intervention(
    model: TransformerBridge, gates: MAEGates, attention_mask: Tensor, record: list | None = None
) -> Intervention:
    """Every head's ``hook_z`` scaled by the gates' head scales, computed per sequence from
    each layer's mean-pooled input; ``record`` (if given) receives each layer's ``p``."""

    def scales(layer: int, pooled: Tensor) -> Tensor:
        p = gates.probs(layer, pooled)
        if record is not None:
            record.append(p)
        return gates.head_scales(p)

    return Intervention.all_heads(model, Gate(scales, attention_mask))


def mae_hooks(
    model: TransformerBridge, gates: MAEGates, attention_mask: Tensor, record: list | None = None
) -> list[Any]:
    """``fwd_hooks`` of :func:`mae_intervention`."""
    return hooks(model, [mae_intervention(model, gates, attention_mask, record)])


def _loss(
    model: TransformerBridge, task: Task, batch: ProbeBatch, ref: Any, gates: MAEGates | None
) -> Tensor:
    mask = batch.attention_mask.to(model_device(model))
    ivs = [] if gates is None else [mae_intervention(model, gates, mask)]
    with applied(model, ivs):
        s, c = task.metric(model, batch, reference=ref)
    return s.sum() / c.sum()


def _metric(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    refs: Sequence[Any],
    gates: MAEGates | None,
) -> float:
    with torch.no_grad():
        vals = [float(_loss(model, task, b, r, gates)) for b, r in zip(batches, refs, strict=True)]
    return sum(vals) / len(vals)


def _steps(
    model: TransformerBridge,
    opt: torch.optim.Optimizer,
    task: Task,
    data: Sequence[tuple[ProbeBatch, Any]],
    gates: MAEGates | None,
    start: int,
    n: int,
    phase: float,
) -> list[dict[str, float]]:
    curve = []
    for k in range(start, start + n):
        batch, ref = data[k % len(data)]
        loss = _loss(model, task, batch, ref, gates)
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append({"phase": phase, "loss": float(loss.detach())})
    return curve


def train_mae(
    model: TransformerBridge,
    gates: MAEGates | None,
    task: Task,
    batches: Sequence[ProbeBatch],
    refs: Sequence[Any],
    *,
    rounds: int = 4,
    gate_steps: int = 5,
    model_steps: int = 5,
    lr_gate: float = 1e-2,
    lr_model: float = 1e-4,
) -> list[dict[str, float]]:
    """Block coordinate descent, in place: per round, ``gate_steps`` gate-network steps
    (model frozen), then ``model_steps`` model steps (gates frozen). With ``gates=None``
    only the model steps run (the equal-compute fine-tuning baseline).

    Returns:
        The loss curve: one ``{"phase": 0 (gates) | 1 (model), "loss"}`` per step.
    """
    data = list(zip(batches, refs, strict=True))
    opt_m = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr_model)
    opt_g = torch.optim.Adam(gates.parameters(), lr=lr_gate) if gates is not None else None
    curve: list[dict[str, float]] = []
    for _ in range(rounds):
        if gates is not None and opt_g is not None:
            with frozen(model):
                curve += _steps(model, opt_g, task, data, gates, len(curve), gate_steps, 0.0)
            gates.requires_grad_(False)
        try:
            curve += _steps(model, opt_m, task, data, gates, len(curve), model_steps, 1.0)
        finally:
            if gates is not None:
                gates.requires_grad_(True)
    return curve


@dataclass
class MAEOptions:
    """Options of :func:`compare_mae` / :func:`mae_prune`.

    Attributes:
        n_eval_batches: the probe's last batches, held out for the comparison.
        rounds, gate_steps, model_steps: block coordinate descent schedule.
        lr_gate, lr_model: Adam learning rates of the gate networks and the model.
        d_hidden: width of the gate networks.
        seed: draws the gate networks' first layer.
    """

    n_eval_batches: int = 1
    rounds: int = 4
    gate_steps: int = 5
    model_steps: int = 5
    lr_gate: float = 1e-2
    lr_model: float = 1e-4
    d_hidden: int = 32
    seed: int = 0


@dataclass
class MAEComparison:
    """Held-out task metric (lower is better) of the base, MAE and fine-tuned models."""

    base: float
    mae: float
    finetuned: float
    model_steps: int
    gate_steps: int
    mae_curve: list[dict[str, float]] = field(default_factory=list)
    finetune_curve: list[dict[str, float]] = field(default_factory=list)
    gates: MAEGates | None = None

    @property
    def mae_improves(self) -> bool:
        """MAE beats the equal-model-steps fine-tuned baseline."""
        return self.mae < self.finetuned


def compare_mae(
    model: TransformerBridge,
    task: str | Task = "lm",
    *,
    probe_options: ProbeOptions | None = None,
    **options: Any,
) -> MAEComparison:
    """Train MAE gates plus the model, and fine-tune the base model for the same number of
    model steps without gates; compare all three on held-out probe batches.

    The probe's last ``n_eval_batches`` batches are held out. The model's weights are
    restored afterwards (both runs start from them). ``options``: fields of
    :class:`MAEOptions`. Peng et al. 2020's method (module docstring).
    """
    try:
        o = MAEOptions(**options)
    except TypeError as e:
        raise HeadmechError(f"mae: {e}") from None
    t = get_task(task, model)
    batches = t.batches(model, probe_options or ProbeOptions(n_sentences=32, batch_size=8))
    if len(batches) <= o.n_eval_batches:
        raise ValueError("the probe needs more batches than n_eval_batches")
    train, held = batches[: -o.n_eval_batches], batches[-o.n_eval_batches :]
    with torch.no_grad():
        train_refs = [t.reference(model, b) for b in train]
        held_refs = [t.reference(model, b) for b in held]
    saved = [p.detach().clone() for p in model.parameters()]
    kw: dict[str, Any] = dict(rounds=o.rounds, gate_steps=o.gate_steps, model_steps=o.model_steps)
    kw.update(lr_gate=o.lr_gate, lr_model=o.lr_model)
    cfg = model.cfg
    g = torch.Generator().manual_seed(o.seed)
    gates = MAEGates(int(cfg.n_layers), int(cfg.n_heads), int(cfg.d_model), o.d_hidden, g)
    gates = gates.to(model_device(model))
    base = _metric(model, t, held, held_refs, None)

    # the MAE run and the fine-tuned baseline are units of a resumable run
    # (headmech.runs.resume); each starts from the saved weights
    def run_mae() -> dict[str, Any]:
        curve = train_mae(model, gates, t, train, train_refs, **kw)
        metric = _metric(model, t, held, held_refs, gates)
        return {"curve": curve, "metric": metric, "gates": gates.state_dict()}

    def run_finetune() -> dict[str, Any]:
        curve = train_mae(model, None, t, train, train_refs, **kw)
        return {"curve": curve, "metric": _metric(model, t, held, held_refs, None)}

    try:
        done = unit("mae", run_mae)
        gates.load_state_dict(done["gates"])
        mae_curve, mae = done["curve"], done["metric"]
        _restore(model, saved)
        done = unit("finetune", run_finetune)
        ft_curve, finetuned = done["curve"], done["metric"]
    finally:
        _restore(model, saved)
    return MAEComparison(
        base, mae, finetuned, o.rounds * o.model_steps, o.rounds * o.gate_steps,
        mae_curve, ft_curve, gates,
    )  # fmt: skip


def _restore(model: TransformerBridge, saved: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved, strict=True):
            p.copy_(s)


def mae_prune(
    model: TransformerBridge,
    task: str | Task = "lm",
    *,
    probe_options: ProbeOptions | None = None,
    catalog: HeadCatalog | None = None,
    progress: bool = False,
    **options: Any,
) -> PruningResult:
    """:func:`compare_mae` as a :class:`~headmech.pruning.result.PruningResult`: no
    pruning steps (MAE gates mix heads, they do not remove them); the held-out comparison
    in ``extra["comparison"]`` and ``extra["mae_improves"]``."""
    t = get_task(task, model)
    c = compare_mae(model, t, probe_options=probe_options, **options)
    comparison = {"base": c.base, "mae": c.mae, "finetuned": c.finetuned}
    comparison["model_steps"] = c.model_steps
    from headmech.runs.provenance import provenance

    result = PruningResult("mae", t.name, [], metric=t.description)
    result.model = model_name(model)
    settings = {"method": "mae", "task": t.name, **asdict(MAEOptions(**options))}
    result.provenance = provenance(model, options=probe_options, settings=settings)
    result.extra = {
        "comparison": comparison,
        "mae_improves": c.mae_improves,
        "options": asdict(MAEOptions(**options)),
    }
    return result
