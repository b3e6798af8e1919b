"""Head masks and physical head removal.

A :class:`HeadMask` is a ``[n_layers, n_heads]`` float tensor that multiplies each head's
output ``hook_z`` (Michel et al. 2019's ξ): soft values gate, hard 0/1 values prune. A
mask of ones is the identity (``z * 1.0`` is exact); a zero is zero-ablation of the head.

:func:`prune_heads` builds a genuinely smaller Hugging Face model by slicing the attention
projections (transformers v5 dropped ``PreTrainedModel.prune_heads``). Hugging Face
configs hold one global head count, so every layer must keep the same number of heads:

* **LLaMA** (grouped-query attention): a KV head can only go when every query head of
  its group goes, and the group size must stay uniform, so each layer physically drops
  ``g`` whole KV groups (``g`` = the fewest fully removed groups of any layer). Every
  other requested head stays in the weights with its ``o_proj`` input columns zeroed,
  which is exactly its zero-ablation. The config gets the new ``num_attention_heads``,
  ``num_key_value_heads`` and an explicit ``head_dim``, so the model saves and reloads.
* **GPT-2**: each layer drops ``k`` requested heads (``k`` = the fewest requested in any
  layer) from ``c_attn``'s q/k/v columns and ``c_proj``'s rows; the rest are zeroed in
  ``c_proj``. GPT-2 derives ``head_dim = n_embd / n_head``, which a smaller head count
  would change, so the attention modules' ``num_heads``/``split_size`` are set in memory
  and the result runs but cannot be round-tripped through ``save_pretrained``.

References:
    Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than One?", NeurIPS.
    Voita et al. 2019, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the
    Heavy Lifting, the Rest Can Be Pruned", ACL.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from headmech.core.errors import ArgumentError, HeadIndexError, HeadmechError
from headmech.core.head_index import HeadIndex, check_heads
from headmech.interventions import Intervention, Scale, applied, hooks
from headmech.models.loaded import loaded

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "HeadMask",
    "UnsupportedPruningError",
    "check_mask",
    "head_mask",
    "head_mask_hooks",
    "mask_intervention",
    "prune_heads",
]

Hook = tuple[str, Callable[..., Tensor]]


class UnsupportedPruningError(HeadmechError):
    """Physical head removal is not implemented for this architecture."""


class HeadMask:
    """A ``[n_layers, n_heads]`` multiplier on every head's output (``hook_z``).

    Args:
        values: the mask; 1 keeps a head, 0 removes it, values between gate it.

    Examples:
        >>> m = HeadMask.ones(2, 4).remove([(0, 1)])
        >>> m.n_kept, m.removed()
        (7, [(0, 1)])
    """

    def __init__(self, values: Float[Tensor, "n_layers n_heads"]) -> None:
        if not isinstance(values, Tensor) or values.ndim != 2:
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ArgumentError(f"a head mask is a [n_layers, n_heads] tensor, got {got}")
        self.values = values.detach().float().clone()

    @classmethod
    def ones(cls, n_layers: int, n_heads: int) -> HeadMask:
        return cls(torch.ones(n_layers, n_heads))

    @classmethod
    def for_model(cls, model: TransformerBridge) -> HeadMask:
        """All ones, shaped like ``model``'s heads."""
        return cls.ones(int(model.cfg.n_layers), int(model.cfg.n_heads))

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.values.shape[0]), int(self.values.shape[1])

    @property
    def n_kept(self) -> int:
        """Heads whose mask is not zero."""
        return int((self.values != 0).sum())

    def kept(self) -> list[tuple[int, int]]:
        """``(layer, head)`` of every head whose mask is not zero."""
        return [(int(a), int(b)) for a, b in (self.values != 0).nonzero().tolist()]

    def removed(self) -> list[tuple[int, int]]:
        """``(layer, head)`` of every head whose mask is zero."""
        return [(int(a), int(b)) for a, b in (self.values == 0).nonzero().tolist()]

    def remove(self, heads: Iterable[HeadIndex | Sequence[int] | str] | str) -> HeadMask:
        """A copy with ``heads`` (pairs or ``"L18H6"``) set to 0 (a head outside the mask:
        :class:`HeadIndexError`)."""
        v = self.values.clone()
        for layer, head in check_heads(heads, *self.shape, what="HeadMask.remove"):
            v[layer, head] = 0.0
        return HeadMask(v)

    def hooks(self) -> list[Hook]:
        """``fwd_hooks`` applying the mask (:func:`head_mask_hooks`)."""
        return head_mask_hooks(self.values)

    def intervention(self) -> Intervention | None:
        """The mask as an intervention (None for a mask of ones)."""
        return mask_intervention(self)

    def __repr__(self) -> str:
        n_layers, n_heads = self.shape
        return f"HeadMask({n_layers}x{n_heads}, kept={self.n_kept})"


