"""Per-head windowed attention for a :class:`~headmech.kv.plan.KVPlan`, exactly.

A windowed head's query at position ``t`` may attend to keys ``k <= t`` with ``k <
sinks`` or ``t - k <= window``; a full head to every ``k <= t``. The softmax of a masked
score row is exactly the attention over the kept keys, so a windowed head computed with
this mask over the whole cache equals the same head computed over a cache that stores
only its sinks and window (:mod:`headmech.kv.cache`).

Soft-capped scores (Gemma 2) and per-head sink logits (gpt-oss) are kept: where a model
has them the softmax is written out (:class:`Extras`) instead of the fused kernel.

The mask is applied in the Hugging Face model's own attention: :func:`planned` registers
one attention function, ``"headmech_kv"``, in transformers' ``AttentionInterface`` (its
padding/causal masks are built as for SDPA) and runs the model with it. Per layer it
splits the query heads into those whose KV head is full (fused SDPA with the model's
causal mask) and the windowed ones (SDPA with the band mask above). It also accepts the
split keys of :class:`~headmech.kv.cache.PlanCache` (full and windowed heads of different
lengths). No TransformerLens hook is involved: the bridge's weights are shared with a
plain Hugging Face model (:func:`hf_model`) that runs its fused attention.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.errors import UnsupportedModelError
from headmech.kv.plan import KVPlan

__all__ = [
    "IMPLEMENTATION",
    "Extras",
    "LayerPlan",
    "Split",
    "allowed_keys",
    "hf_model",
    "planned",
]

IMPLEMENTATION = "headmech_kv"
_BLOCK = 256  # query rows per block of windowed attention over a whole sequence
# the most query x key entries a windowed head's mask may have as one tensor (8k x 8k):
# beyond it the blocks run even for a wide window (a 32k-token mask is 1 GiB, its gaps 8)
_DENSE = 1 << 26


@dataclass(frozen=True)
class LayerPlan:
    """One layer's part of a plan, as index tensors (KV heads and their query heads)."""

    full_kv: Tensor
    win_kv: Tensor
    full_q: Tensor
    win_q: Tensor
    sinks: int
    window: int

    @classmethod
    def of(cls, plan: KVPlan, layer: int) -> LayerPlan:
        """Layer ``layer`` of ``plan``."""
        full = plan.full[layer]
        q = plan.query_full()[layer]
        return cls(
            full.nonzero()[:, 0], (~full).nonzero()[:, 0], q.nonzero()[:, 0],
            (~q).nonzero()[:, 0], plan.sinks, plan.window,
        )  # fmt: skip


@dataclass(frozen=True)
class Split:
    """Keys (or values) of one layer held by a :class:`~headmech.kv.cache.PlanCache`.

    Attributes:
        full: ``[batch, n_full_kv, length, d_head]``: every position, full KV heads.
        windowed: ``[batch, n_windowed_kv, kept, d_head]``: windowed KV heads.
        positions: ``[kept]``: the positions of ``windowed``'s entries.
        length: positions seen so far, the current step's included.
        plan: the cache layer's plan, which the attention follows; it differs from the
            module's in a layer with the model's own sliding window (every head
            windowed to that window, no sinks).
    """

    full: Tensor
    windowed: Tensor
    positions: Tensor
    length: int
    plan: LayerPlan | None = None


def allowed_keys(
    q_pos: Int[Tensor, " q"], k_pos: Int[Tensor, " k"], sinks: int, window: int | None
) -> Bool[Tensor, "q k"]:
    """Causal mask, and with ``window`` the sinks-plus-window mask of a windowed head."""
    gap = q_pos[:, None] - k_pos[None, :]
    ok = gap >= 0
    if window is not None:
        ok &= (k_pos[None, :] < sinks) | (gap <= window)
    return ok


