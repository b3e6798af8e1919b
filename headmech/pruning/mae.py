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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from headmech.engine import ProbeBatch
from headmech.probes import ProbeOptions
from headmech.pruning.l0 import frozen
from headmech.tasks import Task, get_task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["MAEComparison", "MAEGates", "compare_mae", "mae_hooks", "train_mae"]

Hook = tuple[str, Callable[..., Tensor | None]]


class MAEGates(nn.Module):
    """Per-layer gate networks ``p = softmax(W₂ tanh(W₁ x̄ + b₁) + b₂)`` over the n experts."""

    def __init__(self, n_layers: int, n_heads: int, d_model: int, d_hidden: int = 32) -> None:
        super().__init__()
        if n_heads < 2:
            raise ValueError("a mixture of h - 1 heads needs at least 2 heads")
        self.n_heads = n_heads
        self.w1 = nn.Parameter(torch.randn(n_layers, d_model, d_hidden) / d_model**0.5)
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


def mae_hooks(
    model: TransformerBridge, gates: MAEGates, attention_mask: Tensor, record: list | None = None
) -> list[Hook]:
    """Hooks that compute each layer's expert weights from its mean-pooled input and scale
    its heads' ``hook_z``; ``record`` (if given) receives each layer's ``p``."""
    state: dict[int, Tensor] = {}
    m = attention_mask[..., None].float()  # [batch, pos, 1]
    hooks: list[Hook] = []
    for layer in range(int(model.cfg.n_layers)):

        def read(resid: Tensor, hook: Any, layer: int = layer) -> None:
            # resid: [batch, pos, d_model]
            pooled = (resid.float() * m).sum(1) / m.sum(1)
            p = gates.probs(layer, pooled)
            if record is not None:
                record.append(p)
            state[layer] = gates.head_scales(p)

        def scale(z: Tensor, hook: Any, layer: int = layer) -> Tensor:
            # z: [batch, pos, head_index, d_head]
            return z * state[layer].to(z.dtype)[:, None, :, None]

        hooks += [(f"blocks.{layer}.hook_in", read), (f"blocks.{layer}.attn.hook_z", scale)]
    return hooks


def _device(model: TransformerBridge) -> torch.device:
    return next(model.parameters()).device


def _loss(
    model: TransformerBridge, task: Task, batch: ProbeBatch, ref: Any, gates: MAEGates | None
) -> Tensor:
    hooks = (
        [] if gates is None else mae_hooks(model, gates, batch.attention_mask.to(_device(model)))
    )
    s, c = task.damage(model, batch, hooks, reference=ref)
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
    params = [p for p in model.parameters() if p.requires_grad]
    opt_m = torch.optim.Adam(params, lr=lr_model)
    opt_g = torch.optim.Adam(gates.parameters(), lr=lr_gate) if gates is not None else None
    curve: list[dict[str, float]] = []
    k = 0
    for _ in range(rounds):
        if gates is not None and opt_g is not None:
            with frozen(model):
                for _ in range(gate_steps):
                    i = k % len(batches)
                    k += 1
                    loss = _loss(model, task, batches[i], refs[i], gates)
                    opt_g.zero_grad()
                    loss.backward()
                    opt_g.step()
                    curve.append({"phase": 0.0, "loss": float(loss.detach())})
        if gates is not None:
            gates.requires_grad_(False)
        try:
            for _ in range(model_steps):
                i = k % len(batches)
                k += 1
                loss = _loss(model, task, batches[i], refs[i], gates)
                opt_m.zero_grad()
                loss.backward()
                opt_m.step()
                curve.append({"phase": 1.0, "loss": float(loss.detach())})
        finally:
            if gates is not None:
                gates.requires_grad_(True)
    return curve


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
    n_eval_batches: int = 1,
    rounds: int = 4,
    gate_steps: int = 5,
    model_steps: int = 5,
    lr_gate: float = 1e-2,
    lr_model: float = 1e-4,
    d_hidden: int = 32,
    seed: int = 0,
) -> MAEComparison:
    """Train MAE gates plus the model, and fine-tune the base model for the same number of
    model steps without gates; compare all three on held-out probe batches.

    The probe's last ``n_eval_batches`` batches are held out. The model's weights are
    restored afterwards (both runs start from them).

    References:
        Peng et al. 2020, ACL (module docstring).
    """
    t = get_task(task, model)
    batches = t.batches(model, probe_options or ProbeOptions(n_sentences=32, batch_size=8))
    if len(batches) <= n_eval_batches:
        raise ValueError("the probe needs more batches than n_eval_batches")
    train, held = batches[:-n_eval_batches], batches[-n_eval_batches:]
    with torch.no_grad():
        train_refs = [t.reference(model, b) for b in train]
        held_refs = [t.reference(model, b) for b in held]
    saved = [p.detach().clone() for p in model.parameters()]
    kw = dict(rounds=rounds, gate_steps=gate_steps, model_steps=model_steps)
    torch.manual_seed(seed)
    gates = MAEGates(
        int(model.cfg.n_layers), int(model.cfg.n_heads), int(model.cfg.d_model), d_hidden
    ).to(_device(model))
    base = _metric(model, t, held, held_refs, None)
    try:
        mae_curve = train_mae(
            model, gates, t, train, train_refs, lr_gate=lr_gate, lr_model=lr_model, **kw
        )
        mae = _metric(model, t, held, held_refs, gates)
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved, strict=True):
                p.copy_(s)
        ft_curve = train_mae(
            model, None, t, train, train_refs, lr_gate=lr_gate, lr_model=lr_model, **kw
        )
        finetuned = _metric(model, t, held, held_refs, None)
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved, strict=True):
                p.copy_(s)
    return MAEComparison(
        base=base,
        mae=mae,
        finetuned=finetuned,
        model_steps=rounds * model_steps,
        gate_steps=rounds * gate_steps,
        mae_curve=mae_curve,
        finetune_curve=ft_curve,
        gates=gates,
    )