def mask_intervention(mask: HeadMask | Float[Tensor, "n_layers n_heads"]) -> Intervention | None:
    """The :class:`~headmech.interventions.Scale` intervention a mask stands for: every head
    of every layer whose mask is not all ones (all layers when the mask requires grad);
    None when there is nothing to do (a mask of ones is exactly the identity)."""
    values = mask.values if isinstance(mask, HeadMask) else mask
    n_layers, n_heads = values.shape
    layers = [
        la for la in range(n_layers) if values.requires_grad or not bool((values[la] == 1).all())
    ]
    if not layers:
        return None
    heads = [(la, h) for la in layers for h in range(n_heads)]
    return Intervention.on(heads, Scale(values))


def head_mask_hooks(mask: HeadMask | Float[Tensor, "n_layers n_heads"]) -> list[Hook]:
    """``fwd_hooks`` multiplying each head's ``hook_z`` by ``mask[layer, head]``.

    Layers whose mask is all ones get no hook (so a mask of ones is exactly the identity).
    The hooks return a new tensor and keep gradients to ``mask`` when it requires them.
    """
    iv = mask_intervention(mask)
    return [] if iv is None else hooks(None, [iv])


@contextmanager
def head_mask(
    model: TransformerBridge, mask: HeadMask | Float[Tensor, "n_layers n_heads"]
) -> Iterator[TransformerBridge]:
    """Run ``model`` with ``mask`` applied: ``with head_mask(model, m): model(tokens)``."""
    check_mask(model, mask)
    iv = mask_intervention(mask)
    with applied(model, [] if iv is None else [iv]):
        yield model


def check_mask(model: Any, mask: HeadMask | Float[Tensor, "n_layers n_heads"]) -> None:
    """Refuse a mask of another shape than ``model``'s heads (:class:`HeadIndexError`: a
    bigger mask names heads outside the model, a smaller one leaves heads unmasked)."""
    values = mask.values if isinstance(mask, HeadMask) else mask
    expected = (int(model.cfg.n_layers), int(model.cfg.n_heads))
    if not isinstance(values, Tensor) or tuple(values.shape) != expected:
        got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise HeadIndexError(
            f"mask shape {got} does not match the model's heads {expected} (n_layers, n_heads)"
        )


# --- physical removal --------------------------------------------------------------


def _hf_model(model: Any) -> Any:
    hf = getattr(model, "original_model", model)
    if not isinstance(hf, nn.Module) or not hasattr(hf, "config"):
        raise UnsupportedPruningError(
            "prune_heads needs a Hugging Face model or a TransformerBridge"
        )
    return hf


def _clean_copy(hf: Any) -> Any:
    """A plain Hugging Face copy of ``hf``.

    ``TransformerBridge`` wraps the modules of the model it boots from in place (names gain
    ``._original_component``), so a deep copy would carry the wrappers; instead build a
    fresh model of the same class and load the unwrapped weights.
    """
    state = {
        k.replace("._original_component", "").replace("_original_component.", ""): v
        for k, v in hf.state_dict().items()
    }
    if not any("_original_component" in k for k in hf.state_dict()):
        return copy.deepcopy(hf)
    fresh = type(hf)(copy.deepcopy(hf.config))
    fresh_keys = set(fresh.state_dict())
    missing, _ = fresh.load_state_dict(
        {k: v for k, v in state.items() if k in fresh_keys}, strict=False
    )
    if [k for k in missing if not k.endswith("inv_freq")]:
        raise UnsupportedPruningError(f"cannot unwrap the bridge's weights: missing {missing[:3]}")
    ref = next(hf.parameters())
    return fresh.to(device=ref.device, dtype=ref.dtype).eval()


def _by_layer(heads: Iterable[HeadIndex | Sequence[int]], n_layers: int) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in range(n_layers)]
    for layer, head in heads:
        out[int(layer)].add(int(head))
    return out


def _keep_rows(linear: nn.Linear, idx: Tensor) -> nn.Linear:
    """A Linear keeping output features ``idx``."""
    new = nn.Linear(linear.in_features, len(idx), bias=linear.bias is not None)
    new = new.to(linear.weight)
    with torch.no_grad():
        new.weight.copy_(linear.weight[idx])
        if linear.bias is not None:
            new.bias.copy_(linear.bias[idx])
    return new


def _keep_cols(linear: nn.Linear, idx: Tensor) -> nn.Linear:
    """A Linear keeping input features ``idx``."""
    new = nn.Linear(len(idx), linear.out_features, bias=linear.bias is not None)
    new = new.to(linear.weight)
    with torch.no_grad():
        new.weight.copy_(linear.weight[:, idx])
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


