"""A KV cache that stores only what a :class:`~headmech.kv.plan.KVPlan` keeps.

:class:`PlanCache` is a transformers ``Cache`` (a ``DynamicCache`` subclass) whose
layers (:class:`PlanLayer`) keep every position for the plan's full KV heads and only
the sinks and the most recent ``window`` positions for the others, evicting the rest
after each step; a layer with the model's own sliding window (Gemma 2/3, Mistral) keeps
just that window, as transformers' own cache does. ``update`` hands the attention the
full heads' keys and the windowed heads' kept keys with their positions
(:class:`~headmech.kv.attention.Split`); the ``"headmech_kv"`` attention function masks
each windowed query to its sinks and window, so a step with this cache computes what the
masked model computes over the whole cache (tested: same greedy tokens, logits to 1e-4).
:func:`generate` runs transformers' ``generate`` with it and reports the cache's bytes,
measured from the storage of the tensors it holds, and the tokens per second; without a
plan it runs the model's own cache (transformers' ``DynamicCache`` for the model's
config), the baseline.

Prompts in one batch must have the same length (positions are cache slots: left padding
would make padding the sinks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from headmech.core.errors import InputError
from headmech.kv.attention import LayerPlan, Split, planned
from headmech.kv.plan import KVPlan

__all__ = ["Generation", "PlanCache", "PlanLayer", "cache_nbytes", "generate"]


class PlanLayer(CacheLayerMixin):
    """One layer of a :class:`PlanCache`: full KV heads keep every position, windowed
    ones their sinks and last ``window`` positions."""

    is_sliding = False
    is_croppable = False

    def __init__(self, plan: LayerPlan) -> None:
        super().__init__()
        self.plan = plan
        self.seen = 0  # positions processed (the next token's position)
        self.full_keys: Tensor | None = None  # [batch, n_full, seen, d_head]
        self.full_values: Tensor | None = None
        self.win_keys: Tensor | None = None  # [batch, n_win, kept, d_head]
        self.win_values: Tensor | None = None
        self.positions = torch.zeros(0, dtype=torch.long)  # [kept]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Empty tensors of the right batch, head counts, dtype and device."""
        self.dtype, self.device = key_states.dtype, key_states.device
        b = key_states.shape[0]
        nf, nw = self.plan.full_kv.numel(), self.plan.win_kv.numel()
        self.full_keys = key_states.new_zeros(b, nf, 0, key_states.shape[-1])
        self.full_values = value_states.new_zeros(b, nf, 0, value_states.shape[-1])
        self.win_keys = key_states.new_zeros(b, nw, 0, key_states.shape[-1])
        self.win_values = value_states.new_zeros(b, nw, 0, value_states.shape[-1])
        self.positions = torch.zeros(0, dtype=torch.long, device=key_states.device)
        self.is_initialized = True

    def update(  # type: ignore[override]
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Split, Split]:
        """Append this step's keys and values (``[batch, n_kv_heads, new, d_head]``); return
        what this step attends to, then evict what no later query will see."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.full_keys is not None and self.full_values is not None
        assert self.win_keys is not None and self.win_values is not None
        dev = key_states.device
        full, win = self.plan.full_kv.to(dev), self.plan.win_kv.to(dev)
        new = torch.arange(self.seen, self.seen + key_states.shape[2], device=dev)
        self.seen += key_states.shape[2]
        fk = torch.cat([self.full_keys, key_states[:, full]], 2)
        fv = torch.cat([self.full_values, value_states[:, full]], 2)
        wk = torch.cat([self.win_keys, key_states[:, win]], 2)
        wv = torch.cat([self.win_values, value_states[:, win]], 2)
        pos = torch.cat([self.positions, new])
        lp = self.plan
        keys, values = Split(fk, wk, pos, self.seen, lp), Split(fv, wv, pos, self.seen, lp)
        # the next query (position seen) sees the sinks and positions seen - window .. seen - 1
        keep = (pos < self.plan.sinks) | (pos >= self.seen - self.plan.window)
        self.full_keys, self.full_values = fk, fv
        self.win_keys, self.win_values = wk[:, :, keep], wv[:, :, keep]  # copies: evicted
        self.positions = pos[keep]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Mask columns are positions ``0 .. seen + query_length - 1``."""
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Positions processed so far (not the number stored)."""
        return self.seen

    def get_max_length(self) -> int:
        """No maximum."""
        return -1

    def tensors(self) -> list[Tensor]:
        """The tensors this layer holds."""
        held = (self.full_keys, self.full_values, self.win_keys, self.win_values)
        return [t for t in (*held, self.positions) if t is not None]

    def reset(self) -> None:
        """Forget everything."""
        self.__init__(self.plan)  # type: ignore[misc]

    def _select(self, fn: Any) -> None:
        for name in ("full_keys", "full_values", "win_keys", "win_values"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search)."""
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each sequence ``repeats`` times."""
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep the sequences ``indices``."""
        self._select(lambda t: t[indices])


