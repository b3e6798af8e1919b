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


class KeyValues:
    """Transformers' cache interface (``update``) for one clean pass and its replays.

    Recording, ``update`` keeps each layer's keys and values ``[batch, kv_heads, pos,
    d_head]`` and returns them unchanged. Replaying the last row of a batch stacked
    ``copies`` times, it returns the recorded keys and values of the positions before the
    last, stacked, with the replayed row's own appended: what the attention of the last
    position reads in the full pass, the positions before it being the clean run's.
    """

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.copies = 0  # 0: recording

    def update(
        self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """The keys and values layer ``layer_idx``'s attention reads (see the class)."""
        if not self.copies:
            self.keys[layer_idx], self.values[layer_idx] = key.detach(), value.detach()
            return key, value
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        before_k = _stack(old_k[:, :, :-1], old_k.shape[0], self.copies)
        before_v = _stack(old_v[:, :, :-1], old_v.shape[0], self.copies)
        return torch.cat([before_k, key], 2), torch.cat([before_v, value], 2)


# the cache the Hugging Face attention is handed under fast_attention (None: the model's)
_KV: contextvars.ContextVar[KeyValues | None] = contextvars.ContextVar("headmech_kv", default=None)


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
    token = _KV.set(record.kv) if kv else None

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
            _KV.reset(token)


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
        kv = _KV.get()
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


def _stack(value: Any, batch: int, copies: int) -> Any:
    """A recorded argument for a batch stacked ``copies`` times (per-sequence tensors are
    repeated; tensors shared across the batch, such as rotary tables, broadcast)."""
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch and copies > 1:
        return value.repeat(copies, *([1] * (value.dim() - 1)))
    if isinstance(value, tuple):
        return tuple(_stack(v, batch, copies) for v in value)
    return value


def _replay(
    model: TransformerBridge, record: BlockInputs, layer: int, n_blocks: int, n_seqs: int
) -> Tensor:
    batch = record.batch_size
    if n_seqs % batch:
        raise ValueError(f"{n_seqs} sequences are not copies of the recorded batch of {batch}")
    copies = n_seqs // batch
    hidden = _stack(record.resid[layer], batch, copies)
    for la in range(layer, n_blocks):
        args = _stack(record.args[la], batch, copies)
        kwargs = {k: _stack(v, batch, copies) for k, v in record.kwargs[la].items()}
        out = model.blocks[la](hidden, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _last_rows(value: Any, n_pos: int, key: str = "") -> Any:
    """A recorded block argument cut to the last query position; ``ValueError`` where it
    has a position axis whose meaning is not known here."""
    if isinstance(value, tuple):
        return tuple(_last_rows(v, n_pos, key) for v in value)
    if not isinstance(value, Tensor) or n_pos not in value.shape:
        return value
    if key == "attention_mask" and value.dim() == 4:  # [batch, 1, query, key]: one query
        return value[..., -1:, :]
    if key in ("position_embeddings", "position_ids") and value.shape[1] == n_pos:
        return value[:, -1:]  # rotary tables [batch, pos, d] and ids [batch, pos]
    if key == "cache_position" and value.dim() == 1:
        return value[-1:]
    raise ValueError(f"no last-row form known for the block argument '{key}'")


def last_row_replay(record: BlockInputs, layer: int, n_blocks: int) -> bool:
    """Whether blocks ``layer..n_blocks - 1`` can run at the last position alone from
    ``record``: its keys and values cover them and every other argument has a known
    last-row form."""
    if record.kv is None or layer not in record.resid:
        return False
    n_pos = int(record.resid[layer].shape[1])
    if n_pos < 2 or any(la not in record.kv.keys for la in range(layer, n_blocks)):
        return False
    try:
        for la in range(layer, n_blocks):
            _last_rows(record.args[la], n_pos)
            for k, v in record.kwargs[la].items():
                _last_rows(v, n_pos, k)
    except ValueError:
        return False
    return True


def _replay_last(
    model: TransformerBridge, record: BlockInputs, layer: int, n_blocks: int, n_seqs: int
) -> Tensor:
    """:func:`_replay` at the last position alone (the keys and values of the positions
    before it are the clean run's); the other positions of the output are zeros."""
    batch, kv = record.batch_size, record.kv
    assert kv is not None
    copies = n_seqs // batch
    resid = record.resid[layer]
    n_pos = int(resid.shape[1])
    hidden = _stack(resid[:, -1:], batch, copies)
    kv.copies = copies
    token = _KV.set(kv)
    try:
        for la in range(layer, n_blocks):
            args = _stack(_last_rows(record.args[la], n_pos), batch, copies)
            kwargs = {
                k: _stack(_last_rows(v, n_pos, k), batch, copies)
                for k, v in record.kwargs[la].items()
            }
            out = model.blocks[la](hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
    finally:
        _KV.reset(token)
        kv.copies = 0
    full = hidden.new_zeros(n_seqs, n_pos, hidden.shape[-1])  # [batch, pos, d_model]
    full[:, -1:] = hidden
    return full


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
                return _replay_last(model, record, layer, n, int(input_ids.shape[0]))
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
    device = next(model.parameters()).device
    n_layers = int(model.cfg.n_layers)
    sdpa = fast_attention_possible(model) and any(
        "forward" in b.attn.__dict__ for b in model.blocks
    )
    with torch.inference_mode(), masks_for(model, "sdpa") if sdpa else contextlib.nullcontext():
        for batch in batches:
            batch = batch.to(device)
            run_blocks(model, batch.input_ids, batch.attention_mask, n_layers)