def _as_bool(mask: Tensor | None) -> Tensor | None:
    """The model's mask as True = may attend (SDPA's bool masks, or eager's additive ones)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


@dataclass(frozen=True)
class Extras:
    """What some models' attention adds to ``softmax(q kᵀ) v``, as transformers passes it
    to an attention function: Gemma 2's soft-capping of the scores (``softcap``: ``c ·
    tanh(s / c)`` before the mask) and gpt-oss's per-head sink logits (``s_aux``: one more
    column in every softmax, dropped after it)."""

    softcap: float | None = None
    sinks: Tensor | None = None  # [n_heads] for the query heads at hand

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> Extras:
        """The extras among an attention function's keyword arguments."""
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")
        return cls(float(softcap) if softcap else None, sinks)

    def pick(self, idx: Tensor) -> Extras:
        """The extras of the query heads ``idx``."""
        if self.sinks is None:
            return self
        return Extras(self.softcap, self.sinks[idx.to(self.sinks.device)])

    @property
    def none(self) -> bool:
        """Plain attention: fused SDPA computes it."""
        return self.softcap is None and self.sinks is None


_PLAIN = Extras()


def _sdpa(
    q: Float[Tensor, "batch hq q d"],
    k: Float[Tensor, "batch hk k d"],
    v: Float[Tensor, "batch hk k d"],
    allowed: Bool[Tensor, "batch 1 q k"] | None,
    scaling: float,
    extras: Extras = _PLAIN,
) -> Float[Tensor, "batch hq q d"]:
    """SDPA of grouped heads; ``allowed`` None means plain causal with q == k. With
    ``extras`` (soft-capping, sinks) the softmax is written out, as the model's eager
    attention computes it."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if allowed is None and extras.none:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scaling)
    if allowed is None:  # causal, the queries being the last positions
        n_q, n_k = q.shape[2], k.shape[2]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        allowed = allowed[None, None]
    # a row with nothing to see (a padding query) would give NaN; let it see everything
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    if extras.none:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
    scores = (q @ k.transpose(-1, -2)) * scaling  # [batch, hq, q, k]
    if extras.softcap is not None:
        scores = extras.softcap * torch.tanh(scores / extras.softcap)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if extras.sinks is not None:
        sink = extras.sinks.to(scores).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores, sink], -1)
        logits = logits - logits.amax(-1, keepdim=True)
        probs = logits.softmax(-1)[..., :-1]  # the sink's share is dropped
    else:
        probs = scores.softmax(-1)
    return probs.to(v.dtype) @ v


@functools.lru_cache(maxsize=16)
def _all_full(n_heads: int, n_kv_heads: int) -> LayerPlan:
    return LayerPlan.of(KVPlan(torch.ones(1, n_kv_heads, dtype=torch.bool), n_heads), 0)


def _causal(q_pos: Tensor, length: int, pad: Tensor | None) -> Tensor | None:
    """The full heads' mask: None where SDPA's own causal flag is exact (no padding and the
    queries are all positions, or a single query that may see every key)."""
    if pad is None and (len(q_pos) == length or len(q_pos) == 1):
        return None
    allowed = allowed_keys(q_pos, torch.arange(length, device=q_pos.device), 0, None)[None, None]
    return allowed if pad is None else allowed & pad


def _pick(x: Tensor, idx: Tensor) -> Tensor:
    """``x[:, idx]``, without a copy when ``idx`` is every head in order."""
    if idx.numel() == x.shape[1] and bool((idx.cpu() == torch.arange(x.shape[1])).all()):
        return x
    return x[:, idx.to(x.device)]


def planned_attention(
    module: Any,
    query: Tensor,
    key: Tensor | Split,
    value: Tensor | Split,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``"headmech_kv"`` attention function (transformers' ``AttentionInterface``).

    ``query`` is ``[batch, n_heads, q, d_head]``; ``key``/``value`` the layer's keys and
    values (``[batch, n_kv_heads, k, d_head]``) or a :class:`Split` from a plan cache.
    The module's ``_headmech_kv`` (:class:`LayerPlan`) says which heads are windowed;
    without one every head is full. Returns ``([batch, q, n_heads, d_head], None)``.
    """
    lp: LayerPlan | None = module.__dict__.get("_headmech_kv")
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    n_q = query.shape[2]
    if isinstance(key, Split) and isinstance(value, Split) and lp is not None:
        lp, length, win_pos = key.plan or lp, key.length, key.positions.to(query.device)
        full_k, full_v, win_k, win_v = key.full, value.full, key.windowed, value.windowed
    elif isinstance(key, Tensor) and isinstance(value, Tensor):
        length = key.shape[2]
        lp = lp or _all_full(query.shape[1], key.shape[1])
        full_k, full_v = _pick(key, lp.full_kv), _pick(value, lp.full_kv)
        win_k, win_v = _pick(key, lp.win_kv), _pick(value, lp.win_kv)
        win_pos = torch.arange(length, device=query.device)
    else:
        raise TypeError("planned_attention: keys and values of one kind, and a plan for a cache")
    q_pos = torch.arange(length - n_q, length, device=query.device)
    pad = _as_bool(attention_mask)  # [batch | 1, 1, q, length] or None
    extras = Extras.of(kwargs)
    out = query.new_empty(*query.shape[:3], value_dim(full_v, win_v))
    if lp.full_q.numel():
        sel = lp.full_q.to(query.device)
        own = _own_window(module, kwargs, pad, n_q, length)
        if own is not None:  # the model's own sliding window: only the band is computed
            out[:, sel] = _local(query[:, sel], full_k, full_v, q_pos, own, pad, scale,
                                 extras.pick(sel))  # fmt: skip
        else:
            causal = _causal(q_pos, length, pad)
            out[:, sel] = _sdpa(_pick(query, sel), full_k, full_v, causal, scale,
                                extras.pick(sel))  # fmt: skip
    if lp.win_q.numel():
        sel = lp.win_q.to(query.device)
        blocks = lp.window < length // 4 or n_q * length > _DENSE  # cheaper, or smaller
        if win_pos.numel() == length and n_q > 2 * _BLOCK and blocks:
            out[:, sel] = _local(
                query[:, sel], win_k, win_v, q_pos, lp, pad, scale, extras.pick(sel)
            )
        else:
            band = allowed_keys(q_pos, win_pos, lp.sinks, lp.window)[None, None]
            band = band if pad is None else band & pad[..., win_pos]
            out[:, sel] = _sdpa(query[:, sel], win_k, win_v, band, scale, extras.pick(sel))
    return out.transpose(1, 2).contiguous(), None


