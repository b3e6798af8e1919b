"""Running the model's blocks: stop after the last one, or start from a cached residual.

:func:`run_blocks` runs the first ``n`` blocks and stops (no final norm, no unembedding:
statistics and most task metrics need only the residual stream). Exact single-head
interventions do not need the whole model either: a head in layer ``l`` changes nothing
below ``l``. :func:`block_inputs` records, during one clean pass, what each block received
(its residual input and the other arguments the Hugging Face model passed: attention mask,
rotary embeddings, ...), and inside :func:`starting_at` every :func:`run_blocks` call
replays only blocks ``l..`` from that record, for a batch stacked any number of times
(the copies that carry intervention variants). The blocks run through the bridge as
usual, so every hook on them fires.

An intervention at the last position alone changes nothing at the positions before it
(attention is causal), so the blocks above it need to run only at that position: the
record then also keeps every layer's keys and values from the clean pass (``kv``, read
from inside the Hugging Face attention under :func:`fast_attention`), and a replay with
``last_row`` runs one row per sequence that attends to the clean keys and values of the
positions before it and its own. Function-vector indirect effects (an edit of the last
token's head output, the answer read there) cost one token per sequence instead of the
whole prompt.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.placement import model_device
from headmech.stream.tail import KV, KeyValues, last_row_replay, replay_last, stack

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "BlockInputs",
    "KeyValues",
    "block_inputs",
    "fast_attention",
    "hf_attention_forward",
    "last_row_replay",
    "pattern_hooked",
    "run_blocks",
    "starting_at",
]


@dataclass
class BlockInputs:
    """What each block received in one clean pass over a batch.

    Attributes:
        resid: layer → the residual stream entering that block, ``[batch, pos, d_model]``
            (kept only for the layers asked for).
        args: layer → the block's other positional arguments.
        kwargs: layer → its keyword arguments (a KV cache is dropped: replays build none).
        batch_size: sequences in the recorded batch.
        kv: the keys and values each attention layer computed (rotary applied, before
            grouped-query heads are repeated), when asked for and attention ran fused.
    """

    resid: dict[int, Tensor]
    args: dict[int, tuple[Any, ...]]
    kwargs: dict[int, dict[str, Any]]
    batch_size: int = 0
    kv: KeyValues | None = None


def _no_cache(value: Any) -> Any:
    """A KV cache the model passed (positionally for GPT-2) becomes None: a replay must
    not extend the clean run's cache."""
    from transformers.cache_utils import Cache

    return None if isinstance(value, Cache) else value


@contextlib.contextmanager
def block_inputs(
    model: TransformerBridge, keep_resid: Sequence[int], first: int | None = None, kv: bool = False
) -> Iterator[BlockInputs]:
    """Record, during the forward passes run inside the block, what blocks ``first..``
    receive (default: from the smallest of ``keep_resid``), keeping the residual input of
    the blocks in ``keep_resid`` (and with ``kv``, each layer's keys and values, where
    attention runs fused: :class:`KeyValues`)."""
    keep = set(keep_resid)
    start = min(keep, default=0) if first is None else first
    record = BlockInputs({}, {}, {}, kv=KeyValues() if kv else None)
    handles = []
    token = KV.set(record.kv) if kv else None

    def make(layer: int) -> Any:
        def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if layer in keep:
                record.resid[layer] = args[0].detach()
            record.batch_size = int(args[0].shape[0])
            record.args[layer] = tuple(_no_cache(a) for a in args[1:])
            record.kwargs[layer] = {
                k: _no_cache(v) for k, v in kwargs.items() if k not in ("use_cache",)
            }

        return pre

    try:
        for layer in range(start, int(model.cfg.n_layers) if keep else start):
            handles.append(
                model.blocks[layer].register_forward_pre_hook(make(layer), with_kwargs=True)
            )
        yield record
    finally:
        for h in handles:
            h.remove()
        if token is not None:
            KV.reset(token)


_START: contextvars.ContextVar[tuple[BlockInputs, int, bool] | None] = contextvars.ContextVar(
    "headmech_start", default=None
)


