"""Heads' direct effects on a logit difference: the path to the logits, and backups.

A head's *direct* effect is what its write to the residual stream does to the logits
without passing through any later head or MLP (Wang et al. 2022's path patching to the
logits). With ``w = z[head] @ W_O[head]`` the head's write at the prompt's last token
(``norm(a) - norm(a - w)`` where a norm follows the attention, Gemma 2/3's sandwich norm,
``a`` the block's attention output) and ``r`` the final residual there:

* :func:`direct_path_effects` — head *sets* patched to the logits: every head of the set
  writes its corrupted-run output instead of its own, ``Δ = Σ (z_src - z) @ W_O`` (per
  layer through the norm), and only the logits read ``r + Δ`` (final norm recomputed);
  the effect is ``metric(r + Δ) - metric(r)`` per prompt;
* :func:`key_writes` — what each head writes along a direction at one query a sequence,
  per key it reads: ``α_j (v_j W_O) · d`` (the split of a direct effect by source and
  LOCOS's logit contribution: :mod:`headmech.interventions.sources`);
* :func:`head_direct_effects` — every head's own direct effect on the logit difference,
  ``ld(r) - ld(r - w)``, in the clean run or under an intervention (ablated name movers:
  the heads whose direct effect then rises are Wang et al.'s backup name movers).

The senders' writes (:func:`direct_writes`) are shared with :mod:`headmech.circuits.path_patching`,
whose receivers are heads' q/k/v inputs rather than the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.core.placement import model_device
from headmech.interventions import Intervention, applied, recording
from headmech.models.unembedding import unembed
from headmech.stream.engine import ProbeBatch, run_blocks

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "all_z",
    "direct_path_effects",
    "direct_writes",
    "head_direct_effects",
    "key_writes",
    "layer_write",
    "layer_z",
    "post_norm",
]


def layer_z(
    model: TransformerBridge, batch: ProbeBatch, layer: int, post: bool = False
) -> tuple[Float[Tensor, "batch pos n_heads d_head"], Tensor | None]:
    """``hook_z`` of one layer, running only the blocks up to it; with ``post``, also the
    attention output that the block's post-attention norm receives."""
    names = [f"blocks.{layer}.attn.hook_z"] + ([f"blocks.{layer}.ln1_post.hook_in"] * post)
    dev = model_device(model)
    with torch.no_grad(), recording(model, names) as store:
        run_blocks(model, batch.input_ids.to(dev), batch.attention_mask.to(dev), layer + 1)
    return store[names[0]].detach(), store[names[-1]].detach() if post else None


def post_norm(model: TransformerBridge, layer: int) -> Any:
    """The norm between block ``layer``'s attention and the residual stream (Gemma 2/3's
    sandwich norm, OLMo 2's post-norm), as the wrapped module (no hooks fire), or None."""
    post = getattr(model.blocks[layer], "ln1_post", None)
    return None if post is None else getattr(post, "original_component", None) or post


def direct_writes(
    model: TransformerBridge,
    base: ProbeBatch,
    source: ProbeBatch,
    layer: int,
    senders: list[HeadIndex],
) -> list[Float[Tensor, "batch pos d_model"]]:
    """Per sender, how its block's write to the residual stream changes when only the
    sender's output is the source run's: ``(z_src - z_base) @ W_O``, or, where a norm
    follows the attention, ``norm(a + (z_src - z_base) @ W_O) - norm(a)`` with ``a`` the
    base run's attention output (the norm recomputed, not frozen)."""
    norm = post_norm(model, layer)
    z_base, a = layer_z(model, base, layer, post=norm is not None)
    dz = layer_z(model, source, layer)[0] - z_base
    W_O = model.blocks[layer].attn.W_O  # [n_heads, d_head, d_model]
    writes = [dz[:, :, s.head].to(W_O) @ W_O[s.head] for s in senders]
    if norm is None or a is None:
        return writes
    with torch.no_grad():
        return [norm(a + w.to(a)) - norm(a) for w in writes]


def _run(
    model: TransformerBridge, batch: ProbeBatch, interventions: Sequence[Intervention] = ()
) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
    """One run: the final residual ``[batch, pos, d_model]``, and per layer the heads'
    ``hook_z`` ``[batch, pos, n_heads, d_head]`` and the attention output the post-norm
    reads (None without one)."""
    n_layers = int(model.cfg.n_layers)
    post = [post_norm(model, la) is not None for la in range(n_layers)]
    names = [f"blocks.{la}.attn.hook_z" for la in range(n_layers)]
    names += [f"blocks.{la}.ln1_post.hook_in" for la in range(n_layers) if post[la]]
    dev = model_device(model)
    with torch.no_grad(), applied(model, list(interventions)), recording(model, names) as st:
        resid = run_blocks(model, batch.input_ids.to(dev), batch.attention_mask.to(dev))
    zs = [st[f"blocks.{la}.attn.hook_z"].detach() for la in range(n_layers)]
    attn = [st[f"blocks.{la}.ln1_post.hook_in"].detach() if post[la] else None for la in range(n_layers)]  # fmt: skip
    return resid.detach(), zs, attn


def all_z(model: TransformerBridge, batch: ProbeBatch) -> tuple[list[Tensor], list[Tensor | None]]:
    """Per layer, every head's ``hook_z`` ``[batch, pos, n_heads, d_head]`` and the
    attention output the post-attention norm reads (None without one), from one run."""
    _, z, attn = _run(model, batch)
    return z, attn