def _own_window(
    module: Any, kwargs: dict[str, Any], pad: Tensor | None, n_q: int, length: int
) -> LayerPlan | None:
    """For a layer with its own sliding window (Gemma 2/3, Mistral), over a whole sequence
    much longer than the window: a band at least as wide as the model's window (no sinks),
    which the model's own mask ``pad`` then cuts to exactly its window
    (:func:`_local` intersects the two). None where the plain path is as cheap, or where
    the model passed no mask to cut with."""
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if not window or pad is None or n_q != length or n_q <= 2 * _BLOCK:
        return None
    if int(window) >= length // 4:
        return None
    none = torch.zeros(0, dtype=torch.long)
    return LayerPlan(none, none, none, none, 0, int(window))


def _local(
    q: Float[Tensor, "batch hq q d"],
    k: Float[Tensor, "batch hk k d"],
    v: Float[Tensor, "batch hk k d"],
    q_pos: Int[Tensor, " q"],
    lp: LayerPlan,
    pad: Tensor | None,
    scale: float,
    extras: Extras = _PLAIN,
) -> Float[Tensor, "batch hq q d"]:
    """Windowed heads over every position (``k`` holds position ``j`` at index ``j``), a
    block of queries at a time against the sinks and the keys their windows reach: the
    same softmax as the band mask over all keys, at O(q x (window + block)) cost."""
    out = []
    for start in range(0, len(q_pos), _BLOCK):
        qp = q_pos[start : start + _BLOCK]
        lo = max(0, int(qp[0]) - lp.window)
        keys = torch.cat([torch.arange(min(lp.sinks, lo)), torch.arange(lo, int(qp[-1]) + 1)])
        keys = keys.to(q.device)
        allowed = allowed_keys(qp, keys, lp.sinks, lp.window)[None, None]
        if pad is not None:
            allowed = allowed & pad[..., start : start + _BLOCK, :][..., keys]
        block = q[:, :, start : start + _BLOCK]
        out.append(_sdpa(block, k[:, :, keys], v[:, :, keys], allowed, scale, extras))
    return torch.cat(out, 2)


