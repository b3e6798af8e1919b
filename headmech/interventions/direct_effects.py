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
  per key it reads: ``α_j (v_j W_O) · d`` (the split of a direct effect by source, and
  LOCOS's logit contribution);
* :func:`direct_effects_by_source` — a head's direct effect on one logit (against the
  vocabulary's mean), split by the keys it reads (Chughtai et al. 2024's subject and
  relation heads: :func:`subject_relation_scores`);
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
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex
from headmech.interventions import Intervention, applied, capture, recording
from headmech.models.unembedding import unembed
from headmech.models.weights import norm_weight
from headmech.stream.engine import ProbeBatch, run_blocks

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "all_z",
    "check_linear_readout",
    "direct_effects_by_source",
    "direct_path_effects",
    "direct_writes",
    "head_direct_effects",
    "key_writes",
    "layer_write",
    "layer_z",
    "locos_scores",
    "needle_span",
    "norm_scale",
    "post_norm",
    "subject_relation_scores",
]


def layer_z(
    model: TransformerBridge, batch: ProbeBatch, layer: int, post: bool = False
) -> tuple[Float[Tensor, "batch pos n_heads d_head"], Tensor | None]:
    """``hook_z`` of one layer, running only the blocks up to it; with ``post``, also the
    attention output that the block's post-attention norm receives."""
    names = [f"blocks.{layer}.attn.hook_z"] + ([f"blocks.{layer}.ln1_post.hook_in"] * post)
    dev = next(model.parameters()).device
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
    dev = next(model.parameters()).device
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


def direct_effects_by_source(
    model: TransformerBridge,
    batch: ProbeBatch,
    query: Int[Tensor, " batch"],
    target: Int[Tensor, " batch"],
    groups: Sequence[Bool[Tensor, "batch pos"]],
) -> Float[Tensor, "batch n_groups n_layers n_heads"]:
    """Each head's direct effect on ``logit[target] - mean logit`` at one query position a
    sequence, split by the source positions its attention reads (Chughtai et al. 2024).

    A head's output at the query is ``z = Σ_j α_j v_j`` (``α`` its attention, ``v_j`` the
    value at key ``j``), so with the final norm's scale frozen its direct effect
    (:func:`direct_effects`) is a sum over keys of ``α_j (v_j W_O) · d``, ``d`` the
    target's direction. Group ``g``'s share sums the keys where ``groups[g]`` is True; a
    last group takes every other key, so the groups add up to the head's direct effect.

    Returns ``[batch, len(groups) + 1, n_layers, n_heads]``.

    References:
        Chughtai, Cooney, Nanda 2024, "Summing Up the Facts: Additive Mechanisms Behind
        Factual Recall in LLMs", arXiv:2402.07321 (subject and relation heads).
    """
    check_linear_readout(model)
    n_layers = int(model.cfg.n_layers)
    kind = str(getattr(model.cfg, "normalization_type", "LN") or "LN")
    names = [f"blocks.{la}.attn.{h}" for la in range(n_layers) for h in ("hook_v", "hook_pattern")]
    names.append(f"blocks.{n_layers - 1}.hook_out")
    st = capture(model, batch, names)
    dev = next(model.parameters()).device
    rows = torch.arange(len(query), device=dev)
    query, target = query.to(dev), target.to(dev)
    resid = st[f"blocks.{n_layers - 1}.hook_out"][rows, query]  # [batch, d_model]
    W_U = model.W_U.float()
    direction = W_U[:, target].T - W_U.mean(1)  # [batch, d_model]
    w_final = norm_weight(model.ln_final)
    direction = direction if w_final is None else direction * w_final.float()
    if kind == "LN":  # (c - mean c) · d = c · (d - mean d)
        direction = direction - direction.mean(-1, keepdim=True)
    direction = (direction / norm_scale(model, resid, kind)).detach()
    other = ~torch.stack(list(groups)).to(dev).any(0)
    masks = torch.stack([*groups, other], 1).to(dev, torch.float32)  # [batch, groups, pos]
    return torch.einsum("blhj,bgj->bglh", key_writes(model, st, query, direction), masks)


def subject_relation_scores(
    model: TransformerBridge, n_facts: int = 64, *, batches: list[ProbeBatch] | None = None
) -> dict[str, Any]:
    """Chughtai et al.'s subject and relation heads: every head's direct effect on the
    answer's logit (against the vocabulary's mean) at a fact prompt's last token, split by
    source (:func:`direct_effects_by_source`: the subject's tokens, the relation's, the
    rest) and averaged over the facts the model completes (its top token is the answer's
    first): ``{"subject", "relation", "other"}`` grids ``[n_layers, n_heads]`` in nats,
    ``{"subject_positive", "relation_positive"}`` the share of those facts where the
    group's effect is above 0 (a sign test's count), ``"known"`` and ``"asked"`` (facts).
    A model that knows none of them gets all-zero grids."""
    from headmech.probes import ProbeOptions, build_probe
    from headmech.probes.facts import answer_is_top

    if batches is None:
        batches = build_probe("facts", model, ProbeOptions(n_sequences=n_facts)).batches
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    total = torch.zeros(3, n_layers, n_heads)
    positive = torch.zeros(3, n_layers, n_heads)
    known = asked = 0
    tops = answer_is_top(model, batches).split([len(b.input_ids) for b in batches])
    for batch, top in zip(batches, tops, strict=True):
        e = batch.extras
        split = direct_effects_by_source(
            model, batch, e["end_pos"], e["answer"], [e["subject"], e["relation"]]
        )
        split = split[top.to(split.device)].cpu()  # [known, 3, n_layers, n_heads]
        total += split.sum(0)
        positive += (split > 0).sum(0)
        known, asked = known + int(top.sum()), asked + len(top)
    mean, share = total / max(known, 1), positive / max(known, 1)
    return {
        "subject": mean[0],
        "relation": mean[1],
        "other": mean[2],
        "subject_positive": share[0],
        "relation_positive": share[1],
        "known": known,
        "asked": asked,
    }


