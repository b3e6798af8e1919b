"""Mask-gradient head importance (Michel et al. 2019).

Give every head a mask variable ξ_h multiplying its output, ``MHAtt = Σ_h ξ_h Att_h``,
and read importance off the gradient at ξ = 1: ``I_h = E_x |∂L(x)/∂ξ_h|``, a first-order
Taylor estimate of what zeroing the head would do (Molchanov et al. 2017). The paper's
definition takes the absolute value **per example** ``x`` (here: per probe sequence, with
``L(x)`` the task's mean loss on that sequence): the default, ``per="example"``, computed
in one forward and backward pass per batch with one ξ per sequence. Two variants are
kept: ``per="token"`` takes it per token ``t`` (``∂L/∂ξ_h = Σ_t Att_h(x)_t ·
∂L/∂Att_h(x)_t``; the released code's ``einsum("bhli,bhli->bhl", grad_ctx, ctx).abs()``,
divided by the token count), and ``per="batch"`` per batch (HuggingFace's bertology
script's ``|∂L/∂ξ|``). The optional ℓ2 normalisation per layer is the paper's.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS
    (code: pmichel31415/are-16-heads-really-better-than-1, ``calculate_head_importance``).
    Molchanov et al. 2017, "Pruning Convolutional Neural Networks for Resource Efficient
    Inference", ICLR.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core import distributed
from headmech.core.errors import HeadmechError
from headmech.core.placement import model_device
from headmech.interventions import Cost, gradients
from headmech.runs import resume
from headmech.stream.engine import ProbeBatch
from headmech.stream.uncertainty import UnitValues
from headmech.tasks import Task

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["PER", "mask_gradient", "mask_gradient_importance", "masked_importance"]

PER = ("example", "token", "batch")


def masked_importance(
    model: TransformerBridge,
    task: Task,
    batch: ProbeBatch,
    mask: Float[Tensor, "n_layers n_heads"],
    *,
    reference: Any = None,
    per: str = "example",
) -> tuple[Tensor, UnitValues, float, float]:
    """One batch's mask gradient at ξ = ``mask``.

    Returns:
        ``(signed ∂L/∂ξ summed over the batch [n_layers, n_heads], |∂L/∂ξ| as unit values
        (per sequence, or one unit for the batch), metric sum, count)``.
    """
    if per not in PER:
        raise HeadmechError(f"per must be one of {', '.join(PER)}, got '{per}'")
    dev = model_device(model)
    n_seq = int(batch.input_ids.shape[0])
    if per == "example":
        xi = mask.to(dev).float()[None].repeat(n_seq, 1, 1).requires_grad_(True)
    else:
        xi = mask.to(dev).float().clone().requires_grad_(True)
    z, grad, s, c = gradients(model, task, batch, reference=reference, scale=xi)
    assert xi.grad is not None
    g = xi.grad.detach().double().cpu()
    if per == "example":  # [batch, n_layers, n_heads]; L(x) is the sequence's mean loss
        units = c.double().cpu() if c.numel() == n_seq else torch.ones(n_seq, dtype=torch.float64)
        absolute = UnitValues(g.abs() / units.clamp(min=1)[:, None, None], torch.ones(n_seq))
        signed = g.sum(0)
    elif per == "token":
        # grad is w.r.t. ξ·z; with ξ = 1, ∂L/∂ξ_h = Σ_t z_t · ∂L/∂(ξz)_t
        per_tok = (z * grad).sum(-1)  # [n_layers, batch, pos, n_heads]
        real = batch.attention_mask.to(dev).bool()[None, :, :, None]
        num = (per_tok.abs() * real).sum(2).double().cpu().permute(1, 0, 2)  # [batch, L, H]
        absolute = UnitValues(num, batch.attention_mask.sum(1).double())
        signed = g
    else:
        absolute = UnitValues(g.abs()[None], torch.tensor([float(batch.n_tokens)]))
        signed = g
    return signed, absolute, float(s.sum()), float(c.sum())


def _run(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    per: str,
    cost: Cost | None,
    progress: bool | str,
) -> tuple[Tensor, UnitValues, float]:
    """Every batch's mask gradient; under ``torchrun`` each rank runs its share of the
    batches and the per-sequence parts are gathered in batch order on every rank."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    nums: dict[int, Tensor] = {}
    dens: dict[int, Tensor] = {}
    totals: dict[int, Tensor] = {}  # per batch, one row: signed gradient, metric sum, count
    mine: Any = distributed.mine(len(batches))
    if progress and distributed.is_main():
        from tqdm.auto import tqdm

        desc = progress if isinstance(progress, str) else "mask gradient"
        mine = tqdm(mine, desc=desc, leave=False)
    ones = torch.ones(n_layers, n_heads)

    def one(i: int) -> tuple[Tensor, Tensor, Tensor]:
        batch = batches[i]
        ref = task.reference(model, batch)
        g, a, s, c = masked_importance(model, task, batch, ones, reference=ref, per=per)
        if cost is not None:
            cost.add(int(batch.input_ids.shape[0]), backward=True)
        row = torch.cat([g.flatten(), torch.tensor([s, c], dtype=torch.float64)])[None]
        return a.num, a.den, row

    with resume.scope("mask_gradient"):  # each batch a unit of a resumable run
        for i in mine:
            nums[i], dens[i], totals[i] = resume.unit(f"batch{i}", partial(one, i))
    if not totals:
        raise HeadmechError("no batches to score")
    n = len(batches)
    units = UnitValues(distributed.gather_rows(nums, n), distributed.gather_rows(dens, n))
    total = distributed.gather_rows(totals, n).sum(0)
    signed, metric, n_units = total[:-2].view(n_layers, n_heads), float(total[-2]), float(total[-1])
    return signed / max(n_units, 1.0), units, metric / max(n_units, 1.0)


def mask_gradient(
    model: TransformerBridge, task: Task, batches: Sequence[ProbeBatch]
) -> Float[Tensor, "n_layers n_heads"]:
    """The signed gradient ``∂D/∂ξ`` of the task's mean (gradient) metric at ξ = 1."""
    return _run(model, task, batches, "batch", None, False)[0].float()


def mask_gradient_importance(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    *,
    per: str = "example",
    normalize_layers: bool = False,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, "n_layers n_heads"], float, UnitValues]:
    """Michel et al.'s head importance ``E_x |∂L(x)/∂ξ_h|``.

    Args:
        model: a ``TransformerBridge``.
        task: what the loss ``L`` is (its gradient metric: see :mod:`headmech.tasks`).
        batches: probe batches.
        per: where the absolute value is taken: ``example`` (the paper's definition),
            ``token`` (the released code) or ``batch`` (the bertology script).
        normalize_layers: divide each layer's scores by their ℓ2 norm.
        cost: accumulates the compute spent.
        progress: a tqdm bar over batches.

    Returns:
        ``(importance [n_layers, n_heads], clean metric, per-unit values)``; the unit
        values give the bootstrap interval (before any layer normalisation).
    """
    _, units, metric = _run(model, task, batches, per, cost, progress)
    score = units.point()
    if normalize_layers:
        score = score / (score.norm(dim=1, keepdim=True) + 1e-20)
    return score.float(), metric, units
