"""Mask-gradient head importance (Michel et al. 2019).

Give every head a mask variable ξ_h multiplying its output, ``MHAtt = Σ_h ξ_h Att_h``,
and read importance off the gradient at ξ = 1: ``I_h = E_x |∂L(x)/∂ξ_h|``, a first-order
Taylor estimate of what zeroing the head would do (Molchanov et al. 2017). Since
``∂L/∂ξ_h = Σ_t Att_h(x)_t · ∂L/∂Att_h(x)_t``, the original code takes the absolute value
*per token* ``t`` before summing (``einsum("bhli,bhli->bhl", grad_ctx, ctx).abs()``) and
divides by the token count; HuggingFace's bertology script takes ``|∂L/∂ξ|`` per batch
instead. Both are here (``per_token``), with the optional ℓ2 normalisation per layer.
One forward and one backward pass per batch score every head.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS
    (code: pmichel31415/are-16-heads-really-better-than-1, ``calculate_head_importance``).
    Molchanov et al. 2017, "Pruning Convolutional Neural Networks for Resource Efficient
    Inference", ICLR.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.attribution.ablation import Cost
from headmech.attribution.patching import z_gradients
from headmech.engine import ProbeBatch
from headmech.tasks import Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["head_mask_hooks", "mask_gradient", "mask_gradient_importance"]


def head_mask_hooks(
    mask: Float[Tensor, "n_layers n_heads"],
) -> list[tuple[str, Callable[..., Tensor]]]:
    """Hooks multiplying each head's output by ``mask[layer, head]`` (ξ)."""

    def make(layer: int) -> Callable[..., Tensor]:
        def hook(z: Tensor, hook: Any) -> Tensor:
            # z: [batch, pos, head_index, d_head]
            return z * mask[layer].to(z)[None, None, :, None]

        return hook

    return [(f"blocks.{la}.attn.hook_z", make(la)) for la in range(mask.shape[0])]


def _run(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    per_token: bool,
    cost: Cost | None,
    progress: bool | str,
) -> tuple[Tensor, Tensor, float, float]:
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    signed = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    absolute = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    damage, n_units, n_tokens = 0.0, 0.0, 0
    it: Any = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(
            batches, desc=progress if isinstance(progress, str) else "mask gradient", leave=False
        )
    dev = next(model.parameters()).device
    for batch in it:
        xi = torch.ones(n_layers, n_heads, device=dev, requires_grad=True)
        z, grad, s, c = z_gradients(model, task, batch, linear=True, head_mask=xi)
        assert xi.grad is not None
        g = xi.grad.detach().double().cpu()
        signed += g
        if per_token:
            # grad is w.r.t. ξ·z; with ξ = 1, ∂L/∂ξ_h = Σ_t z_t · ∂L/∂(ξz)_t
            per_tok = (z * grad).sum(-1)  # [n_layers, batch, pos, n_heads]
            real = batch.attention_mask.to(dev).bool()[None, :, :, None]
            absolute += (per_tok.abs() * real).sum((1, 2)).double().cpu()
        else:
            absolute += g.abs()
        damage += float(s)
        n_units += float(c)
        n_tokens += batch.n_tokens
        if cost is not None:
            cost.add(int(batch.input_ids.shape[0]), backward=True)
    return (
        signed / max(n_units, 1.0),
        absolute / max(n_tokens, 1),
        damage / max(n_units, 1.0),
        n_units,
    )


def mask_gradient(
    model: TransformerBridge, task: Task, batches: Sequence[ProbeBatch]
) -> Float[Tensor, "n_layers n_heads"]:
    """The signed gradient ``∂D/∂ξ`` of the task's mean (gradient) damage at ξ = 1."""
    return _run(model, task, batches, False, None, False)[0].float()


def mask_gradient_importance(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    *,
    per_token: bool = True,
    normalize_layers: bool = False,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, "n_layers n_heads"], float]:
    """Michel et al.'s head importance ``E|∂L/∂ξ_h|``.

    Args:
        model: a ``TransformerBridge``.
        task: what the loss ``L`` is (its gradient metric: see :mod:`headmech.tasks`).
        batches: probe batches.
        per_token: absolute value per token (the original code) rather than per batch.
        normalize_layers: divide each layer's scores by their ℓ2 norm.

    Returns:
        ``(importance [n_layers, n_heads], clean damage)``; the loss is summed over the
        task's units (tokens or sequences) and importance divided by the real tokens.
    """
    _, score, damage, _ = _run(model, task, batches, per_token, cost, progress)
    if normalize_layers:
        score = score / (score.norm(dim=1, keepdim=True) + 1e-20)
    return score.float(), damage
