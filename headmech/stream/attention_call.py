"""Head statistics inside the model's own attention call.

transformers hands an attention function (its ``AttentionInterface``) the final queries
and keys — after q/k norms and rotary embeddings — with the mask the model built (causal,
padding, sliding windows), the scaling, the soft-capping (Gemma 2) and the per-head sink
logits (gpt-oss). :func:`reducing` registers one such function, ``"headmech_stats"``, and
runs every layer's Hugging Face attention through it: the function gives the layer's
:class:`LayerCall` to a callback (the engine reduces pattern blocks from it,
:func:`pattern_rows`), then computes the attention output as the model would — fused SDPA
for plain attention, the model's own eager function where a variant (soft-capping, sinks)
has no fused kernel here (named once in a warning).

Nothing about the attention geometry is re-derived from the config, so every attention
variant the model's code implements is reproduced exactly: the pattern is the softmax of
the same scores under the same mask. :mod:`headmech.stream.blockwise` rebuilds patterns from the
hooked q and k instead, for the bridges whose attention does not go through a Hugging
Face attention function (GPT-2, GPT-NeoX, Phi-3, BERT).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core import heap
from headmech.stream import maxima as maxima_route
from headmech.stream import tiles
from headmech.stream.buffers import Buffers
from headmech.stream.forward import hf_attention_forward, masks_for, pattern_hooked

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.stream.maxima import RowMaxima

__all__ = ["IMPLEMENTATION", "LayerCall", "pattern_rows", "possible", "reducing"]

IMPLEMENTATION = "headmech_stats"


@dataclass(frozen=True)
class LayerCall:
    """What one layer's attention function received, as the pattern needs it (fp32).

    Attributes:
        q: queries ``[batch, n_heads, q_pos, d_head]``, as the scores multiply them.
        k: keys ``[batch, n_heads, k_pos, d_head]``, one per query head (grouped-query key
            heads repeated for the query heads they serve); under shared scores (``values``
            set, or the output from tiles) one per key-value head, ``[batch, n_kv_heads,
            k_pos, d_head]``, as ``values`` (the repeated copy was 19 MB a layer for
            SmolLM2 at 8,192 tokens): query head ``h`` reads key head ``h // (n_heads /
            n_kv_heads)``, as every reader of ``k`` does (:func:`pattern_rows`,
            :class:`~headmech.stream.points.Points`, the row maxima).
        mask: the model's mask, True where a query may attend, ``[batch | 1, 1, q_pos,
            k_pos]``; None: causal (or every key, for a bidirectional layer).
        scale: the factor on ``q · k``.
        softcap: scores become ``softcap · tanh(s / softcap)`` before the mask (Gemma 2).
        sinks: per query head, a sink logit in every softmax whose share is dropped
            (gpt-oss), ``[n_heads]``.
        causal: queries see no later key.
        lse: each query row's log-sum-exp of its masked scores ``[batch, n_heads,
            q_pos]``, from the fused kernel that computed the output (plain attention on
            CPU or CUDA); None where the output came from another kernel.
        maxima: each query row's largest masked score over any key set, from the kernel
            or computed (:mod:`headmech.stream.maxima`, under its ``row_maxima``); None
            outside it.
        values: shared scores (:mod:`headmech.stream.rows`): the values ``[batch,
            n_kv_heads, k_pos, d_head]`` (query head ``h`` reads key-value head ``h //
            (n_heads / n_kv_heads)``), from which the statistics' blocks of rows compute
            the output themselves; None where a kernel computed it.
        out: with ``values``, where the blocks write the output ``[batch, q_pos, n_heads,
            d_head]`` (the layout the model reads).
    """

    q: Float[Tensor, "batch n_heads q_pos d_head"]
    k: Float[Tensor, "batch n_kv_heads k_pos d_head"]
    mask: Tensor | None
    scale: float
    softcap: float | None
    sinks: Tensor | None
    causal: bool
    lse: Tensor | None = None
    maxima: RowMaxima | None = None
    values: Tensor | None = None
    out: Tensor | None = None


def _allowed(mask: Tensor | None) -> Tensor | None:
    """The model's mask as True = may attend (SDPA's boolean masks, or eager's additive)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def pattern_rows(call: LayerCall, rows: slice) -> Float[Tensor, "batch n_heads rows width"]:
    """Query rows ``rows`` of the layer's attention pattern, the model's own softmax.

    Under causal attention the keys after the block's last query get no weight and are
    left out: the block covers keys ``0 .. width - 1`` with ``width = rows.stop``. A row
    with no key to attend to (a padding query) is zero."""
    n_keys = call.k.shape[2]
    width = min(n_keys, rows.stop) if call.causal and n_keys == call.q.shape[2] else n_keys
    qb, kb = call.q[:, :, rows], call.k[:, :, :width]
    if kb.shape[1] != qb.shape[1]:  # shared scores keep one key per key-value head
        kb = kb.repeat_interleave(qb.shape[1] // kb.shape[1], 1)
    # the product, then the scale: eager attention's and the fused kernels' order
    scores = torch.matmul(qb, kb.transpose(-1, -2)).mul_(call.scale)  # [batch, head, rows, width]
    if call.softcap is not None:
        scores = scores.div_(call.softcap).tanh_().mul_(call.softcap)
    if call.mask is not None:
        hidden = ~call.mask[..., rows, :width]
    elif call.causal:
        q_pos = torch.arange(rows.start, rows.stop, device=scores.device) + n_keys - call.q.shape[2]
        hidden = torch.arange(width, device=scores.device)[None, :] > q_pos[:, None]
    else:
        hidden = None
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    if call.sinks is not None:
        sink = call.sinks.to(scores).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores, sink], -1)
        probs = torch.softmax(logits - logits.amax(-1, keepdim=True), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    if hidden is not None:
        empty = hidden.all(-1, keepdim=True)
        if bool(empty.any()):
            probs = probs.nan_to_num_(0.0).masked_fill_(empty, 0.0)
    return probs


# --- the attention function -------------------------------------------------------------

_CALLBACK = "_headmech_stats"  # module attribute: the layer's callback (or None)
# module attribute: the callback builds rows for every query (shared scores may compute the
# output, :mod:`headmech.stream.rows`)
_SHARED = "_headmech_shared"
_VARIANTS = "_headmech_stats_eager"  # module attribute: warned that it runs eager
# module attribute: every statistic reads points and maxima; a function that returns the key
# sets to maximise over (:func:`_tiled`)
_TILED = "_headmech_tiled"


def _output(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    **kwargs: Any,
) -> Tensor:
    """The attention output as the model computes it: fused SDPA, or the model's eager
    function for a variant SDPA does not take."""
    variants = [n for n in ("softcap", "s_aux") if kwargs.get(n) is not None]
    if not variants:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )[0]
    if not module.__dict__.get(_VARIANTS):
        module.__dict__[_VARIANTS] = True
        names = {"softcap": "logit soft-capping", "s_aux": "attention sink logits"}
        warnings.warn(
            f"{type(module).__name__}: no fused kernel here takes {' or '.join(names[n] for n in variants)}: "
            "this layer's attention runs eager (one T x T pattern at a time)",
            stacklevel=2,
        )
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]


