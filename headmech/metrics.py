"""Behavioural metrics a head type's heads should matter for.

Convention: every metric here is a *damage* — higher is worse (a loss, or one minus a
fidelity or recall) — so the effect of an ablation is ``metric(ablated) - metric(clean)``
and a positive effect means the ablated heads were needed.

Each takes the model, probe batches and optional ``fwd_hooks`` (ablations) and returns
a float averaged over the probe's tokens or sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from headmech.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "embedding_distortion",
    "lm_loss",
    "mean_pooled_embeddings",
    "repeated_half_loss",
    "token_losses",
]

Hooks = Sequence[tuple[Any, Any]]


def _device(model: TransformerBridge) -> torch.device:
    return next(model.parameters()).device


def token_losses(model: TransformerBridge, batch: ProbeBatch, fwd_hooks: Hooks = ()) -> Tensor:
    """Next-token cross-entropy ``[batch, pos-1]``; 0 where the target is padding."""
    dev = _device(model)
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    with torch.inference_mode(), model.hooks(fwd_hooks=list(fwd_hooks)):
        logits = model(ids, attention_mask=mask)
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none"
    )
    return (loss.view(ids.shape[0], -1) * mask[:, 1:]).cpu()


def lm_loss(
    model: TransformerBridge, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """Mean next-token loss over every real target token."""
    total, n = 0.0, 0
    for b in batches:
        total += float(token_losses(model, b, fwd_hooks).sum())
        n += int(b.attention_mask[:, 1:].sum())
    return total / max(n, 1)


def repeated_half_loss(
    model: TransformerBridge, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """Mean loss on the tokens of the repeated half that an induction head can predict
    (every repeated token but the first), for ``repeated_random`` probes."""
    total, n = 0.0, 0
    for b in batches:
        half, off = int(b.extras["half_len"]), int(b.extras["offset"])
        losses = token_losses(model, b, fwd_hooks)  # losses[:, i] predicts token i + 1
        sel = losses[:, off + half : off + 2 * half - 1]
        total += float(sel.sum())
        n += sel.numel()
    return total / max(n, 1)


def mean_pooled_embeddings(
    model: TransformerBridge, batch: ProbeBatch, fwd_hooks: Hooks = ()
) -> Tensor:
    """Sentence embeddings: the final block's output mean-pooled over real tokens
    (all-MiniLM-L6-v2's pooling), ``[batch, d_model]``."""
    dev = _device(model)
    n_layers = int(model.cfg.n_layers)
    out: dict[str, Tensor] = {}

    def grab(resid: Tensor, hook: Any) -> None:
        out["h"] = resid

    mask = batch.attention_mask.to(dev)
    hooks = [*fwd_hooks, (f"blocks.{n_layers - 1}.hook_out", grab)]
    with torch.inference_mode(), model.hooks(fwd_hooks=hooks):
        model(
            batch.input_ids.to(dev), attention_mask=mask, stop_at_layer=n_layers, return_type=None
        )
    m = mask[..., None].to(out["h"].dtype)
    return ((out["h"] * m).sum(1) / m.sum(1)).cpu()


def embedding_distortion(
    model: TransformerBridge, batches: Iterable[ProbeBatch], fwd_hooks: Hooks = ()
) -> float:
    """1 - mean cosine similarity of the sentence embedding to the unablated model's.

    0 for the clean model; the encoder metric of catalog types.
    """
    sims = []
    for b in batches:
        clean = mean_pooled_embeddings(model, b)
        hooked = mean_pooled_embeddings(model, b, fwd_hooks) if fwd_hooks else clean
        sims.append(F.cosine_similarity(clean, hooked, dim=-1))
    return float(1.0 - torch.cat(sims).mean())