@contextlib.contextmanager
def starting_at(record: BlockInputs, layer: int, last_row: bool = False) -> Iterator[None]:
    """Inside the block, :func:`run_blocks` starts at ``layer`` from ``record``'s residual
    (the blocks below are not run); ``layer`` 0 runs the whole model as usual.

    ``last_row``: the caller's edits act at the last position alone, so a
    :func:`run_blocks` call that reads only the last position runs the blocks at that
    position alone (where the record has what that needs: :func:`last_row_replay`)."""
    if layer > 0 and layer not in record.resid:
        raise KeyError(f"no residual recorded for layer {layer}")
    token = _START.set((record, layer, last_row) if layer > 0 else None)
    try:
        yield
    finally:
        _START.reset(token)


# hook points that only the bridge's own (eager) attention fires
_PATTERN_HOOKS = ("hook_attn_scores", "hook_pattern", "hook_rot_q", "hook_rot_k")


def fast_attention_possible(model: TransformerBridge) -> bool:
    """Whether :func:`fast_attention` applies: the bridge delegates rotary attention to a
    Hugging Face module that supports SDPA, and no hook reads the pattern."""
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    for block in model.blocks:
        attn = block.attn
        if not isinstance(attn, PositionEmbeddingsAttentionBridge):
            return False
        hf = attn.original_component
        if getattr(getattr(hf, "config", None), "_attn_implementation", None) is None:
            return False
        if any(getattr(hf, name, None) is not None for name in ("sinks", "attn_logit_softcapping")):
            return False  # HF's SDPA path does not take these: keep eager
    return not pattern_hooked(model)


def pattern_hooked(model: TransformerBridge) -> bool:
    """Whether a hook reads or writes what only eager attention computes (the pattern, the
    scores, the rotated q and k): an intervention or a caller's cache there."""
    for block in model.blocks:
        for name in _PATTERN_HOOKS:
            hp = getattr(block.attn, name, None)
            if hp is not None and (hp._forward_hooks or hp._forward_pre_hooks):
                return True
    return False


