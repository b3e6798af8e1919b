"""Layer-wise relevance propagation of attention heads (AttnLRP), in one backward pass.

The idea: LRP explains one output (here a logit) by redistributing its value backwards,
layer by layer, onto the neurons that produced it. For the rules AttnLRP uses, that
redistribution equals *input × modified gradient*: run the ordinary backward pass with
a few local gradients replaced, then multiply every activation by its gradient. A head's
relevance is then ``z · ∂̃logit/∂z`` summed over the head's output ``z`` (``hook_z``), the
quantity Voita et al. normalise per layer to rank heads. One forward and one backward
pass explain every position of a batch at once, because the modified backward is linear
in the relevance it starts from.

The modified gradients (Achtibat et al. 2024, as implemented in LXT's "efficient" mode)
are a table, :data:`headmech.attribution.lrp_rules.RULES`, one row and one small rule
function per layer kind; :func:`lrp_rules` walks the model's modules and installs the
matching rule as a forward hook that leaves every forward value bit-identical:

============================  ==============================================================
operation                     rule, as a gradient change
============================  ==============================================================
LayerNorm / RMSNorm           identity rule: the 1/std (1/rms) factor is a constant
element-wise activation       identity rule: gradient ``f(x)/x`` (GELU, SiLU, ...)
gated MLP ``act(g) * up``     uniform rule: gradient ÷2 on both factors
attention ``softmax(qkᵀ)v``   uniform rule on both bilinear products: ÷4 on ``q`` and ``k``,
                              ÷2 on ``v``; softmax keeps its gradient (× input it is the
                              AttnLRP softmax rule)
linear layers, embeddings     plain gradient (LRP-0 / ε-rule without ε)
dropout                       off (the model runs in eval mode)
============================  ==============================================================

What is conserved. Every rule above but the softmax's passes on exactly the relevance
it receives, except that an additive bias ``b`` keeps ``b · grad`` for itself. So the
explained logit splits exactly (to float rounding) into

    logit = R(embeddings) + R(biases) + R(softmax),

where R(embeddings) sums ``embedding output × gradient`` over every embedding the model
adds at its input (token, and for BERT/GPT-2 also position and token type), R(biases)
sums ``b · ∂̃logit/∂b`` over every bias parameter (linear layers, LayerNorm shifts, the
unembedding's bias), and R(softmax) is what the softmax rule absorbs: per query row,
``(Σ_j A_j g_j − Σ_j s_j A_j (g_j − Σ_k A_k g_k)) / 2`` with pattern ``A``, scores ``s``
and ``g = ∂̃/∂A``. The softmax rule is not conservative (it behaves like a bias,
Achtibat et al. 2024, Sec. 3.3.1), so "logit = R(embeddings)" holds only approximately,
and exactly only on models with no biases *and* no attention; :func:`lrp_relevance`
reports every term so the split can be checked.

For an encoder (BERT, ``minilm-l6``) the explained "logit" is the masked-language-model
head's logit of the top-1 token. ``minilm-l6`` ships without an MLM head, so
:func:`headmech.models.load_model` gives it a fixed one: identity dense layer, GELU,
LayerNorm without affine parameters, decoder tied to the word embeddings, zero bias. Its
top-1 logit at a position is the dot product of the normalised, GELU-rectified final
hidden state with the nearest word embedding: relevance explains which inputs make the
final state point at that word (usually the input token itself), not a trained
prediction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.attribution.lrp_explain import (
    Taps,
    explain_logit,
    head_relevance,
    model_device,
    one_sequence,
    relevance_terms,
    selected_logits,
    tapped,
)
from headmech.attribution.lrp_rules import QKV_SCALE, RuleHooks, installed_rules, lrp_rules
from headmech.core.errors import InputError
from headmech.runs import resume
from headmech.stream.engine import ProbeBatch
from headmech.stream.uncertainty import UnitValues

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["METRIC", "lrp_head_relevance", "lrp_relevance", "lrp_rules"]

METRIC = "AttnLRP head relevance (hook_z x modified gradient), normalised per layer"
"""What :func:`lrp_head_relevance` measures, for ``importance.json``."""

# The attention rule's gradient factors, read at call time by both relevance functions
# (a test replaces them to show that wrong rules break the conservation split).
_QKV_SCALE: Mapping[str, float] = QKV_SCALE


def lrp_relevance(
    model: TransformerBridge,
    input_ids: Int[Tensor, " pos"] | Int[Tensor, "1 pos"],
    attention_mask: Int[Tensor, " pos"] | Int[Tensor, "1 pos"] | None = None,
    *,
    position: int = -1,
    target: int | None = None,
) -> dict[str, Any]:
    """AttnLRP relevance of one logit for the input embeddings and every head.

    One forward and one modified backward pass (see the module docstring for the rules).

    Args:
        model: a ``TransformerBridge``.
        input_ids: one token sequence.
        attention_mask: 1 for real tokens (default: all real).
        position: the position whose logit is explained; negative values count back from
            the last real token.
        target: the vocabulary id whose logit is explained (default: the top-1 logit).

    Returns:
        A dict with
        ``logit`` (the explained logit value), ``target`` and ``position`` (ints);
        ``embedding``: ``Float[pos, d_model]`` relevance of the token embeddings and
        ``tokens``: the same summed to ``Float[pos]``;
        ``other_embeddings``: ``{name: Float[pos]}`` for position / token-type embeddings;
        ``heads``: ``Float[n_layers, n_heads]`` per-head relevance (``hook_z`` × gradient
        summed over positions and ``d_head``; not normalised);
        ``attn_out``: ``Float[n_layers]`` relevance at each attention output projection's
        output (bias included), and ``attn_bias``: ``Float[n_layers]`` the part its bias
        keeps;
        ``input``: relevance summed over every input embedding; ``bias``: relevance
        absorbed by all bias parameters; ``softmax``: ``Float[n_layers]`` relevance absorbed
        by the softmax rule; ``conservation_error``: ``logit - input`` and ``residual``:
        ``logit - input - bias - softmax.sum()`` (zero up to rounding).

    Raises:
        InputError: more than one sequence, or ``position`` outside the real tokens.

    References:
        Achtibat et al. 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation
        for Transformers", ICML 2024.
        Arras et al. 2025, input × modified gradient as LRP ("efficient" AttnLRP).
        Voita et al. 2019, "Analyzing Multi-Head Self-Attention", ACL 2019.

    Examples:
        >>> out = lrp_relevance(model, model.to_tokens("The cat sat")[0])  # doctest: +SKIP
        >>> out["heads"].shape  # doctest: +SKIP
        torch.Size([30, 9])
    """
    ids, mask, pos = one_sequence(model, input_ids, attention_mask, position)
    explained = explain_logit(model, ids, mask, pos, target, qkv_scale=_QKV_SCALE)
    return relevance_terms(model, explained, pos)


# --- lrp_head_relevance: many predictions, per-layer normalised ----------------------


def _normalised(
    r: Float[Tensor, "... n_layers n_heads"],
) -> Float[Tensor, "... n_layers n_heads"]:
    """Each layer's heads divided by the sum of their absolute values."""
    return r / r.abs().sum(-1, keepdim=True).clamp_min(1e-30)