def _end_run(
    model: TransformerBridge,
    batch: ProbeBatch,
    query: Tensor,
    interventions: Sequence[Intervention] = (),
) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
    """:func:`_run` at the query rows only (``[n, ...]``)."""
    resid, z, attn = _run(model, batch, interventions)
    q = query.to(resid.device)
    return resid[q], [x[q] for x in z], [None if a is None else a[q] for a in attn]


def layer_write(model: TransformerBridge, layer: int, dz: Tensor, a: Tensor | None) -> Tensor:
    """The block's write change ``[..., d_model]`` for head-output changes ``dz``
    ``[..., n_heads, d_head]`` (zero for heads left alone): ``Σ_h dz_h @ W_O[h]``, through
    the post-attention norm where there is one (``a``: the attention output it reads)."""
    W_O = model.blocks[layer].attn.W_O  # [n_heads, d_head, d_model]
    w = torch.einsum("...hd,hdm->...m", dz.to(W_O), W_O)
    norm = post_norm(model, layer)
    if norm is None or a is None:
        return w
    return norm(a + w.to(a)) - norm(a)


def _logit_diff(model: TransformerBridge, resid: Tensor, good: Tensor, bad: Tensor) -> Tensor:
    """``logit[bad] - logit[good]`` per row (a loss: higher is worse), final norm included."""
    tokens, where = torch.stack([good, bad], -1).unique(return_inverse=True)
    two = unembed(model, resid, tokens).float().gather(1, where)
    return two[:, 1] - two[:, 0]


def direct_path_effects(
    model: TransformerBridge,
    batch: ProbeBatch,
    corrupt: ProbeBatch,
    contrast: tuple[Tensor, Tensor, Tensor],
    head_sets: Sequence[Sequence[HeadIndex]],
) -> tuple[Float[Tensor, " n"], Float[Tensor, "n_sets n"]]:
    """The clean metric per prompt (one query row each) and, per head set and prompt,
    ``metric(r + Δ) - metric(r)``: the
    set's heads write their ``corrupt``-run output, along the path to the logits only.
    ``contrast``: the task's ``(query, good, bad)`` (:class:`headmech.tasks.LogitDiffTask`);
    the metric is ``logit[bad] - logit[good]``."""
    query, good, bad = contrast
    resid, z, attn = _end_run(model, batch, query)
    _, z_src, _ = _end_run(model, corrupt, query)
    g, b = good[query].to(resid.device), bad[query].to(resid.device)
    clean = _logit_diff(model, resid, g, b)
    out = []
    with torch.no_grad():
        for heads in head_sets:
            delta = torch.zeros_like(resid)
            for la in sorted({h.layer for h in heads}):
                dz = torch.zeros_like(z[la])
                idx = torch.tensor(sorted({h.head for h in heads if h.layer == la}))
                dz[:, idx] = z_src[la][:, idx] - z[la][:, idx]
                delta = delta + layer_write(model, la, dz, attn[la]).to(delta)
            out.append(_logit_diff(model, resid + delta, g, b) - clean)
    return clean, torch.stack(out) if out else torch.zeros(0, len(clean))


def head_direct_effects(
    model: TransformerBridge,
    batch: ProbeBatch,
    contrast: tuple[Tensor, Tensor, Tensor],
    interventions: Sequence[Intervention] = (),
) -> Float[Tensor, "n n_layers n_heads"]:
    """Every head's direct effect on the logit difference ``logit[good] - logit[bad]`` per
    prompt: ``ld(r) - ld(r - w)`` (positive: the head's write raises the correct token),
    under ``interventions`` (default none: the clean run)."""
    query, good, bad = contrast
    resid, z, attn = _end_run(model, batch, query, interventions)
    g, b = good[query].to(resid.device), bad[query].to(resid.device)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    base = -_logit_diff(model, resid, g, b)
    out = torch.zeros(len(base), n_layers, n_heads)
    with torch.no_grad():
        for la in range(n_layers):
            for h in range(n_heads):
                dz = torch.zeros_like(z[la])
                dz[:, h] = -z[la][:, h]  # the head's write removed
                w = layer_write(model, la, dz, attn[la]).to(resid)
                out[:, la, h] = (base + _logit_diff(model, resid + w, g, b)).cpu()
    return out


def key_writes(
    model: TransformerBridge,
    store: dict[str, Tensor],
    query: Tensor,
    direction: Float[Tensor, "batch d_model"],
) -> Float[Tensor, "batch n_layers n_heads key_pos"]:
    """Per sequence, layer, head and key ``j``: ``α_j (v_j W_O) · d``, the head's write at
    the sequence's ``query`` position along its ``direction`` row that comes from key
    ``j`` (``α`` the head's attention there, ``v_j`` its value head's value: grouped-query
    attention repeats each value head over its query heads). Summed over the keys it is
    ``z W_O · d``. ``store``: every layer's ``attn.hook_v`` and ``attn.hook_pattern``
    (:func:`headmech.interventions.capture`)."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    rows = torch.arange(len(query), device=direction.device)
    out = []
    with torch.no_grad():
        for la in range(n_layers):
            v = store[f"blocks.{la}.attn.hook_v"].float()  # [batch, pos, n_kv, d_head]
            v = v.repeat_interleave(n_heads // v.shape[2], dim=2)  # a query head's value head
            wd = torch.einsum("hdm,bm->bhd", model.blocks[la].attn.W_O.detach().float(), direction)
            along = torch.einsum("bjhd,bhd->bhj", v, wd)  # each key's write along d
            alpha = store[f"blocks.{la}.attn.hook_pattern"][rows, :, query].float()  # [b, h, j]
            out.append(alpha * along)
    return torch.stack(out, 1)
