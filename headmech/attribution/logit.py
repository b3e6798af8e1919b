"""Direct logit attribution (DLA): what a head writes straight into the answer's logit.

A causal model's logits are linear in the residual stream once the final norm's scale is
frozen at its clean value: ``logit_y = (resid - mean(resid)) / s · w · W_U[:, y] + const``
(LayerNorm; RMSNorm has no centring). The residual stream is a sum of components, and a
head's component is ``z_h @ W_O[h]``, so each head gets a share of the logit: its
*direct* effect, ignoring what later layers make of its output. We score the correct next
token against the mean over the vocabulary (``W_U[:, y] - mean_v W_U[:, v]``: the part of
the logit that survives the softmax's shift invariance; ``baseline=`` a token id compares
with that token instead; a logit-difference task such as ``ioi`` compares each target with
its own contrasting token), averaged over the task's target tokens. Per-head DLAs plus the
other components (embeddings, MLPs, attention biases, the norm's bias and ``b_U``) add up
to ``logit_y - baseline`` exactly (tested).

For a post-LN encoder (BERT) nothing reaches the output unnormalised: a head's direct path
runs through the LayerNorm after its attention block and every later LayerNorm on the skip
connections (MLPs bypassed), each linearised with its clean scale. The pooled direct
contribution is projected on the clean sentence embedding, ``c·e0/|e0|²`` (the encoder
``lm`` task's gradient metric).

References:
    Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits".
    nostalgebraist 2020, "interpreting GPT: the logit lens".
    TransformerLens, ``tools/analysis/direct_logit_attribution.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.errors import HeadmechError
from headmech.core.placement import model_device
from headmech.interventions import Cost, capture
from headmech.interventions.sources import (
    check_linear_readout as _check_linear_readout,
)
from headmech.interventions.sources import (
    direct_effects_by_source as direct_effects_by_source,  # re-exported
)
from headmech.interventions.sources import norm_scale as _norm_scale
from headmech.interventions.sources import (
    subject_relation_scores as subject_relation_scores,  # re-exported
)
from headmech.models.weights import norm_weight
from headmech.runs import resume
from headmech.stream.engine import ProbeBatch
from headmech.stream.uncertainty import UnitValues
from headmech.tasks import EmbeddingTask, LogitDiffTask, Task, TokenLossTask

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "direct_effects",
    "direct_effects_by_source",
    "direct_logit_attribution",
    "frozen_norm",
    "subject_relation_scores",
]


def frozen_norm(
    x: Float[Tensor, "... d_model"], scale: Float[Tensor, "... 1"], norm: Any, kind: str
) -> Float[Tensor, "... d_model"]:
    """The linear part of a LayerNorm/RMSNorm with its scale frozen (bias left out)."""
    if kind == "LN":
        x = x - x.mean(-1, keepdim=True)
    w = norm_weight(norm)
    return x / scale if w is None else x / scale * w.to(x.dtype)


def _causal_batch(
    model: TransformerBridge,
    task: TokenLossTask | LogitDiffTask,
    batch: ProbeBatch,
    baseline: int | None,
) -> tuple[Tensor, Tensor]:
    """Per sequence: DLA summed over its targets ``[batch, n_layers, n_heads]``, and how
    many targets it has ``[batch]`` (a logit-difference task: its contrasting token is the
    baseline of each target)."""
    dev = model_device(model)
    if isinstance(task, LogitDiffTask):
        query, target, bad = task.contrast(batch.to(dev))
        return direct_effects(model, batch, query, target, bad[query])
    query, target = task.select(batch.to(dev))  # [batch, pos] each
    return direct_effects(model, batch, query, target, baseline)


def direct_effects(
    model: TransformerBridge,
    batch: ProbeBatch,
    query: Bool[Tensor, "batch pos"],
    target: Int[Tensor, "batch pos"],
    baseline: int | Int[Tensor, " n"] | None = None,
) -> tuple[Float[Tensor, "batch n_layers n_heads"], Float[Tensor, " batch"]]:
    """Every head's direct effect on ``logit[target] - logit[baseline]`` at the ``query``
    positions, summed per sequence, and how many queries each sequence has.

    ``baseline``: None (the mean over the vocabulary), one token id, or one token id per
    selected query (``target[query]``'s order). The final norm's scale is frozen at its
    clean value (module docstring).
    """
    _check_linear_readout(model)
    n_layers = int(model.cfg.n_layers)
    kind = str(getattr(model.cfg, "normalization_type", "LN") or "LN")
    # the final norm's scale is recorded by a hook inside ln_final, which
    # run_blocks (used by capture) never reaches: recompute it from the final residual stream
    names = [f"blocks.{la}.attn.hook_z" for la in range(n_layers)]
    names.append(f"blocks.{n_layers - 1}.hook_out")
    st = capture(model, batch, names)
    dev = model_device(model)
    query, target = query.to(dev), target.to(dev)
    resid = st[f"blocks.{n_layers - 1}.hook_out"][query]  # [n, d_model]
    scale = _norm_scale(model, resid, kind)  # [n, 1]
    W_U = model.W_U.float()  # [d_model, d_vocab]
    if baseline is None:
        base = W_U.mean(1)  # [d_model]
    elif isinstance(baseline, Tensor):
        base = W_U[:, baseline.to(dev)].T  # [n, d_model]: one per query
    else:
        base = W_U[:, baseline]
    w_final = norm_weight(model.ln_final)  # Gemma: 1 + the parameter
    direction = W_U[:, target[query]].T - base  # [n, d_model]
    direction = direction if w_final is None else direction * w_final.float()
    seq = torch.arange(query.shape[0], device=dev)[:, None].expand_as(query)[query]  # [n]
    out = torch.zeros(query.shape[0], n_layers, int(model.cfg.n_heads), device=dev)
    for la in range(n_layers):
        z = st[f"blocks.{la}.attn.hook_z"][query]  # [n, n_heads, d_head]
        c = torch.einsum(
            "nhd,hdm->nhm", z, model.blocks[la].attn.W_O.float()
        )  # [n, n_heads, d_model]
        if kind == "LN":
            c = c - c.mean(-1, keepdim=True)
        per_row = torch.einsum("nhm,nm->nh", c / scale[:, None], direction)
        out[:, la] = out[:, la].index_add(0, seq, per_row)
    return out, query.sum(1)


def _encoder_batch(
    model: TransformerBridge, task: EmbeddingTask, batch: ProbeBatch
) -> tuple[Tensor, Tensor]:
    """Per sequence: the pooled direct contribution's projection ``[batch, n_layers,
    n_heads]``, and a count of 1 each."""
    n_layers = int(model.cfg.n_layers)
    names = [f"blocks.{la}.attn.hook_z" for la in range(n_layers)]
    names += [f"blocks.{la}.{ln}.hook_scale" for la in range(n_layers) for ln in ("ln1", "ln2")]
    names.append(f"blocks.{n_layers - 1}.hook_out")
    st = capture(model, batch, names)
    dev = model_device(model)
    mask = batch.attention_mask.to(dev)
    m = mask[..., None].float()
    h = st[f"blocks.{n_layers - 1}.hook_out"]
    e0 = (h * m).sum(1) / m.sum(1)  # [batch, d_model]
    proj = e0 / (e0 * e0).sum(-1, keepdim=True)  # [batch, d_model]: c.e0/|e0|^2
    out = torch.zeros(mask.shape[0], n_layers, int(model.cfg.n_heads), device=dev)
    for la in range(n_layers):
        z = st[f"blocks.{la}.attn.hook_z"]  # [batch, pos, n_heads, d_head]
        c = torch.einsum("bphd,hdm->bphm", z, model.blocks[la].attn.W_O.float())
        for later in range(la, n_layers):  # post-LN skip path: ln1 and ln2 of each block
            for ln in ("ln1", "ln2"):
                s = st[f"blocks.{later}.{ln}.hook_scale"][:, :, None]  # [batch, pos, 1, 1]
                c = frozen_norm(c, s, getattr(model.blocks[later], ln), "LN")
        pooled = (c * m[..., None]).sum(1) / m.sum(1)[..., None]  # [batch, n_heads, d_model]
        out[:, la] = torch.einsum("bhm,bm->bh", pooled, proj)
    return out, torch.ones(mask.shape[0], device=dev)


def direct_logit_attribution(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    *,
    baseline: int | None = None,
    cost: Cost | None = None,
    progress: bool | str = False,
) -> tuple[Float[Tensor, "n_layers n_heads"], UnitValues]:
    """Mean direct logit attribution of every head over the task's targets.

    Args:
        model: a ``TransformerBridge``.
        task: a causal token task (``lm``, ``induction``, ``retrieval``), a
            logit-difference task (``ioi``: the direct effect on logit(IO) - logit(S)) or
            the encoder ``lm`` task (projection on the clean embedding).
        batches: the task's probe batches.
        baseline: a token id to compare the correct token with (default: the mean over
            the vocabulary).

        cost: accumulates the compute spent.
        progress: a tqdm bar over batches.

    Returns:
        ``([n_layers, n_heads], per-sequence values)``; positive: the head pushes the
        correct token (or the clean embedding direction) directly.
    """
    is_encoder = isinstance(task, EmbeddingTask)
    if not is_encoder and not isinstance(task, TokenLossTask | LogitDiffTask):
        raise HeadmechError(
            f"direct logit attribution needs target tokens (lm, induction, retrieval); "
            f"task '{task.name}' has none"
        )
    if not batches:
        raise HeadmechError("no batches to attribute")
    _check_linear_readout(model)

    def one(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
        if is_encoder:
            assert isinstance(task, EmbeddingTask)
            s, k = _encoder_batch(model, task, batch)
        else:
            assert isinstance(task, TokenLossTask | LogitDiffTask)
            s, k = _causal_batch(model, task, batch, baseline)
        if cost is not None:
            cost.add(int(batch.input_ids.shape[0]))
        return s.double().cpu(), k.double().cpu()

    # under torchrun: this rank's share of the batches, every batch's rows gathered
    num, den = resume.sharded_units(batches, one, "DLA" if progress else False)
    units = UnitValues(num, den)
    return units.point(), units