def norm_scale(model: TransformerBridge, resid: Tensor, kind: str) -> Tensor:
    """The final norm's clean scale for these residual vectors (what its hook_scale holds)."""
    with torch.no_grad(), recording(model, ["ln_final.hook_scale"]) as store:
        model.ln_final(resid.to(model.ln_final.weight.dtype))
    if "ln_final.hook_scale" in store:
        return store["ln_final.hook_scale"].detach().float().reshape(resid.shape[0], 1)
    eps = float(getattr(model.cfg, "eps", 1e-5))
    x = resid - resid.mean(-1, keepdim=True) if kind == "LN" else resid
    return (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


def check_linear_readout(model: TransformerBridge) -> None:
    """Refuse models where a head's direct write does not reach the logits linearly once
    the final norm's scale is frozen (one line naming the layer)."""
    if any(getattr(b, "ln1_post", None) is not None for b in model.blocks):
        raise HeadmechError(
            "direct logit attribution is not supported here: a norm follows each attention "
            "block (post_attention_layernorm), so a head's write to the residual is not z @ W_O"
        )
    if float(getattr(model.cfg, "output_logits_soft_cap", -1.0) or -1.0) > 0:
        raise HeadmechError(
            "direct logit attribution is not supported here: the final logit soft-capping "
            "(tanh) makes the logits nonlinear in the residual stream"
        )


def needle_span(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
    """The needle's half-open span ``(start, end)`` per sequence: the gold document of a
    ``documents`` batch, the needle sentence of a ``nonliteral`` / ``literal`` one."""
    e = batch.extras
    if "needle_start" in e:
        return e["needle_start"], e["needle_end"]
    rows = torch.arange(batch.input_ids.shape[0])
    return e["doc_start"][rows, e["gold"]], e["doc_end"][rows, e["gold"]]


def locos_scores(
    model: TransformerBridge,
    n_questions: int = 40,
    *,
    batches: list[ProbeBatch] | None = None,
    answered_only: bool = True,
    probe: str = "documents",
) -> dict[str, Any]:
    """LOCOS's logit-contribution score of every head (module docstring), on the
    ``probe``'s questions the model answers (its top token at the end is the answer: the
    gold city of ``documents``, the hidden name of ``nonliteral``, LOCOS's own setting, or
    ``literal``): ``{"score": S = L+ - L-, "L_plus", "L_minus"}`` grids ``[n_layers,
    n_heads]``, ``"positive"`` (the share of those questions where the head's own ``L+ - L-``
    is above 0, a sign test's count), ``"answered"`` and ``"asked"``. As the authors' code:
    ``u_y`` is the unembedding's column of the answer token (no final norm), the values and ``W_O`` the
    attention's own (Gemma's norm after the attention is not applied), the off-needle
    keys every other key up to the answer step (:func:`needle_span`). ``answered_only=False``
    averages over every question instead (``"answered"`` then counts them all)."""
    from headmech.probes import ProbeOptions, build_probe
    from headmech.probes.facts import answer_is_top

    if batches is None:
        options = ProbeOptions(n_sequences=n_questions)
        batches = build_probe(probe, model, options).batches
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    plus, minus = torch.zeros(n_layers, n_heads), torch.zeros(n_layers, n_heads)
    positive = torch.zeros(n_layers, n_heads)
    answered = asked = 0
    sizes = [len(b.input_ids) for b in batches]
    if answered_only:
        recalled = answer_is_top(model, batches).split(sizes)
    else:
        recalled = tuple(torch.ones(n, dtype=torch.bool) for n in sizes)
    W_U = model.W_U.detach().float()
    for batch, ok in zip(batches, recalled, strict=True):
        e = batch.extras
        end = e["end_pos"]
        lo, hi = needle_span(batch)
        pos = torch.arange(batch.input_ids.shape[1])
        keys = pos[None] <= end[:, None]  # every key the answer step sees
        needle = (pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])
        rescale = (hi - lo).float() / (keys & ~needle).sum(1).float()  # [batch]
        u = W_U[:, e["answer"]].T  # [batch, d_model]
        names = [f"blocks.{la}.attn.{h}" for la in range(n_layers) for h in ("hook_v", "hook_pattern")]  # fmt: skip
        phi = key_writes(model, capture(model, batch, names), end, u)  # [batch, layer, head, key]
        on = (phi * needle[:, None, None]).sum(-1)  # [batch, n_layers, n_heads]
        off = (phi * (keys & ~needle)[:, None, None]).sum(-1) * rescale[:, None, None]
        plus += on[ok].sum(0).cpu()
        minus += off[ok].sum(0).cpu()
        positive += (on - off)[ok].gt(0).sum(0).cpu()
        answered, asked = answered + int(ok.sum()), asked + len(ok)
    n = max(answered, 1)
    return {"score": (plus - minus) / n, "L_plus": plus / n, "L_minus": minus / n,
            "positive": positive / n, "answered": answered, "asked": asked}  # fmt: skip
