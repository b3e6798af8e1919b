"""What a head writes toward an answer, split by the keys it reads.

With the final norm's scale frozen, a head's direct effect on a logit is a sum over the keys
it attends to, ``α_j (v_j W_O) · d`` (:func:`headmech.interventions.direct_effects.key_writes`).
Grouping the keys gives two published scores:

* :func:`direct_effects_by_source` and :func:`subject_relation_scores` — Chughtai et al.
  2024's subject and relation heads: the share of a head's direct logit attribution to a
  fact's answer that comes from the subject's tokens, and from the relation's;
* :func:`locos_scores` — LOCOS's logit contribution (arXiv 2607.01002): what a head
  writes toward the answer's unembedding from the needle's keys (:func:`needle_span`)
  minus the rest, rescaled to the needle's length.

References:
    Chughtai, Cooney, Nanda 2024, "Summing Up the Facts: Additive Mechanisms Behind
    Factual Recall in LLMs", arXiv:2402.07321. LOCOS, arXiv:2607.01002, 2026 (code:
    aryopg/locos, ``locos/detectors/logit_contrib.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.errors import HeadmechError
from headmech.core.placement import model_device
from headmech.interventions import capture, recording
from headmech.interventions.direct_effects import key_writes
from headmech.models.weights import norm_weight
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "check_linear_readout",
    "direct_effects_by_source",
    "locos_scores",
    "needle_span",
    "norm_scale",
    "subject_relation_scores",
]


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


def norm_scale(model: TransformerBridge, resid: Tensor, kind: str) -> Tensor:
    """The final norm's clean scale for these residual vectors (what its hook_scale holds)."""
    with torch.no_grad(), recording(model, ["ln_final.hook_scale"]) as store:
        model.ln_final(resid.to(model.ln_final.weight.dtype))
    if "ln_final.hook_scale" in store:
        return store["ln_final.hook_scale"].detach().float().reshape(resid.shape[0], 1)
    eps = float(getattr(model.cfg, "eps", 1e-5))
    x = resid - resid.mean(-1, keepdim=True) if kind == "LN" else resid
    return (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


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
    dev = model_device(model)
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
