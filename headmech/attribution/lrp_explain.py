"""One explained logit for :func:`headmech.attribution.lrp.lrp_relevance`, term by term.

The forward pass is tapped (:func:`tapped`) at every input embedding, at each layer's
``hook_z`` and attention output, and at the attention patterns; one modified backward
pass (the rules of :data:`headmech.attribution.lrp_rules.RULES`) from the explained logit
gives every gradient at once, and :func:`relevance_terms` turns activations × gradients
into the terms of the conservation split described in :mod:`headmech.attribution.lrp`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from headmech.attribution.lrp_rules import installed_rules
from headmech.core.errors import InputError
from headmech.core.placement import model_device

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "EMBEDDINGS",
    "Explanation",
    "Taps",
    "bias_parameters",
    "explain_logit",
    "head_relevance",
    "one_sequence",
    "relevance_terms",
    "selected_logits",
    "softmax_absorbed",
    "tapped",
]

# Embeddings whose outputs the model adds at its input (the bridge's names).
EMBEDDINGS = ("embed", "pos_embed", "token_type_embed")


@dataclass
class Taps:
    """Activations captured during one forward pass, to take gradients against."""

    embeddings: dict[str, Tensor] = field(default_factory=dict)
    z: dict[int, Tensor] = field(default_factory=dict)  # [batch, pos, n_heads * d_head]
    attn_out: dict[int, Tensor] = field(default_factory=dict)  # o projection's output
    pattern: dict[int, Tensor] = field(default_factory=dict)  # [batch, head, q_pos, k_pos]


def _keep_output(store: dict, key: Any, *, leaf: bool) -> Callable[..., Any]:
    """A forward hook that stores a module's output in ``store[key]``.

    With ``leaf``, an output that does not require grad (frozen embeddings) is replaced
    by a detached copy that does, so the graph starts there.
    """

    def store_output(module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, Tensor):
            return None
        if leaf and not output.requires_grad:  # frozen embeddings: start the graph here
            output = output.detach().requires_grad_(True)
            store[key] = output
            return output
        store[key] = output
        return None

    return store_output


def _keep_o_io(taps: Taps, layer: int) -> Callable[..., None]:
    """A forward hook that stores the o projection's input (``z``) and output."""

    def store_io(module: nn.Module, args: tuple, output: Any) -> None:
        if args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
            taps.z[layer], taps.attn_out[layer] = args[0], output

    return store_io


@contextlib.contextmanager
def tapped(model: TransformerBridge, taps: Taps, *, patterns: bool) -> Iterator[None]:
    """Within the block, forward passes fill ``taps`` (patterns only if ``patterns``)."""
    handles: list[RemovableHandle] = []
    try:
        for name in EMBEDDINGS:
            mod = getattr(model, name, None)
            if isinstance(mod, nn.Module):
                keep = _keep_output(taps.embeddings, name, leaf=True)
                handles.append(mod.register_forward_hook(keep))
        for layer, block in enumerate(model.blocks):
            handles.append(block.attn.o.register_forward_hook(_keep_o_io(taps, layer)))
            if patterns:
                keep = _keep_output(taps.pattern, layer, leaf=False)
                handles.append(block.attn.hook_pattern.register_forward_hook(keep))
        yield
    finally:
        for h in handles:
            h.remove()


def head_relevance(
    z: Float[Tensor, "batch pos n_heads_d_head"], grad: Tensor | None, n_heads: int
) -> Float[Tensor, "batch pos n_heads"]:
    """``z × gradient`` summed over each head's ``d_head`` (zero where unused), float64."""
    if grad is None:
        return torch.zeros(*z.shape[:2], n_heads, dtype=torch.float64, device=z.device)
    zg = z.detach().double() * grad.double()  # [batch, pos, n_heads * d_head]
    return zg.view(*zg.shape[:2], n_heads, -1).sum(-1)


def softmax_absorbed(
    pattern: Float[Tensor, "batch head q_pos k_pos"], grad: Tensor | None
) -> float:
    """Relevance the AttnLRP softmax rule does not pass on, summed over rows and heads.

    With ``s_j = log A_j + c`` per row (the row constant cancels because
    ``Σ_j A_j (g_j - ḡ) = 0``), relevance in is ``Σ_j A_j g_j`` and relevance out is
    ``Σ_j s_j A_j (g_j - ḡ)``; the uniform rule gives the pattern half of the product's
    relevance, hence the 1/2.
    """
    if grad is None:
        return 0.0
    a, g = pattern.detach().double(), grad.double()
    ag = a * g
    g_bar = ag.sum(-1, keepdim=True)
    log_a = torch.where(a > 0, a.clamp_min(1e-300).log(), torch.zeros_like(a))
    r_out = (a * log_a * (g - g_bar)).sum()
    return float((ag.sum() - r_out) / 2)


