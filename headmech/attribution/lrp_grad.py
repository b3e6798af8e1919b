"""Gradient surgery for the AttnLRP rules: change a gradient, keep the forward value.

The rules of :data:`headmech.attribution.lrp_rules.RULES` install these as forward hooks.
Each returns a tensor whose value is the module's output, bit for bit, and whose backward
applies the rule's modified local gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

__all__ = [
    "GradScale",
    "Slope",
    "SwapGrad",
    "activation_identity_forward",
    "norm_identity_forward",
    "norm_surrogate",
]


class GradScale(torch.autograd.Function):
    """Identity forward; gradient multiplied by a constant."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class SwapGrad(torch.autograd.Function):
    """Forward value of ``value``; gradient routed to ``surrogate`` instead.

    Lets a rule change a gradient without recomputing the forward value, so outputs stay
    bit-identical to the unmodified model.
    """

    @staticmethod
    def forward(ctx: Any, value: Tensor, surrogate: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, grad


class Slope(torch.autograd.Function):
    """Forward value of ``value``; gradient to ``x`` is ``grad * slope`` (a constant)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Tensor, slope: Tensor) -> Tensor:
        ctx.save_for_backward(slope)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    if args and isinstance(args[0], Tensor):
        return args[0]
    x = kwargs.get("hidden_states", kwargs.get("input"))
    return x if isinstance(x, Tensor) else None


def _norm_eps(module: Any, orig: nn.Module) -> Any:
    eps: Any = getattr(orig, "eps", None)
    if eps is None:
        eps = getattr(orig, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module.config, "eps", 1e-5)
    return eps


def norm_surrogate(module: Any, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
    """The norm's output with its 1/std (1/rms) factor detached: the identity rule."""
    orig = module.original_component
    if isinstance(orig, nn.Identity):
        return x
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    xc = xf if module.uses_rms_norm else xf - xf.mean(-1, keepdim=True)
    inv = torch.rsqrt(xc.detach().pow(2).mean(-1, keepdim=True) + _norm_eps(module, orig))
    y = xc * inv
    weight = getattr(orig, "weight", None)
    if isinstance(weight, Tensor):
        y = y * ((1.0 + weight) if module.uses_weight_offset else weight)
    bias = getattr(orig, "bias", None)
    if isinstance(bias, Tensor):
        y = y + bias
    return y.to(x.dtype)


def norm_identity_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of the norm identity rule: same output, surrogate's gradient."""
    x = _first_tensor(args, kwargs)
    if x is None or not isinstance(output, Tensor) or not torch.is_grad_enabled():
        return None
    return SwapGrad.apply(output, norm_surrogate(module, x))


def activation_identity_forward(module: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook of the activation identity rule: same output, gradient ``f(x)/x``."""
    if not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
        return None
    if not torch.is_grad_enabled():
        return None
    x = args[0]
    with torch.no_grad():
        # f(x)/x; where x == 0 the relevance x * grad is 0 whatever the slope
        slope = output / torch.where(x == 0, torch.ones_like(x), x)
        slope = torch.where(x == 0, torch.zeros_like(slope), slope)
    return Slope.apply(x, output, slope)
