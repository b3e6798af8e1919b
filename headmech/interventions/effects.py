"""Effects: what an intervention does to the heads it selects.

Every effect works in one layout, heads first — ``[batch, head_index, pos, d_head]`` for
z/q/k/v, ``[batch, head_index, query_pos, key_pos]`` for the pattern — reached from the
hook's own layout with :func:`einops.rearrange`; ``apply`` returns the new value of the
selected heads (same shape), never writing into its input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from headmech.core.errors import HeadmechError

__all__ = [
    "SITES",
    "Context",
    "DropFirst",
    "Effect",
    "Gate",
    "Mean",
    "Patch",
    "PathPatch",
    "Scale",
    "Set",
    "Tap",
    "Uniform",
    "Window",
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


@dataclass(frozen=True)
class DropFirst(Effect):
    """The first key's weight removed and the rest renormalised: the head's attention
    sink taken away (Xiao et al. 2024 evict the first tokens from the cache). A query
    that sees no other key keeps its pattern."""

    sites = ("pattern",)

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        kept = x.clone()
        kept[..., 0] = 0
        total = kept.sum(-1, keepdim=True)
        return torch.where(total > 0, kept / total.clamp(min=torch.finfo(x.dtype).tiny), x)


@dataclass(frozen=True)
class Window(Effect):
    """Attention restricted to the first ``sinks`` keys and the ``window`` keys before the
    query (and the query's own), renormalised: exactly the softmax over those keys, the
    pattern of a head whose KV cache keeps only them (StreamingLLM's sinks + recent window;
    :mod:`headmech.kv`). Causal models only (keys up to the query)."""

    sinks: int = 4
    window: int = 256
    sites = ("pattern",)

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        n_q, n_k = x.shape[-2:]
        q = torch.arange(n_k - n_q, n_k, device=x.device)[:, None]  # offset for cached keys
        k = torch.arange(n_k, device=x.device)[None, :]
        keep = (k <= q) & ((k < self.sinks) | (q - k <= self.window))  # [query_pos, key_pos]
        kept = x * keep.to(x.dtype)
        return kept / kept.sum(-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)


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


def _reads_normed_residual(model: Any) -> bool:
    """Whether attention reads ``ln1(resid)`` (pre-norm) rather than the raw residual (BERT's
    post-norm blocks, whose ``ln1`` follows the attention: ``attention_dir`` tells them
    apart, as in :func:`headmech.models.weights.head_weights`)."""
    return getattr(model.cfg, "attention_dir", "causal") != "bidirectional"


@dataclass(frozen=True, eq=False)
class PathPatch(Effect):
    """The selected heads' ``site`` input (q, k or v) is recomputed from the residual
    entering their block plus ``delta``: ``ln1(resid + delta) @ W[head] + b[head]``, with the
    block's own norm module and projection weights. Everything else in the block (other
    heads, the other two of q/k/v) keeps the current run's value.

    With ``delta = (z_src - z_base)[sender] @ W_O[sender]`` this is direct path patching of
    the edge sender → receiver (Wang et al. 2022; Goldowsky-Dill et al. 2023): only the
    receiver's ``site`` input sees the sender's other-run output, along the direct path.
    Under grouped-query attention ``k``/``v`` heads are KV heads (the hook's head axis), so
    a ``k``/``v`` receiver is a KV head and the patch reaches every query head of its group.
    ``hook_q``/``hook_k`` are taken before rotary embeddings, so the recomputation needs
    no positions.

    The copy of a stacked batch that ``x`` belongs to is found by recomputing every copy's
    input from its residual and matching ``x``, which also checks the recomputation: a
    mismatch (another edit of the same heads' input earlier in the variant, a site other
    than ``site``, weights processed away from the norm module) raises
    :class:`~headmech.core.errors.HeadmechError`.

    Attributes:
        model: the ``TransformerBridge`` (its blocks' ``ln1`` and ``attn.W_*``/``b_*``).
        delta: ``[batch, pos, d_model]``, added to the residual the selected heads read.
        site: ``"q"``, ``"k"`` or ``"v"``: which input is recomputed (the intervention's site).

    References:
        Wang et al. 2022, "Interpretability in the Wild"; Goldowsky-Dill et al. 2023,
        "Localizing Model Behavior with Path Patching".
    """

    model: Any = field(repr=False)
    delta: Float[Tensor, "batch pos d_model"] = field(repr=False)
    site: str = "q"
    sites = ("q", "k", "v")
    reads_layer_input = True

    def read(
        self, resid: Float[Tensor, "*copies batch pos d_model"], layer: int, idx: Tensor
    ) -> Float[Tensor, "*copies batch n_sel pos d_head"]:
        """The selected heads' ``site`` input recomputed from a residual entering block
        ``layer`` (``idx``: head indices at the site, KV heads for k/v under GQA)."""
        block = self.model.blocks[layer]
        h = resid
        ln1 = getattr(block, "ln1", None)  # none in OLMo 2: attention reads the residual
        if _reads_normed_residual(self.model) and ln1 is not None:
            # the wrapped module: same values as the bridge's ln1, and no hooks fire
            norm = getattr(ln1, "original_component", None) or ln1
            h = norm(resid)
        name = self.site.upper()
        W = getattr(block.attn, f"W_{name}")  # [n_heads (kv), d_model, d_head]
        sel = idx.to(W.device)
        out = torch.einsum("...pm,hmd->...hpd", h.to(W.dtype), W[sel])
        b = getattr(block.attn, f"b_{name}", None)  # [n_heads (kv), d_head] or None
        if b is not None:
            out = out + b[sel][:, None, :]
        return out

    def apply(self, x, layer, idx, ctx):
        """See :meth:`Effect.apply`."""
        resid = self._own_residual(x, layer, idx, ctx)  # [batch, pos, d_model]
        return self.read(resid + self.delta.to(resid), layer, idx).to(x.dtype)

    def _own_residual(
        self, x: Float[Tensor, "batch n_sel pos d_head"], layer: int, idx: Tensor, ctx: Context
    ) -> Float[Tensor, "batch pos d_model"]:
        """The rows of the (stacked) layer input that ``x``'s copy read."""
        resid = ctx.layer_inputs[layer]  # [copies * batch, pos, d_model]
        copies = resid.shape[0] // x.shape[0]
        resid = resid.reshape(copies, x.shape[0], *resid.shape[1:])
        err = (self.read(resid, layer, idx).to(x.dtype) - x[None]).abs()
        err = err.flatten(1).amax(1).float()  # [copies]
        eps = max(torch.finfo(x.dtype).eps, 1e-6)
        tol = 64 * eps * (float(x.abs().max()) + 1.0)
        c = int(err.argmin())
        if float(err[c]) > tol:
            raise HeadmechError(
                f"PathPatch: layer {layer}'s {self.site} input recomputed from the residual "
                f"differs from the hooked one by {float(err[c]):.2g}: the site must be "
                f"'{self.site}', unedited before, with weights matching the norm module"
            )
        spread = (resid[err <= tol] - resid[c]).abs().amax()
        if float(spread) > 64 * eps * (float(resid[c].abs().max()) + 1.0):
            raise HeadmechError(
                f"PathPatch: two copies in layer {layer} have the same {self.site} input "
                "but different residuals; put such variants in separate runs"
            )
        return resid[c]
