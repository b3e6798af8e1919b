"""The Hard Concrete distribution (Louizos et al. 2018) with Voita et al. 2019's defaults.

* training sample: ``u ~ U(ε, 1 − ε)``, ``s = σ((log u − log(1 − u) + log α) / β)``,
  ``s̄ = s (ζ − γ) + γ``, ``g = clip(s̄, 0, 1)``;
* evaluation: ``g = clip(σ(log α)(ζ − γ) + γ, 0, 1)``;
* ``P(g ≠ 0) = σ(log α − β log(−γ / ζ))``.

References:
    Louizos, Welling, Kingma 2018, "Learning Sparse Neural Networks through L0
    Regularization", ICLR.
    Voita et al. 2019, ACL (code: lena-voita/the-story-of-heads, ``concrete_gate.py``).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = [
    "BETA",
    "EPS",
    "GAMMA",
    "ZETA",
    "hard_concrete_eval",
    "hard_concrete_sample",
    "prob_nonzero",
]

BETA = 0.33
GAMMA = -0.1
ZETA = 1.1
EPS = 1e-6


def hard_concrete_sample(
    log_alpha: Float[Tensor, "*shape"],
    beta: float = BETA,
    gamma: float = GAMMA,
    zeta: float = ZETA,
    eps: float = EPS,
    generator: torch.Generator | None = None,
) -> Float[Tensor, "*shape"]:
    """One reparametrised training sample of the Hard Concrete gates (in ``[0, 1]``).

    References:
        Voita et al. 2019; Louizos et al. 2018 (module docstring).
    """
    u = torch.rand(log_alpha.shape, generator=generator, dtype=log_alpha.dtype)
    u = u.to(log_alpha.device) * (1 - 2 * eps) + eps  # U(eps, 1 - eps)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / beta)
    return (s * (zeta - gamma) + gamma).clamp(0.0, 1.0)


def hard_concrete_eval(
    log_alpha: Float[Tensor, "*shape"], gamma: float = GAMMA, zeta: float = ZETA
) -> Float[Tensor, "*shape"]:
    """The deterministic evaluation gate ``clip(σ(log α)(ζ − γ) + γ, 0, 1)``."""
    return (torch.sigmoid(log_alpha) * (zeta - gamma) + gamma).clamp(0.0, 1.0)


def prob_nonzero(
    log_alpha: Float[Tensor, "*shape"], beta: float = BETA, gamma: float = GAMMA, zeta: float = ZETA
) -> Float[Tensor, "*shape"]:
    """``P(g ≠ 0) = σ(log α − β log(−γ / ζ))``, the expected L0 norm of each gate."""
    return torch.sigmoid(log_alpha - beta * math.log(-gamma / zeta))