def _stacked(
    zs: list[Tensor], grads: Sequence[Tensor | None], n_heads: int
) -> Float[Tensor, "batch n_layers n_heads"]:
    """Per-head relevance of every layer, summed over positions."""
    return torch.stack(
        [head_relevance(z, g, n_heads).sum(1) for z, g in zip(zs, grads, strict=True)], 1
    )


def _per_sequence(
    picked: Float[Tensor, "batch pos"],
    zs: list[Tensor],
    select: Bool[Tensor, "batch pos"],
    n_heads: int,
    *,
    normalise: bool,
) -> tuple[Float[Tensor, "units n_layers n_heads"], Float[Tensor, " units"]]:
    """One backward pass for every prediction of a batch; per sequence, its relevance and
    how many terms it counts for.

    LRP is linear in the starting relevance, so each sequence gets the exact sum over
    its predictions; normalised, a sequence counts once, else each prediction does.
    """
    grads = torch.autograd.grad(picked.sum(), zs, allow_unused=True)
    rel = _stacked(zs, grads, n_heads).cpu().double()  # [batch, n_layers, n_heads]
    has = select.any(1).cpu()
    if normalise:
        return _normalised(rel[has]), torch.ones(int(has.sum()), dtype=torch.float64)
    return rel[has], select.sum(1).cpu()[has].double()


def _per_prediction(
    picked: Float[Tensor, "batch pos"],
    zs: list[Tensor],
    select: Bool[Tensor, "batch pos"],
    n_heads: int,
    *,
    normalise: bool,
) -> Iterator[tuple[Float[Tensor, "units n_layers n_heads"], Float[Tensor, " units"]]]:
    """One backward pass per position; yields each of its predictions' relevance (a unit
    each)."""
    for t in range(select.shape[1]):
        rows = select[:, t]
        if not bool(rows.any()):
            continue
        grads = torch.autograd.grad(picked[:, t].sum(), zs, retain_graph=True, allow_unused=True)
        rel = _stacked(zs, grads, n_heads)  # [batch, n_layers, n_heads]
        rel = rel[rows.to(rel.device)].cpu().double()
        yield (
            (_normalised(rel) if normalise else rel),
            torch.ones(rel.shape[0], dtype=torch.float64),
        )