class PlanCache(DynamicCache):
    """A ``DynamicCache`` that stores, per layer, every position for the plan's full KV
    heads and the sinks and last ``window`` positions for the others. Use it inside
    :func:`~headmech.kv.attention.planned` (as :func:`generate` does)."""

    def __init__(self, plan: KVPlan) -> None:
        layers: list[Any] = [PlanLayer(_layer_plan(plan, la)) for la in range(plan.n_layers)]
        Cache.__init__(self, layers=layers)
        self.plan = plan

    def nbytes(self) -> int:
        """Bytes held, measured from the tensors' storages (see :func:`cache_nbytes`)."""
        return cache_nbytes(self)


def _layer_plan(plan: KVPlan, layer: int) -> LayerPlan:
    """Layer ``layer`` of the plan. A layer with the model's own sliding window of ``w``
    where every head sees that window (full, or windowed no narrower) keeps what
    transformers' ``DynamicSlidingWindowLayer`` keeps: the last ``w - 1`` positions, no
    sinks (a query then sees ``w`` keys, itself included). Heads windowed narrower than
    the model (sinks + a short window inside it) keep the plan's layout: correct, but the
    full heads then hold every position."""
    w = plan.windows[layer] if plan.windows else 0
    if not w or not (bool(plan.full[layer].all()) or plan.window >= w - 1):
        return LayerPlan.of(plan, layer)
    none = torch.zeros(0, dtype=torch.long)
    kv, q = torch.arange(plan.n_kv_heads), torch.arange(plan.n_heads)
    return LayerPlan(none, kv, none, q, 0, w - 1)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of the distinct tensor storages a cache's layers hold (measured, not from a
    formula: a view into a larger tensor counts the whole storage)."""
    storages: dict[int, int] = {}
    for layer in cache.layers:
        held = layer.tensors() if isinstance(layer, PlanLayer) else [layer.keys, layer.values]
        for t in held:
            if isinstance(t, Tensor) and t.numel():
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


@dataclass
class Generation:
    """Greedy generation with a cache.

    Attributes:
        tokens: ``[batch, new]`` generated token ids.
        logits: ``[batch, new, d_vocab]`` (fp32) the logits each token was chosen from.
        nbytes: the cache's bytes after the last step (:func:`cache_nbytes`).
        prefill_s: seconds until the first token.
        decode_s: seconds for the other tokens.
        meta: plan summary (KV heads full, sinks, window, prompt length).
    """

    tokens: Int[Tensor, "batch new"]
    logits: Float[Tensor, "batch new d_vocab"]
    nbytes: int
    prefill_s: float
    decode_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed after the first token, per sequence."""
        n = self.tokens.shape[1] - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


class _Clock:
    """A stopping criterion that never stops: the time of each step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(
    model: Any,
    plan: KVPlan | None,
    input_ids: Int[Tensor, "batch pos"],
    max_new_tokens: int = 16,
) -> Generation:
    """Greedy ``generate`` of the plain Hugging Face model with a :class:`PlanCache`
    (``plan`` None: transformers' ``DynamicCache``, every head full: the uncompressed
    model through the same attention function).

    Raises:
        InputError: ``max_new_tokens`` below 1 or a plan for another model.
    """
    from transformers import StoppingCriteriaList

    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    with planned(model, plan) as hf, torch.inference_mode():
        ids = input_ids.to(next(hf.parameters()).device)
        # the model's own cache (sliding-window layers keep their window) is the baseline
        cache = PlanCache(plan) if plan is not None else DynamicCache(config=hf.config)
        clock = _Clock()
        t0 = time.perf_counter()
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
            stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0,
        )  # fmt: skip
    times = [t0, *clock.times]
    meta = {"prompt_tokens": int(ids.shape[1]), "new_tokens": max_new_tokens}
    if plan is not None:
        meta.update(n_full=plan.n_full, sinks=plan.sinks, window=plan.window)
    return Generation(
        out.sequences[:, ids.shape[1] :].cpu(),
        torch.stack(out.logits, 1).float().cpu(),
        cache_nbytes(cache),
        times[1] - times[0],
        times[-1] - times[1],
        meta,
    )