def hf_attention_forward(attn: Any, implementation: str = "sdpa") -> Any:
    """A forward for the attention bridge ``attn`` that runs its Hugging Face module with
    the attention function ``implementation`` (transformers' ``AttentionInterface``)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        hf = attn.original_component
        kv = KV.get()
        if kv is not None:  # recording the clean keys and values, or reading them
            kwargs.pop("past_key_values", None)
            kwargs["cache"] = kv
        old = hf.config._attn_implementation
        hf.config._attn_implementation = implementation
        try:
            return hf(*args, **kwargs)
        finally:
            hf.config._attn_implementation = old

    return forward


@contextlib.contextmanager
def masks_for(model: TransformerBridge, implementation: str) -> Iterator[None]:
    """Inside the block, the Hugging Face model builds its attention masks in the format of
    ``implementation`` (transformers' mask interface), not eager's: SDPA's masks are None
    for plain causal attention without padding, where eager's are a ``T x T`` float tensor
    (256 MB at 8,192 tokens, 4 GB at 32,768) and the fused kernel reads every block of it
    instead of skipping the blocks above the diagonal."""
    configs = {id(c): c for b in model.blocks if (c := _hf_config(b.attn)) is not None}
    old = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = implementation
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = old[k]


def _hf_config(attn: Any) -> Any:
    hf = getattr(attn, "original_component", None)
    return getattr(hf, "config", None)


@contextlib.contextmanager
def fast_attention(model: TransformerBridge, enable: bool = True) -> Iterator[bool]:
    """Inside the block, attention runs as fused SDPA in the Hugging Face module (when
    :func:`fast_attention_possible`; yields whether it is on). Forward values equal the
    eager bridge's to float rounding; pattern hooks do not fire. The masks stay eager's
    (not :func:`masks_for`): a pass recorded here is replayed under eager attention when
    an intervention hooks the pattern, and eager attention needs the mask."""
    on = enable and fast_attention_possible(model)
    attns = [block.attn for block in model.blocks] if on else []
    try:
        for attn in attns:  # the bridge forwards setattr to the wrapped module: go direct
            attn.__dict__["forward"] = hf_attention_forward(attn)
        yield on
    finally:
        for attn in attns:
            attn.__dict__.pop("forward", None)


def _replay(
    model: TransformerBridge, record: BlockInputs, layer: int, n_blocks: int, n_seqs: int
) -> Tensor:
    batch = record.batch_size
    if n_seqs % batch:
        raise ValueError(f"{n_seqs} sequences are not copies of the recorded batch of {batch}")
    copies = n_seqs // batch
    hidden = stack(record.resid[layer], batch, copies)
    for la in range(layer, n_blocks):
        args = stack(record.args[la], batch, copies)
        kwargs = {k: stack(v, batch, copies) for k, v in record.kwargs[la].items()}
        out = model.blocks[la](hidden, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _hooked(module: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


@contextlib.contextmanager
def _mlp_rows(model: TransformerBridge, layer: int, rows: Tensor | None) -> Iterator[None]:
    """Inside the block, block ``layer``'s MLP runs only at ``rows`` (``Bool[batch, pos]``)
    and adds nothing elsewhere: the MLP acts on each position alone, so the rows run are
    exact and the others are left out (unless a hook watches the MLP)."""
    mlp = model.blocks[layer].mlp
    if rows is None or bool(rows.all()) or _hooked(mlp):
        yield
        return
    run = type(mlp).forward

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        if x.shape[:2] != rows.shape:  # not the pass the rows were given for
            return run(mlp, x, *args, **kwargs)
        out = x.new_zeros(x.shape)  # [batch, pos, d_model]
        got = run(mlp, x[rows][None], *args, **kwargs)  # [1, rows, d_model] in
        if isinstance(got, tuple):  # a mixture of experts: (output, router scores)
            out[rows] = got[0][0]
            return (out, *got[1:])
        out[rows] = got[0]
        return out

    mlp.__dict__["forward"] = forward
    try:
        yield
    finally:
        mlp.__dict__.pop("forward", None)


def run_blocks(
    model: TransformerBridge,
    input_ids: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    n_blocks: int | None = None,
    rows: Bool[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch pos d_model"]:
    """Run the first ``n_blocks`` blocks (default all) and stop: no final norm, no unembedding.

    ``rows``: the positions whose output the caller reads. The last block's MLP then runs
    only there (it acts on each position alone); the output at the other positions is not
    the model's and must not be read. A causal metric that reads a few positions saves the
    last MLP's work at the rest.

    Not ``TransformerBridge``'s ``stop_at_layer=k``: it stops *before* block ``k``, so with
    ``k = n_layers`` nothing stops and the whole model runs, ``[batch, pos, d_vocab]``
    logits included; and it finds block ``k`` by a name pattern that BERT's
    ``encoder.layer.{k}`` does not match. The stop here is a forward hook on
    ``blocks.{n_blocks - 1}.hook_out`` (it runs after the caller's hooks there) raising
    TransformerLens' own ``StopAtLayerException``, which the bridge returns as its output.
    Inside :func:`starting_at`, only the blocks from the start layer run, from the record.

    Returns:
        The residual stream after block ``n_blocks - 1``.
    """
    from transformer_lens.model_bridge.exceptions import StopAtLayerException

    n = int(model.cfg.n_layers) if n_blocks is None else int(n_blocks)
    start = _START.get()
    with _mlp_rows(model, n - 1, rows):
        if start is not None and start[1] < n:
            record, layer, last_row = start
            if (
                last_row
                and rows is not None
                and not bool(rows[:, :-1].any())
                and last_row_replay(record, layer, n)
            ):
                return replay_last(model, record, layer, n, int(input_ids.shape[0]))
            return _replay(model, record, layer, n, int(input_ids.shape[0]))

        def stop(module: Any, args: Any, output: Tensor) -> None:
            raise StopAtLayerException(output)

        handle = model.blocks[n - 1].hook_out.register_forward_hook(stop)
        try:
            return model(input_ids, attention_mask=attention_mask, return_type=None)
        finally:
            handle.remove()


def bare_forward(model: TransformerBridge, batches: Any) -> None:
    """The same batches and blocks as :func:`headmech.stream.engine.stream_statistics`, with no
    hooks: the baseline the engine is timed against (the difference is the hooks' cost).
    Under :func:`fast_attention`, the masks are SDPA's (:func:`masks_for`), as a Hugging
    Face model loaded for SDPA builds them."""
    device = model_device(model)
    n_layers = int(model.cfg.n_layers)
    sdpa = fast_attention_possible(model) and any(
        "forward" in b.attn.__dict__ for b in model.blocks
    )
    with torch.inference_mode(), masks_for(model, "sdpa") if sdpa else contextlib.nullcontext():
        for batch in batches:
            batch = batch.to(device)
            run_blocks(model, batch.input_ids, batch.attention_mask, n_layers)