def _batch_relevance(
    model: TransformerBridge,
    rules: RuleHooks,
    batch: ProbeBatch,
    *,
    normalise: bool,
    per_prediction: bool,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Head relevance of one batch (already on the model's device), as (per-unit
    relevance, per-unit count) parts.

    Every real, non-special position is a prediction; its top-1 logit is explained.
    """
    select = batch.attention_mask.bool() & ~batch.special
    if not bool(select.any()):
        return
    taps = Taps()
    with tapped(model, taps, patterns=False):
        rules.reset()
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)
        rules.check()
    picked, _ = selected_logits(logits, select, None)
    zs = [taps.z[i] for i in sorted(taps.z)]
    n_heads = int(model.cfg.n_heads)
    if per_prediction:
        yield from _per_prediction(picked, zs, select, n_heads, normalise=normalise)
    else:
        yield _per_sequence(picked, zs, select, n_heads, normalise=normalise)


def _accumulated(
    model: TransformerBridge,
    batches: Iterable[ProbeBatch],
    *,
    normalise: bool,
    per_prediction: bool,
    progress: bool,
) -> UnitValues | None:
    """Head relevance per unit (sequence, or prediction with ``per_prediction``) over
    ``batches`` in float64, with how many terms each unit counts for (None: no unit)."""
    device = model_device(model)
    batches = list(batches)
    if not batches:
        return None

    def one(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
        parts = list(
            _batch_relevance(
                model, rules, batch.to(device), normalise=normalise, per_prediction=per_prediction
            )
        )
        if not parts:  # nothing to explain in this batch
            shape = (0, int(model.cfg.n_layers), int(model.cfg.n_heads))
            return torch.zeros(shape, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
        n, d = [p[0] for p in parts], [p[1] for p in parts]
        return torch.cat(n).double().cpu(), torch.cat(d).double().cpu()

    # under torchrun: this rank's share of the batches, every batch's rows gathered
    with torch.enable_grad(), installed_rules(model, _QKV_SCALE) as rules:
        num, den = resume.sharded_units(batches, one, "LRP" if progress else False)
    if den.numel() == 0:
        return None
    return UnitValues(num, den)


def lrp_head_relevance(
    model: TransformerBridge,
    batches: Iterable[ProbeBatch],
    *,
    normalise: bool = True,
    per_prediction: bool = False,
    progress: bool = False,
    return_units: bool = False,
) -> Any:
    """AttnLRP head relevance (Voita et al. 2019) averaged over probe data.

    Every real, non-special position of every sequence is a prediction to explain; its
    top-1 logit is the relevance that starts the backward pass. A head's relevance for a
    prediction is ``hook_z × modified gradient`` summed over its positions and ``d_head``.

    Normalisation (``normalise=True``): within each layer, a head's relevance is divided
    by the sum of the absolute relevances of that layer's heads, so the absolute values
    in a layer sum to 1 and a head's sign is kept (a head that lowers the logit stays
    negative). By default one backward pass explains all predictions of a batch at once
    (LRP is linear in the starting relevance, so this gives the *sum* over a sequence's
    predictions exactly); the per-layer normalisation is then applied per sequence, and
    the result averaged over sequences. ``per_prediction=True`` normalises each prediction
    before averaging, as Voita et al. do, at the cost of one backward pass per position.

    Without normalisation the result is the mean relevance per explained prediction, in
    logit units.

    Args:
        model: a ``TransformerBridge``.
        batches: right-padded probe batches (:class:`~headmech.stream.engine.ProbeBatch`).
        normalise: normalise within each layer (see above).
        per_prediction: normalise each prediction separately (one backward per position).
        progress: show a progress bar.
        return_units: also return the per-unit values (bootstrap intervals).

    Returns:
        Per-head relevance, ``[n_layers, n_heads]`` (query heads under grouped-query
        attention); with ``return_units``, ``(relevance, UnitValues)``.

    Raises:
        InputError: the batches contain no position to explain.

    References:
        Voita et al. 2019, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the
        Heavy Lifting, the Rest Can Be Pruned", ACL 2019.
        Achtibat et al. 2024, "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation
        for Transformers", ICML 2024.
        Arras et al. 2025, input × modified gradient as LRP ("efficient" AttnLRP).

    Examples:
        >>> lrp_head_relevance(model, probe.batches).abs().sum(-1)  # doctest: +SKIP
        tensor([1., 1., ...])
    """
    units = _accumulated(
        model, batches, normalise=normalise, per_prediction=per_prediction, progress=progress
    )
    if units is None:
        raise InputError("no position to explain: every token is special or padding")
    return (units.point(), units) if return_units else units.point()