def _with_lse(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Plain attention's output ``[batch, q_pos, n_heads, d_head]``, every row's
    log-sum-exp ``[batch, n_heads, q_pos]`` from one fused kernel (CPU: flash attention;
    CUDA: flash attention in half precision without a mask, else memory-efficient
    attention) and the key it was given (repeated for the query heads under grouped-query
    attention); None where none applies."""
    rep = query.shape[1] // key.shape[1]
    if rep > 1:  # grouped-query: kv head j serves a run of query heads
        key, value = _repeat(key, rep, "kernel_k"), _repeat(value, rep, "kernel_v")
    bias = attention_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill_(
            ~bias, torch.finfo(query.dtype).min
        )
    causal = bias is None and bool(getattr(module, "is_causal", True)) and query.shape[2] > 1
    bias = None if bias is None else bias.to(query.dtype)
    n_q = query.shape[2]
    try:
        if query.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, causal, attn_mask=bias, scale=scale
            )
        elif query.device.type == "cuda" and bias is None and query.dtype != torch.float32:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, 0.0, causal, False, scale=scale
            )[:2]
        elif query.device.type == "cuda":  # a mask, or fp32: the memory-efficient kernel
            if bias is not None:  # it wants the bias broadcast to every head
                bias = bias.expand(query.shape[0], query.shape[1], n_q, key.shape[2])
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, 0.0, causal, scale=scale
            )[:2]
        else:
            return None
    except RuntimeError:  # a shape or dtype the kernel does not take: no LSE
        return None
    return out.transpose(1, 2).contiguous(), lse[..., :n_q].float(), key


_BUFFERS: list[Buffers | None] = [None]  # the pass's buffers, inside reducing()


def _repeat(x: Tensor, rep: int, name: str) -> Tensor:
    """``x.repeat_interleave(rep, 1)``, into the pass's buffer ``name`` inside
    :func:`reducing` (one allocation per pass, not one per layer)."""
    buffers = _BUFFERS[0]
    if buffers is None:
        return x.repeat_interleave(rep, 1)
    return buffers.repeat_heads(name, x, rep)


def stats_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``"headmech_stats"`` attention function: the layer's callback (if any) gets its
    :class:`LayerCall`, with the rows' log-sum-exp where the output comes from a fused
    kernel that returns it; the output is the model's. ``query`` is ``[batch, n_heads,
    q_pos, d_head]``, ``key``/``value`` ``[batch, n_kv_heads, k_pos, d_head]``; returns
    ``([batch, q_pos, n_heads, d_head], None)``."""
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    callback = module.__dict__.get(_CALLBACK)
    if callback is None:
        return _output(module, query, key, value, attention_mask, scale, **kwargs), None
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    fused: tuple[Tensor, Tensor, Tensor | None] | None = None
    maxima = None
    causal = bool(getattr(module, "is_causal", True))
    if module.__dict__.get(_SHARED) and _shareable(query, softcap, sinks):
        sets = module.__dict__.get(_TILED) if TILED_MAXIMA else None
        key_sets = sets() if sets is not None else None
        out = _shared(query, key, value, attention_mask, scale, causal, callback, key_sets)
        return _released(out), None
    if softcap is None and sinks is None:
        flexed = maxima_route.flex_call(query, key, value, _allowed(attention_mask), causal, scale)
        if flexed is not None:
            fused, maxima = (flexed[0], flexed[1], None), flexed[2]
        else:
            fused = _with_lse(module, query, key, value, attention_mask, scale)
    k = key.detach()
    if k.shape[1] != query.shape[1]:  # grouped-query: kv head j serves a run of heads
        if fused is not None and fused[2] is not None and fused[2].dtype == torch.float32:
            k = fused[2].detach()  # the kernel's repeated copy, not made twice
        else:
            k = _repeat(k, query.shape[1] // k.shape[1], "stats_k")
    k = k.float()
    call = LayerCall(
        q=query.detach().float(),
        k=k,
        mask=_allowed(attention_mask),
        scale=scale,
        softcap=float(softcap) if softcap else None,
        sinks=None if sinks is None else sinks.detach().float(),
        causal=causal,
        lse=None if fused is None else fused[1],
        maxima=maxima,
    )
    if maxima is None and call.lse is not None and maxima_route.mode() == "explicit":
        call = dataclasses.replace(call, maxima=maxima_route.explicit_maxima(call))
    callback(call)
    del call, k
    if fused is not None:
        return _released(fused[0]), None
    return _released(_output(module, query, key, value, attention_mask, scale, **kwargs)), None


# free heap bytes above which a CPU layer's end returns them to the system (None: never;
# :mod:`headmech.core.heap`: which of two levels a long pass peaks at is otherwise the
# allocator's draw)
HEAP_LIMIT: int | None = heap.LIMIT
# ... on sequences of at least this many queries: where the heap's level was measured
# (8,192 tokens: no time cost within the turns' spread); on short batches a trim each
# layer cost more than it saved (Qwen2.5 0.5B, 16 prose sentences: 266 s against 244 s)
HEAP_MIN_TOKENS = 4096


def _released(out: Tensor) -> Tensor:
    """``out`` (``[batch, q_pos, heads, d]``), after a long CPU layer's statistics gave
    the C heap's free pages back."""
    if out.device.type == "cpu" and int(out.shape[1]) >= HEAP_MIN_TOKENS:
        heap.release(HEAP_LIMIT)
    return out


# shared scores on (:func:`_shareable`); off, a CPU pass that builds rows runs the fused
# kernel for the output and computes the rows' scores again (the reference path)
SHARED_SCORES = True


def _shareable(query: Tensor, softcap: Any, sinks: Any) -> bool:
    """Whether shared scores (:mod:`headmech.stream.rows`) may compute this call's output:
    plain float32 attention on a CPU (where it measured faster than the fused kernel plus
    the statistics' own q·kᵀ), unless the call gets its rows' maxima
    (:func:`headmech.stream.maxima.engaged`)."""
    return (
        SHARED_SCORES
        and query.device.type == "cpu"
        and query.dtype == torch.float32
        and softcap is None
        and sinks is None
        and not maxima_route.engaged(query.device)
    )


def _plain(
    query: Tensor, k: Tensor, mask: Tensor | None, scale: float, causal: bool, **rest: Any
) -> LayerCall:
    """The call of plain attention (no softcap, no sinks) with ``rest``'s fields."""
    return LayerCall(
        q=query.detach(),
        k=k,
        mask=mask,
        scale=scale,
        softcap=None,
        sinks=None,
        causal=causal,
        **rest,
    )


# the output, log-sum-exp and maxima from tiles (:mod:`headmech.stream.tiles`) where a
# shared-scores pass needs only points and maxima; off, the row path (shared scores)
TILED_MAXIMA = True


def _shared(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scale: float,
    causal: bool,
    callback: Callable[[LayerCall], None],
    key_sets: Sequence[Tensor] | None = None,
) -> Tensor:
    """The layer's output ``[batch, q_pos, n_heads, d_head]`` from shared scores. With
    ``key_sets`` (the pass needs only points and maxima), from tiles that also give each
    row's log-sum-exp and maxima over every key and over ``key_sets``
    (:func:`headmech.stream.tiles.attend`): the callback gets them as a kernel's (a key set
    not declared is maximised from the scores again, :func:`explicit_maxima`). Without,
    the callback's blocks of rows compute it from the values (:class:`LayerCall`'s
    ``values`` and ``out``); the keys stay one per key-value head, as the values: each
    block reads its head's."""
    if key_sets is not None:
        return _tiled(query, key, value, attention_mask, scale, causal, callback, key_sets)
    k = key.detach()
    n_seqs, n_heads, n_q = query.shape[:3]
    out = query.new_empty(n_seqs, n_q, n_heads, value.shape[-1])
    call = _plain(query, k, _allowed(attention_mask), scale, causal, values=value.detach(), out=out)
    callback(call)
    return out


def _tiled(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scale: float,
    causal: bool, callback: Callable[[LayerCall], None], key_sets: Sequence[Tensor],
) -> Tensor:  # fmt: skip
    """:func:`_shared`'s output from tiles."""
    mask = _allowed(attention_mask)
    key_sets = [s for s in key_sets if s.shape == (query.shape[0], key.shape[2])]
    done = tiles.attend(query, key, value, mask, scale, causal, key_sets, _BUFFERS[0])
    # the keys one per key-value head: points and maxima read each query head's from its
    # key head's (the repeated copy was 19 MB a layer for SmolLM2 at 8,192 tokens)
    call = _plain(query, key.detach(), mask, scale, causal, lse=done.lse)
    known = list(zip(key_sets, done.sets, strict=True))
    rows = maxima_route.explicit_maxima(call, done.every, known)
    callback(dataclasses.replace(call, maxima=rows))
    return done.out


def _register() -> None:
    """Register the function with transformers, and SDPA's mask format for a model whose
    own configuration names it (the bridge keeps its model's masks: the function takes
    boolean and additive masks alike); idempotent, on first use, not at import."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, stats_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def possible(model: TransformerBridge) -> str | None:
    """None where every layer's attention is a Hugging Face module that calls transformers'
    attention interface under the bridge (rotary decoders: LLaMA, Mistral, Qwen, Gemma,
    OLMo, gpt-oss, ...) and no hook reads the pattern; else why not."""
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    for layer, block in enumerate(model.blocks):
        attn = getattr(block, "attn", None)
        if not isinstance(attn, PositionEmbeddingsAttentionBridge):
            return f"layer {layer}'s attention ({type(attn).__name__}) runs in the bridge"
        config = getattr(attn.original_component, "config", None)
        if getattr(config, "_attn_implementation", None) is None:
            return f"layer {layer}'s attention module has no attention implementation"
    if pattern_hooked(model):
        return "a hook reads or edits the pattern"
    return None


@contextlib.contextmanager
def reducing(
    model: TransformerBridge,
    layers: Sequence[int],
    callback: Callable[[int, LayerCall], None],
) -> Iterator[None]:
    """Inside the block, every layer's attention runs through ``"headmech_stats"`` (the
    Hugging Face module, not the bridge's eager attention) and ``callback(layer, call)``
    runs in the layers ``layers``. Forward values equal the eager bridge's to float
    rounding; pattern hooks do not fire. A callback whose ``every_row`` attribute is true
    builds rows for every query (:func:`headmech.stream.passes.call_reducer` says so): on
    a CPU its blocks then compute the layer's output as well (shared scores,
    :mod:`headmech.stream.rows`), and no fused kernel runs.

    Raises:
        ValueError: :func:`possible` says why the model's attention cannot be reached.
    """
    why = possible(model)
    if why is not None:
        raise ValueError(f"cannot reduce inside the attention call: {why}")
    _register()
    attns = [block.attn for block in model.blocks]
    # SDPA's masks (None for plain causal attention) where every layer's output comes from
    # the fused kernel; a layer run eager (soft-capping, sinks) needs eager's additive mask
    eager = any(_variant(block.attn.original_component) for block in model.blocks)
    _BUFFERS[0] = Buffers()
    try:
        with (
            contextlib.nullcontext() if eager else masks_for(model, IMPLEMENTATION),
            _calling(attns, layers, callback),
        ):
            yield
    finally:
        _BUFFERS[0] = None
        maxima_route.forget()


def _variant(hf: Any) -> bool:
    """Whether the Hugging Face attention module has a variant no fused kernel here takes."""
    return any(getattr(hf, n, None) is not None for n in ("sinks", "attn_logit_softcapping"))


@contextlib.contextmanager
def _calling(
    attns: list[Any], layers: Sequence[int], callback: Callable[[int, LayerCall], None]
) -> Iterator[None]:
    """Every layer's attention through ``"headmech_stats"``; the callback in ``layers``."""
    try:
        for layer, attn in enumerate(attns):
            # the bridge forwards setattr to the wrapped module: go through __dict__
            attn.__dict__["forward"] = hf_attention_forward(attn, IMPLEMENTATION)
            if layer in layers:
                attn.original_component.__dict__[_CALLBACK] = lambda call, layer=layer: callback(
                    layer, call
                )
                attn.original_component.__dict__[_SHARED] = bool(
                    getattr(callback, "every_row", False)
                )
                attn.original_component.__dict__[_TILED] = getattr(callback, "maxima_keys", None)
        yield
    finally:
        for attn in attns:
            attn.__dict__.pop("forward", None)
            attn.original_component.__dict__.pop(_CALLBACK, None)
            attn.original_component.__dict__.pop(_SHARED, None)
            attn.original_component.__dict__.pop(_TILED, None)
