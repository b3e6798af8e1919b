"""Effects: what an intervention does to the heads it selects.

Every effect works in one layout, heads first — ``[batch, head_index, pos, d_head]`` for
z/q/k/v, ``[batch, head_index, query_pos, key_pos]`` for the pattern — reached from the
hook's own layout with :func:`einops.rearrange`; ``apply`` returns the new value of the
selected heads (same shape), never writing into its input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from einops import rearrange
from torch import Tensor

__all__ = [
    "SITES",
    "Context",
    "Effect",
    "Gate",
    "Mean",
    "Patch",
    "Scale",
    "Set",
    "Tap",
    "Uniform",
    "Zero",
    "heads_first",
]

Site = Literal["z", "pattern", "q", "k", "v"]
SITES: dict[str, str] = {
    "z": "attn.hook_z",  # [batch, pos, head_index, d_head]
    "pattern": "attn.hook_pattern",  # [batch, head_index, query_pos, key_pos]
    "q": "attn.hook_q",  # [batch, pos, head_index, d_head]
    "k": "attn.hook_k",  # [batch, pos, kv_head_index, d_head]
    "v": "attn.hook_v",  # [batch, pos, kv_head_index, d_head]
}


def heads_first(x: Tensor, site: str) -> Tensor:
    """The site's activation as a view with heads on dim 1 (writes reach ``x``)."""
    return x if site == "pattern" else rearrange(x, "b p h d -> b h p d")


@dataclass
class Context:
    """What an effect may need besides the activation: the model's masking rule and
    per-forward state filled by read hooks (a gate's layer input)."""

    causal: bool
    layer_inputs: dict[int, Tensor] = field(default_factory=dict)


class Effect:
    """What happens to the selected heads; subclasses override :meth:`apply`.

    ``apply(x, layer, idx, ctx)`` receives the selected heads of one variant, heads first
    (``[batch, len(idx), ...]``), and returns their new value (same shape). ``sites``
    lists the sites the effect is defined on.
    """

    sites: tuple[str, ...] = ("z", "pattern", "q", "k", "v")
    reads_layer_input: bool = False

    def apply(self, x: Tensor, layer: int, idx: Tensor, ctx: Context) -> Tensor:
        """The new value of the selected heads ``x`` (heads first, ``[batch, len(idx),
        ...]``) of layer ``layer``; ``idx`` are their head indices."""
        raise NotImplementedError


@dataclass(frozen=True)
class Zero(Effect):
    """The activation becomes 0 (zero ablation; Michel et al.'s ξ_h = 0 on ``z``)."""

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        return torch.zeros_like(x)


@dataclass(frozen=True, eq=False)
class Mean(Effect):
    """Each head's output becomes its mean over a probe, ``values[layer, head]``
    (``Float[n_layers, n_heads, d_head]``, from :func:`mean_outputs`)."""

    values: Tensor
    sites = ("z", "q", "k", "v")

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        v = self.values[layer].to(x)[idx.to(self.values.device)]  # [n_sel, d_head]
        return v[None, :, None, :].expand_as(x)


@dataclass(frozen=True, eq=False)
class Patch(Effect):
    """The activation becomes another run's at the same site: ``source[layer]`` is that
    run's full activation in the hook's own layout (``[batch, pos, n_heads, d_head]`` for z;
    from :func:`capture`). Activation patching and resampling ablation."""

    source: Tensor | Sequence[Tensor] | dict[int, Tensor]
    site: str = "z"

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        src = heads_first(self.source[layer].to(x), self.site)
        return src[:, idx.to(src.device)].expand_as(x)


@dataclass(frozen=True, eq=False)
class Set(Effect):
    """The activation becomes ``value``, heads first and broadcastable to the selection
    (e.g. a planted pattern ``[batch, 1, query_pos, key_pos]``)."""

    value: Tensor

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        return self.value.to(x).expand_as(x)


@dataclass(frozen=True)
class Uniform(Effect):
    """Uniform attention over every key the query may see (Wu et al. 2024 mask retrieval
    heads this way): causal models, keys up to the query; encoders, the real keys."""

    sites = ("pattern",)

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        n_q, n_k = x.shape[-2:]
        if ctx.causal:  # keys up to the query (offset for cached keys)
            allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=x.device).tril(n_k - n_q)
            allowed = allowed[None, None]
        else:  # real keys: padding gets exactly zero weight from every head
            allowed = (x > 0).any(1, keepdim=True)
        u = allowed.to(x.dtype)
        return (u / u.sum(-1, keepdim=True).clamp(min=1)).expand_as(x)


@dataclass(frozen=True, eq=False)
class Scale(Effect):
    """The activation is multiplied by ``values[layer, head]`` (``[n_layers, n_heads]``,
    or ``[batch, n_layers, n_heads]`` per sequence); gradients reach ``values`` when it
    requires them. Head masks, Michel et al.'s ξ, L0 gates."""

    values: Tensor

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        v = self.values[..., layer, :][..., idx.to(self.values.device)].to(x.dtype)
        v = v.to(x.device)
        if v.dim() == 1:  # [n_sel]
            return x * v[None, :, None, None]
        return x * v[:, :, None, None]  # [batch, n_sel]


@dataclass(frozen=True, eq=False)
class Gate(Effect):
    """An input-dependent multiplier: ``fn(layer, pooled)`` maps the mean-pooled layer input
    (``blocks.{l}.hook_in`` over real tokens, ``[batch, d_model]``) to ``[batch, n_heads]``
    scales (Peng et al. 2020's mixture of h − 1 heads)."""

    fn: Callable[[int, Tensor], Tensor]
    attention_mask: Tensor
    sites = ("z",)
    reads_layer_input = True

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        resid = ctx.layer_inputs[layer]  # [batch, pos, d_model]
        m = self.attention_mask.to(resid.device)[..., None].float()
        pooled = (resid.float() * m).sum(1) / m.sum(1)
        scale = self.fn(layer, pooled)[:, idx.to(pooled.device)]  # [batch, n_sel]
        return x * scale.to(x.dtype)[:, :, None, None]


@dataclass(frozen=True, eq=False)
class Tap(Effect):
    """Adds a zero leaf ``delta`` requiring grad, so ``delta.grad = ∂metric/∂activation``;
    ``store[layer] = (activation, delta)`` (activation detached, heads first)."""

    store: dict[int, tuple[Tensor, Tensor]]

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        delta = torch.zeros_like(x, requires_grad=True)
        self.store[layer] = (x.detach(), delta)
        return x + delta
