"""From the residual stream to logits and token losses, without full logits where none are
needed: :func:`unembed` (the final norm and the unembedding of selected vectors, optionally
only some tokens' columns) and :func:`token_losses` (cross-entropy in tiles of the
vocabulary). The tasks (:mod:`headmech.tasks`) and the L0 gates read logits through them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["LOSS_ROWS", "VOCAB_TILE", "token_losses", "unembed"]


def unembed(
    model: TransformerBridge,
    resid: Float[Tensor, "n d_model"],
    columns: Int[Tensor, " k"] | slice | None = None,
) -> Float[Tensor, "n k"]:
    """Final norm and unembedding of selected residual vectors (avoids full logits); with
    ``columns``, only those tokens' logits (a slice of the vocabulary, or token ids)."""
    return _unembed_normed(model, model.ln_final(resid), columns)


def _unembed_normed(model: TransformerBridge, normed: Tensor, columns: Any = None) -> Tensor:
    from headmech.core.placement import materialised

    with materialised(model.unembed):  # an offloaded (device_map) unembedding is loaded
        weight = model.W_U.T  # [d_vocab, d_model], a view of the weight: one fused addmm
        bias = getattr(model, "b_U", None)
        if columns is not None:
            weight, bias = weight[columns], None if bias is None else bias[columns]
        logits = F.linear(normed, weight, bias)
    cap = float(getattr(model.cfg, "output_logits_soft_cap", -1.0) or -1.0)
    if cap > 0:  # Gemma 2's final soft-capping, elementwise: exact on any tile of columns
        logits = cap * torch.tanh(logits / cap)
    return logits


# Cross-entropy in tiles of at most LOSS_ROWS rows x VOCAB_TILE tokens (8 MiB in fp32): the
# full [rows, d_vocab] logits (100 MB for 512 rows of a 49k vocabulary) would be allocated,
# page-faulted in and freed on every call; tiles stay in the allocator's reused memory and
# the CPU's cache (measured on smollm2-135m: 0.79x the time of one cross_entropy per 512
# rows). The log-sum-exp is combined across tiles; the target's logit is read from its tile.
LOSS_ROWS = 1024
VOCAB_TILE = 2048


def token_losses(
    model: TransformerBridge, resid: Float[Tensor, "n d_model"], target: Int[Tensor, " n"]
) -> Float[Tensor, " n"]:
    """Cross-entropy of ``target`` under the logits of ``resid`` (final norm + unembedding),
    computed in tiles that never hold a whole row of logits (``LOSS_ROWS``,
    ``VOCAB_TILE``); equal to ``F.cross_entropy`` of the full logits up to float rounding.
    Differentiable."""
    d_vocab = int(model.cfg.d_vocab)
    out = []
    for i in range(0, resid.shape[0], LOSS_ROWS):
        normed = model.ln_final(resid[i : i + LOSS_ROWS])
        tgt = target[i : i + LOSS_ROWS]
        picked, lses = [], []
        for s in range(0, d_vocab, VOCAB_TILE):
            logits = _unembed_normed(model, normed, slice(s, s + VOCAB_TILE)).float()
            lses.append(torch.logsumexp(logits, -1))  # [rows]
            hit = (tgt >= s) & (tgt < s + logits.shape[1])
            # the target's logit where it falls in this tile, 0 elsewhere (summed over tiles)
            at = logits.gather(1, (tgt - s).clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
            picked.append(torch.where(hit, at, torch.zeros_like(at)))
        out.append(torch.logsumexp(torch.stack(lses, -1), -1) - torch.stack(picked).sum(0))
    return torch.cat(out) if out else resid.new_zeros(0)