def selected_logits(
    logits: Float[Tensor, "batch pos d_vocab"],
    select: Bool[Tensor, "batch pos"],
    target: Int[Tensor, "batch pos"] | None,
) -> tuple[Float[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """The selected logits (top-1 unless ``target`` is given), zero where not selected."""
    if target is None:
        target = logits.detach().argmax(-1)
    picked = logits.gather(-1, target[..., None])[..., 0]
    return picked * select.to(picked.dtype), target


def bias_parameters(model: TransformerBridge) -> list[Tensor]:
    """Every bias parameter of the model (``*.bias`` and ``*_bias``), each once."""
    seen: dict[int, Tensor] = {}
    for name, p in model.named_parameters():
        if name.split(".")[-1] == "bias" or name.endswith("_bias"):
            seen.setdefault(id(p), p)
    return list(seen.values())


@dataclass
class Explanation:
    """One explained logit: the tapped activations and their modified gradients."""

    taps: Taps
    picked: Float[Tensor, "1 pos"]  # the explained logit at its position, zero elsewhere
    target: Int[Tensor, "1 pos"]
    embeddings: dict[str, Tensor | None]  # gradient at each input embedding's output
    z: dict[int, Tensor | None]  # gradient at hook_z, by layer
    attn_out: dict[int, Tensor | None]  # gradient at the o projection's output
    pattern: dict[int, Tensor | None]  # gradient at the attention pattern
    biases: list[tuple[Tensor, Tensor | None]]  # (bias parameter, its gradient)


def one_sequence(
    model: TransformerBridge,
    input_ids: Int[Tensor, " pos"] | Int[Tensor, "1 pos"],
    attention_mask: Int[Tensor, " pos"] | Int[Tensor, "1 pos"] | None,
    position: int,
) -> tuple[Int[Tensor, "1 pos"], Int[Tensor, "1 pos"], int]:
    """The input and its mask as one batch row on the model's device, and the position.

    Raises:
        InputError: more than one sequence, or ``position`` outside the real tokens.
    """
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if ids.shape[0] != 1:
        raise InputError(f"lrp_relevance explains one sequence, got {ids.shape[0]}")
    device = model_device(model)
    ids = ids.to(device)
    mask = (
        torch.ones_like(ids)
        if attention_mask is None
        else (attention_mask if attention_mask.dim() == 2 else attention_mask[None]).to(device)
    )
    n_real = int(mask.sum())
    pos = n_real + position if position < 0 else position
    if not 0 <= pos < ids.shape[1] or not bool(mask[0, pos]):
        raise InputError(f"position {position} is not a real token of a {n_real}-token input")
    return ids, mask, pos


def _gradient_inputs(taps: Taps, biases: list[Tensor]) -> list[Tensor]:
    """What to differentiate against, in the order :func:`_grouped` reads gradients."""
    layers = sorted(taps.z)
    return [
        *taps.embeddings.values(),
        *(taps.z[i] for i in layers),
        *(taps.attn_out[i] for i in layers),
        *(taps.pattern[i] for i in layers if i in taps.pattern),
        *biases,
    ]


def _grouped(
    taps: Taps,
    picked: Tensor,
    target: Tensor,
    biases: list[Tensor],
    grads: Sequence[Tensor | None],
) -> Explanation:
    """Gradients in :func:`_gradient_inputs` order, grouped by what they belong to."""
    it = iter(grads)
    layers = sorted(taps.z)
    return Explanation(
        taps=taps,
        picked=picked,
        target=target,
        embeddings={n: next(it) for n in taps.embeddings},
        z={i: next(it) for i in layers},
        attn_out={i: next(it) for i in layers},
        pattern={i: next(it) for i in layers if i in taps.pattern},
        biases=[(p, next(it)) for p in biases],
    )


def explain_logit(
    model: TransformerBridge,
    ids: Int[Tensor, "1 pos"],
    mask: Int[Tensor, "1 pos"],
    pos: int,
    target: int | None,
    *,
    qkv_scale: Mapping[str, float],
) -> Explanation:
    """One forward and one modified backward pass from the logit at ``pos``.

    Frozen bias parameters are made to require grad for the pass (and frozen again), so
    that the relevance they absorb can be read off their gradients.

    Args:
        model: a ``TransformerBridge``.
        ids, mask: one sequence and its attention mask (:func:`one_sequence`).
        pos: the explained position.
        target: the explained vocabulary id (default: the top-1 logit).
        qkv_scale: the attention rule's gradient factors.
    """
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[0, pos] = True
    tgt = None if target is None else torch.full_like(ids, int(target))
    biases = bias_parameters(model)
    frozen = [p for p in biases if not p.requires_grad]
    taps = Taps()
    try:
        for p in frozen:
            p.requires_grad_(True)
        with (
            torch.enable_grad(),
            installed_rules(model, qkv_scale) as rules,
            tapped(model, taps, patterns=True),
        ):
            logits = model(ids, attention_mask=mask, return_type="logits")
            rules.check()
            picked, tgt = selected_logits(logits, select, tgt)
            inputs = _gradient_inputs(taps, biases)
            grads = torch.autograd.grad(picked.sum(), inputs, allow_unused=True)
    finally:
        for p in frozen:
            p.requires_grad_(False)
    return _grouped(taps, picked, tgt, biases, grads)


def _embedding_relevance(ex: Explanation) -> dict[str, Float[Tensor, "pos d_model"]]:
    """``embedding output × gradient`` for every input embedding, in float64."""
    rel = {}
    for n, g in ex.embeddings.items():
        e = ex.taps.embeddings[n]
        r = e.detach().double() * g.double() if g is not None else torch.zeros_like(e).double()
        rel[n] = r.expand(1, *r.shape[-2:])[0]  # one sequence: [pos, d_model]
    return rel


def _layer_relevance(
    model: TransformerBridge, ex: Explanation
) -> dict[str, Float[Tensor, "n_layers ..."]]:
    """Per layer: ``heads`` ``[n_layers, n_heads]``, ``attn_out``, ``attn_bias``, ``softmax``."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    heads = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    attn_out = torch.zeros(n_layers, dtype=torch.float64)
    attn_bias = torch.zeros(n_layers, dtype=torch.float64)
    softmax = torch.zeros(n_layers, dtype=torch.float64)
    for i, g in ex.z.items():
        heads[i] = head_relevance(ex.taps.z[i], g, n_heads).sum((0, 1)).cpu()
    for i, g in ex.attn_out.items():
        if g is not None:
            attn_out[i] = float((ex.taps.attn_out[i].detach().double() * g.double()).sum())
            b = getattr(model.blocks[i].attn.o, "bias", None)
            if isinstance(b, Tensor):
                attn_bias[i] = float((b.detach().double() * g.double()).sum())
    for i, g in ex.pattern.items():
        softmax[i] = softmax_absorbed(ex.taps.pattern[i], g)
    return {"heads": heads, "attn_out": attn_out, "attn_bias": attn_bias, "softmax": softmax}


def _bias_relevance(ex: Explanation) -> float:
    """``b · ∂̃logit/∂b`` summed over every bias parameter."""
    total = 0.0
    for p, g in ex.biases:
        if g is not None:
            total += float((p.detach().double() * g.double()).sum())
    return total


def relevance_terms(model: TransformerBridge, ex: Explanation, pos: int) -> dict[str, Any]:
    """The result of :func:`lrp_relevance` (see there) from one explanation."""
    emb_rel = _embedding_relevance(ex)
    layer = _layer_relevance(model, ex)
    bias_total = _bias_relevance(ex)
    softmax = layer["softmax"]
    logit = float(ex.picked.detach().double().sum())
    token_rel = emb_rel.pop("embed")
    input_total = float(token_rel.sum()) + sum(float(r.sum()) for r in emb_rel.values())
    return {
        "logit": logit,
        "target": int(ex.target[0, pos]),
        "position": pos,
        "embedding": token_rel.float().cpu(),
        "tokens": token_rel.sum(-1).float().cpu(),
        "other_embeddings": {n: r.sum(-1).float().cpu() for n, r in emb_rel.items()},
        "heads": layer["heads"].float(),
        "attn_out": layer["attn_out"].float(),
        "attn_bias": layer["attn_bias"].float(),
        "input": input_total,
        "bias": bias_total,
        "softmax": softmax.float(),
        "conservation_error": logit - input_total,
        "residual": logit - input_total - bias_total - float(softmax.sum()),
    }