def value_dim(full_v: Tensor, win_v: Tensor) -> int:
    """The value head size (from whichever part has heads)."""
    return int(full_v.shape[-1] if full_v.shape[1] else win_v.shape[-1])


def _register() -> None:
    """Register the attention function and its mask builder (SDPA's) with transformers
    (idempotent; done on first use, not at import)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, planned_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def attention_modules(hf: Any) -> list[Any]:
    """The self-attention modules of a Hugging Face decoder, in layer order."""
    mods = [
        m
        for m in hf.modules()
        if type(m).__name__.endswith("Attention")
        and isinstance(getattr(m, "layer_idx", None), int)
        and not getattr(m, "is_cross_attention", False)
    ]
    n_layers = int(getattr(hf.config, "num_hidden_layers", None) or hf.config.n_layer)
    if sorted(m.layer_idx for m in mods) != list(range(n_layers)):
        raise UnsupportedModelError(
            f"{type(hf).__name__}: cannot find one self-attention module with a layer index "
            "per layer; KV plans need a Hugging Face decoder (LLaMA, GPT-2, ...)"
        )
    return sorted(mods, key=lambda m: m.layer_idx)


def hf_model(model: Any) -> Any:
    """The plain Hugging Face model behind a bridge, sharing its weights (built once and
    kept on the bridge); a Hugging Face model is returned as is.

    ``TransformerBridge`` wraps the modules of the model it boots from in place, so the
    wrapped model runs the bridge's eager attention; the copy runs transformers' own.
    """
    if not hasattr(model, "original_model"):
        return model
    cached = model.__dict__.get("_headmech_kv_hf")
    if cached is not None:
        return cached
    src = model.original_model
    if getattr(getattr(model, "cfg", None), "attention_dir", "causal") == "bidirectional":
        raise UnsupportedModelError("KV plans need a causal decoder; this model is an encoder")
    state = {
        k.replace("._original_component", "").replace("_original_component.", ""): v
        for k, v in src.state_dict().items()
    }
    ref = next(src.parameters())
    with torch.device(ref.device):
        fresh = type(src)(copy.deepcopy(src.config))
    missing, _ = fresh.load_state_dict(state, strict=False, assign=True)
    if [k for k in missing if not k.endswith("inv_freq")]:
        raise UnsupportedModelError(f"cannot unwrap the bridge's weights: missing {missing[:3]}")
    if getattr(fresh.config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh = fresh.to(dtype=ref.dtype).eval()
    model.__dict__["_headmech_kv_hf"] = fresh
    return fresh


@contextlib.contextmanager
def planned(model: Any, plan: KVPlan | None) -> Iterator[Any]:
    """Inside the block, the plain Hugging Face model of ``model`` (yielded) attends as
    ``plan`` says (every head full if ``plan`` is None; the model's own SDPA otherwise
    unchanged); a :class:`~headmech.kv.cache.PlanCache` passed to it is used as stored.

    Raises:
        InputError: a plan for another model shape.
    """
    hf = hf_model(model)
    if plan is not None:
        plan.check_model(hf)
    _register()
    mods = attention_modules(hf)
    old = hf.config._attn_implementation
    try:
        hf.config._attn_implementation = IMPLEMENTATION
        for m in mods:
            m.__dict__["_headmech_kv"] = None if plan is None else LayerPlan.of(plan, m.layer_idx)
        yield hf
    finally:
        hf.config._attn_implementation = old
        for m in mods:
            m.__dict__.pop("_headmech_kv", None)
