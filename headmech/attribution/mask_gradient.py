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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.engine import ProbeBatch
from headmech.interventions import Cost, gradients
from headmech.tasks import Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["mask_gradient", "mask_gradient_importance", "masked_importance"]


def masked_importance(
    model: TransformerBridge,
    task: Task,
    batch: ProbeBatch,
    mask: Float[Tensor, "n_layers n_heads"],
    *,
    reference: Any = None,
    per_token: bool = True,
) -> tuple[Tensor, Tensor, float, float]:
    """One batch's ``∂L/∂ξ`` at ξ = ``mask``: ``(signed [n_layers, n_heads], absolute
    [n_layers, n_heads], metric sum, count)``; ``absolute`` sums ``|∂L/∂ξ_h|`` per token
    (``per_token``) or takes the batch's ``|∂L/∂ξ_h|``."""
    dev = next(model.parameters()).device
    xi = mask.to(dev).float().clone().requires_grad_(True)
    z, grad, s, c = gradients(model, task, batch, reference=reference, scale=xi)
    assert xi.grad is not None
    g = xi.grad.detach().double().cpu()
    if per_token:
        # grad is w.r.t. ξ·z; with ξ = 1, ∂L/∂ξ_h = Σ_t z_t · ∂L/∂(ξz)_t
        per_tok = (z * grad).sum(-1)  # [n_layers, batch, pos, n_heads]
        real = batch.attention_mask.to(dev).bool()[None, :, :, None]
        absolute = (per_tok.abs() * real).sum((1, 2)).double().cpu()
    else:
        absolute = g.abs()
    return g, absolute, float(s), float(c)


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
    metric, n_units, n_tokens = 0.0, 0.0, 0
    it: Any = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(
            batches, desc=progress if isinstance(progress, str) else "mask gradient", leave=False
        )
    ones = torch.ones(n_layers, n_heads)
    for batch in it:
        ref = task.reference(model, batch)
        g, a, s, c = masked_importance(model, task, batch, ones, reference=ref, per_token=per_token)
        signed += g
        absolute += a
        metric += s
        n_units += c
        n_tokens += batch.n_tokens
        if cost is not None:
            cost.add(int(batch.input_ids.shape[0]), backward=True)
    return (
        signed / max(n_units, 1.0),
        absolute / max(n_tokens, 1),
        metric / max(n_units, 1.0),
        n_units,
    )


def mask_gradient(
    model: TransformerBridge, task: Task, batches: Sequence[ProbeBatch]
) -> Float[Tensor, "n_layers n_heads"]:
    """The signed gradient ``∂D/∂ξ`` of the task's mean (gradient) metric at ξ = 1."""
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
        cost: accumulates the compute spent.
        progress: a tqdm bar over batches.

    Returns:
        ``(importance [n_layers, n_heads], clean metric)``; the loss is summed over the
        task's units (tokens or sequences) and importance divided by the real tokens.
    """
    _, score, metric, _ = _run(model, task, batches, per_token, cost, progress)
    if normalize_layers:
        score = score / (score.norm(dim=1, keepdim=True) + 1e-20)
    return score.float(), metric