def _dims(heads: Iterable[int], d_head: int) -> Tensor:
    return torch.tensor(
        [h * d_head + i for h in sorted(heads) for i in range(d_head)], dtype=torch.long
    )


def _prune_llama(hf: Any, remove: list[set[int]]) -> nn.Module:
    cfg = hf.config
    n_q, n_kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    group = n_q // n_kv
    d_head = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q)
    layers = hf.model.layers
    full = [
        [g for g in range(n_kv) if all(g * group + j in rm for j in range(group))] for rm in remove
    ]
    n_drop = min(len(f) for f in full)
    if n_drop >= n_kv:
        n_drop = n_kv - 1  # keep one group per layer: a layer with no heads has no config
    for layer, (rm, groups) in enumerate(zip(remove, full, strict=True)):
        attn = layers[layer].self_attn
        dropped = set(groups[:n_drop])
        kept_kv = [g for g in range(n_kv) if g not in dropped]
        kept_q = [g * group + j for g in kept_kv for j in range(group)]
        # zero-ablate the requested heads that stay in the weights
        zero = [i for i, h in enumerate(kept_q) if h in rm]
        attn.q_proj = _keep_rows(attn.q_proj, _dims(kept_q, d_head))
        attn.k_proj = _keep_rows(attn.k_proj, _dims(kept_kv, d_head))
        attn.v_proj = _keep_rows(attn.v_proj, _dims(kept_kv, d_head))
        o = _keep_cols(attn.o_proj, _dims(kept_q, d_head))
        if zero:
            with torch.no_grad():
                o.weight[:, _dims(zero, d_head)] = 0.0
        attn.o_proj = o
        attn.head_dim = d_head
        attn.num_key_value_groups = group
    cfg.num_attention_heads = n_q - n_drop * group
    cfg.num_key_value_heads = n_kv - n_drop
    cfg.head_dim = d_head
    return hf


def _prune_gpt2(hf: Any, remove: list[set[int]]) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    cfg = hf.config
    n_heads, d_model = int(cfg.n_head), int(cfg.n_embd)
    d_head = d_model // n_heads
    n_drop = min(min(len(rm) for rm in remove), n_heads - 1)
    for layer, rm in enumerate(remove):
        attn = hf.transformer.h[layer].attn
        dropped = set(sorted(rm)[:n_drop])
        kept = [h for h in range(n_heads) if h not in dropped]
        dims = _dims(kept, d_head)
        qkv = torch.cat([dims, dims + d_model, dims + 2 * d_model])
        c_attn = Conv1D(len(qkv), d_model).to(attn.c_attn.weight)
        c_proj = Conv1D(d_model, len(dims)).to(attn.c_proj.weight)
        with torch.no_grad():
            c_attn.weight.copy_(attn.c_attn.weight[:, qkv])
            c_attn.bias.copy_(attn.c_attn.bias[qkv])
            c_proj.weight.copy_(attn.c_proj.weight[dims])
            c_proj.bias.copy_(attn.c_proj.bias)
            zero = [i for i, h in enumerate(kept) if h in rm]
            if zero:
                c_proj.weight[_dims(zero, d_head)] = 0.0
        attn.c_attn, attn.c_proj = c_attn, c_proj
        attn.num_heads = len(kept)
        attn.split_size = len(kept) * d_head
        attn.head_dim = d_head
    loaded(hf).pruned_n_head = n_heads - n_drop  # config.n_head cannot say it (module doc)
    return hf


def prune_heads(model: Any, heads_to_remove: Iterable[HeadIndex | Sequence[int]]) -> nn.Module:
    """A smaller copy of ``model``'s Hugging Face model without ``heads_to_remove``.

    Args:
        model: a Hugging Face ``LlamaForCausalLM``/``GPT2LMHeadModel`` (or a bridge wrapping
            one); it is not modified.
        heads_to_remove: ``(layer, head)`` pairs (query heads under grouped-query attention).

    Returns:
        A new model whose outputs equal the original's with those heads zero-ablated (the
        masked model's). Heads beyond a uniform per-layer count are zeroed, not removed
        (see the module docstring).

    Raises:
        UnsupportedPruningError: another architecture.
        HeadIndexError: a head outside the model.
    """
    hf = _hf_model(model)
    model_type = str(getattr(hf.config, "model_type", ""))
    if model_type not in ("llama", "gpt2"):
        raise UnsupportedPruningError(
            f"physical head removal supports llama and gpt2, not '{model_type}'; use a HeadMask"
        )
    cfg = hf.config
    n_layers = int(cfg.num_hidden_layers)
    heads = check_heads(heads_to_remove, n_layers, int(cfg.num_attention_heads), "prune_heads")
    new = _clean_copy(hf)
    remove = _by_layer(heads, n_layers)
    if model_type == "llama":
        return _prune_llama(new, remove)
    return _prune_gpt2(new, remove)
