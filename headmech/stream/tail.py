"""Blocks run at the last position alone, on the clean run's keys and values.

An intervention at the last position changes nothing at the positions before it (attention
is causal), so the blocks above it need to run only there: :class:`KeyValues` records
every layer's keys and values during the clean pass (through transformers' cache interface,
inside the Hugging Face attention under :func:`headmech.stream.forward.fast_attention`) and
serves them, stacked, to a replay of one row per sequence (:func:`replay_last`), which
:func:`headmech.stream.forward.run_blocks` uses where :func:`last_row_replay` says it can.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge


__all__ = ["KV", "KeyValues", "last_row_replay", "replay_last", "stack"]


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
        before_k = stack(old_k[:, :, :-1], old_k.shape[0], self.copies)
        before_v = stack(old_v[:, :, :-1], old_v.shape[0], self.copies)
        return torch.cat([before_k, key], 2), torch.cat([before_v, value], 2)


# the cache the Hugging Face attention is handed under fast_attention (None: the model's)
KV: contextvars.ContextVar[KeyValues | None] = contextvars.ContextVar("headmech_kv", default=None)


def stack(value: Any, batch: int, copies: int) -> Any:
    """A recorded argument for a batch stacked ``copies`` times (per-sequence tensors are
    repeated; tensors shared across the batch, such as rotary tables, broadcast)."""
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch and copies > 1:
        return value.repeat(copies, *([1] * (value.dim() - 1)))
    if isinstance(value, tuple):
        return tuple(stack(v, batch, copies) for v in value)
    return value


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


def last_row_replay(record: Any, layer: int, n_blocks: int) -> bool:
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


def replay_last(
    model: TransformerBridge, record: Any, layer: int, n_blocks: int, n_seqs: int
) -> Tensor:
    """:func:`_replay` at the last position alone (the keys and values of the positions
    before it are the clean run's); the other positions of the output are zeros."""
    batch, kv = record.batch_size, record.kv
    assert kv is not None
    copies = n_seqs // batch
    resid = record.resid[layer]
    n_pos = int(resid.shape[1])
    hidden = stack(resid[:, -1:], batch, copies)
    kv.copies = copies
    token = KV.set(kv)
    try:
        for la in range(layer, n_blocks):
            args = stack(_last_rows(record.args[la], n_pos), batch, copies)
            kwargs = {
                k: stack(_last_rows(v, n_pos, k), batch, copies)
                for k, v in record.kwargs[la].items()
            }
            out = model.blocks[la](hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
    finally:
        KV.reset(token)
        kv.copies = 0
    full = hidden.new_zeros(n_seqs, n_pos, hidden.shape[-1])  # [batch, pos, d_model]
    full[:, -1:] = hidden
    return full
