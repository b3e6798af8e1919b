"""Per-head weight matrices for weight-based analyses (copying scores, composition).

TransformerBridge exposes stacked weights: ``W_Q``/``W_O`` per query head and
``W_K``/``W_V`` per key-value head under grouped-query attention. :func:`head_weights`
expands K and V to query heads (query head h reads KV head ``h // (n_heads / n_kv)``, as
Hugging Face's ``repeat_kv`` does) and, for pre-norm models, folds the norm's
elementwise weight into the matrices that read the normalised residual (and a norm after
attention into W_O).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "HeadWeights",
    "effective_embeddings",
    "head_weights",
    "ov_copying_scores",
    "own_token_ranks",
]


@dataclass
class HeadWeights:
    """Weights of every head, expanded to query heads."""

    W_Q: Float[Tensor, "n_layers n_heads d_model d_head"]
    W_K: Float[Tensor, "n_layers n_heads d_model d_head"]
    W_V: Float[Tensor, "n_layers n_heads d_model d_head"]
    W_O: Float[Tensor, "n_layers n_heads d_head d_model"]
    W_E: Float[Tensor, "d_vocab d_model"]
    W_U: Float[Tensor, "d_model d_vocab"]


def _raw_norm_weight(module: object) -> Tensor | None:
    for name in ("weight", "w"):
        w = getattr(module, name, None)
        if isinstance(w, Tensor) and w.dim() == 1:
            return w
    orig = getattr(module, "_original_component", None)
    w = getattr(orig, "weight", None)
    return w if isinstance(w, Tensor) and w.dim() == 1 else None


@torch.no_grad()
def norm_weight(module: object) -> Tensor | None:
    """The elementwise weight a (RMS/Layer)Norm bridge multiplies by, or None.

    Read from what the norm does, not from its parameter: Gemma's RMSNorm multiplies by
    ``1 + weight``. For ``x`` of alternating signs (mean 0, unit RMS, so both kinds of norm
    leave it as is before the affine part) ``(norm(x) - norm(-x)) / 2x`` is the weight, the
    bias cancelling.
    """
    w = _raw_norm_weight(module)
    if w is None:
        return None
    run = getattr(module, "original_component", None) or module
    if not callable(run):
        return w
    x = torch.ones(w.shape[0], dtype=w.dtype, device=w.device)
    x[1::2] = -1.0
    try:
        eff = (run(1e3 * x[None]) - run(-1e3 * x[None]))[0] / (2 * x)
    except (RuntimeError, TypeError):  # a norm that cannot run on its own: its parameter
        return w
    if w.shape[0] % 2 or not bool(torch.isfinite(eff).all()):
        return w
    # the parameter itself wherever it is the weight (bit-identical results); Gemma: 1 + w
    rtol = max(1e-4, 8 * torch.finfo(w.dtype).eps)  # bf16 weights: a norm run in bf16
    return w if torch.allclose(eff, w, rtol=rtol, atol=1e-6) else eff.to(w.dtype)


@torch.no_grad()
def head_weights(model: TransformerBridge, fold_norms: bool = True) -> HeadWeights:
    """Q, K, V, O per query head, plus embedding and unembedding (offloaded weights are
    read through :func:`headmech.core.placement.materialised`); see :func:`_head_weights`."""
    from headmech.core.placement import materialised

    with materialised(model):
        return _head_weights(model, fold_norms)


def _head_weights(model: TransformerBridge, fold_norms: bool) -> HeadWeights:
    """Q, K, V, O per query head, plus embedding and unembedding.

    Args:
        model: a bridge.
        fold_norms: for pre-norm models (not BERT's post-norm), multiply the rows of
            W_Q/W_K/W_V by the block's ``ln1`` weight and of W_U by ``ln_final``'s, so the
            matrices act on the residual stream up to the per-position scale; where a norm
            follows the attention (Gemma 2/3's ``ln1_post``, OLMo 2's post-norm), multiply
            W_O's columns by its weight. The weights are those the norms multiply by
            (Gemma: 1 + the parameter).
    """
    cfg = model.cfg
    n_heads = int(cfg.n_heads)
    W_Q, W_K, W_V, W_O = (
        t.detach().float().clone() for t in (model.W_Q, model.W_K, model.W_V, model.W_O)
    )
    group = n_heads // W_K.shape[1]
    if group > 1:  # grouped-query attention: KV head h // group serves query head h
        W_K = W_K.repeat_interleave(group, dim=1)
        W_V = W_V.repeat_interleave(group, dim=1)
    W_E = model.W_E.detach().float().clone()
    W_U = model.W_U.detach().float().clone()
    pre_norm = getattr(cfg, "attention_dir", "causal") != "bidirectional"
    if fold_norms and pre_norm:
        for layer, block in enumerate(model.blocks):
            ln1 = getattr(block, "ln1", None)  # OLMo 2 has none: attention reads the residual
            w = None if ln1 is None else norm_weight(ln1)
            if w is not None:
                scale = w.detach().float()[None, :, None]  # [1, d_model, 1]
                W_Q[layer] *= scale
                W_K[layer] *= scale
                W_V[layer] *= scale
    if fold_norms:  # a norm after attention (Gemma 2/3, OLMo 2) scales what W_O writes
        for layer, block in enumerate(model.blocks):
            post = getattr(block, "ln1_post", None)
            wp = None if post is None else norm_weight(post)
            if wp is not None:
                W_O[layer] *= wp.detach().float()[None, None, :]
    if fold_norms and pre_norm:
        wf = norm_weight(model.ln_final)
        if wf is not None:
            W_U = W_U * wf.detach().float()[:, None]
    return HeadWeights(W_Q, W_K, W_V, W_O, W_E, W_U)


@torch.no_grad()
def ov_copying_scores(
    model: TransformerBridge, weights: HeadWeights | None = None
) -> Float[Tensor, "n_layers n_heads"]:
    """Elhage et al. 2021's copying score of each head's full OV circuit.

    For ``M = W_E W_V W_O W_U`` (vocab x vocab), the score is Σλ/Σ|λ| over M's eigenvalues:
    near 1 when the head raises the logit of the token it attends to (copying). M's
    nonzero eigenvalues are those of ``W_O W_U W_E W_V`` (d_head x d_head), which is cheap.

    References:
        Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits";
        Olsson et al. 2022, "In-context Learning and Induction Heads".
    """
    w = weights or head_weights(model)
    UE = w.W_U @ w.W_E  # [d_model, d_model]
    small = torch.einsum(
        "lhdm,mn,lhne->lhde", w.W_O, UE, w.W_V
    )  # [n_layers, n_heads, d_head, d_head]
    eig = torch.linalg.eigvals(small.double())
    return (eig.sum(-1).real / eig.abs().sum(-1).clamp(min=1e-12)).float()


@torch.no_grad()
def effective_embeddings(model: TransformerBridge, ids: Tensor) -> Float[Tensor, "n d_model"]:
    """Each token alone through block 0 (attention to itself, then MLP 0), normalised as
    the next block's input norm does, without its elementwise weight (folded elsewhere)."""
    from headmech.core.placement import model_device
    from headmech.stream.forward import run_blocks

    device = model_device(model)
    resid = run_blocks(model, ids[:, None].to(device), torch.ones(len(ids), 1, device=device), 1)
    x = resid[:, 0].float()
    eps = float(getattr(model.cfg, "eps", 1e-5) or 1e-5)
    if str(getattr(model.cfg, "normalization_type", "RMS")).startswith("RMS"):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# vocabulary columns per tile of own_token_ranks (the circuit's and the logits' tiles stay
# in cache while counted; whole-vocabulary rows were memory-bound: 262k-token Gemma 3 took
# 46 s a layer)
RANK_COLUMNS = 4096


@torch.no_grad()
def own_token_ranks(
    model: TransformerBridge, ids: Tensor, weights: HeadWeights | None = None
) -> tuple[Int[Tensor, "n_layers n_heads n"], Int[Tensor, "n_layers n_heads n"]]:
    """Where each token's own logit ranks under each head's effective OV circuit.

    Each token's effective embedding (:func:`effective_embeddings`) goes through the
    head's values and output and is unembedded over the whole vocabulary (norm weights
    folded). Returns how many other tokens get a higher logit than the token itself (0:
    the head writes it first: copying) and how many a lower one (0: the head suppresses it
    most: negative copying), ``[n_layers, n_heads, n]`` each. The vocabulary is visited in
    tiles of ``RANK_COLUMNS`` tokens for all heads of a layer at once (progress per layer).

    References:
        Wang et al. 2022, "Interpretability in the Wild" (the copy score: the name among
        the top 5 logits of the OV circuit after MLP 0); McDougall et al. 2023, "Copy
        Suppression" (the negative diagonal of the effective OV circuit).
    """
    from headmech.core.progress import steps

    key = (tuple(int(i) for i in ids), tuple(p._version for p in model.parameters()))
    cached = _RANKS.get(model, {}).get(key) if weights is None else None
    if cached is not None:  # the same tokens of the same, unmodified weights
        return cached
    w = weights or head_weights(model)
    e = effective_embeddings(model, ids).cpu()  # [n, d_model]
    ids = ids.cpu()
    n_layers, n_heads, _, d_head = w.W_V.shape
    n, d_model, d_vocab = len(ids), int(w.W_O.shape[-1]), int(w.W_U.shape[-1])
    above = torch.zeros(n_layers, n_heads, n, dtype=torch.long)
    below = torch.zeros_like(above)
    # many tokens: (e W_V)(W_O W_U), products through d_head (4x fewer operations for 500
    # tokens of SmolLM2); few tokens: ((e W_V) W_O) W_U, cheaper than forming W_O W_U
    narrow = d_head * (d_model + n) < n * d_model
    desc = f"OV ranks of {n} tokens over {d_vocab:,} (layers)"
    for layer in steps(range(n_layers), desc, total=n_layers):
        values = torch.einsum("nm,hmd->hnd", e, w.W_V[layer])  # [head, n, d_head]
        if not narrow:
            values = values @ w.W_O[layer]  # [head, n, d_model]

        W_O = w.W_O[layer].reshape(-1, d_model)  # [head * d_head, d_model]

        def logits(cols: Tensor | slice, values: Tensor = values, W_O: Tensor = W_O) -> Tensor:
            if not narrow:  # [head, n, cols]
                return values @ w.W_U[:, cols]
            return values @ (W_O @ w.W_U[:, cols]).view(n_heads, d_head, -1)

        own = logits(ids).diagonal(dim1=1, dim2=2)[..., None]  # [head, n, 1]
        for start in range(0, d_vocab, RANK_COLUMNS):
            tile = logits(slice(start, start + RANK_COLUMNS))  # [head, n, cols]
            mine = ((ids >= start) & (ids < start + tile.shape[-1])).nonzero()[:, 0]
            tile[:, mine, ids[mine] - start] = own[:, mine, 0]  # a token is not its own rival
            # int32 sums: half the time of bool -> int64 (exact below 2**31 tokens)
            above[layer] += (tile > own).sum(-1, dtype=torch.int32)
            below[layer] += (tile < own).sum(-1, dtype=torch.int32)
    if weights is None:
        _RANKS.setdefault(model, {})[key] = (above, below)
    return above, below


# own_token_ranks per model (two types read the same names' ranks); dropped with the model
_RANKS: weakref.WeakKeyDictionary[Any, dict[Any, tuple[Tensor, Tensor]]] = (
    weakref.WeakKeyDictionary()
)
