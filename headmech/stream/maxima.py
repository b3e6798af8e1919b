"""Each query row's largest attention score, so that row statistics need only points.

A row's argmax statistics (a target key is the argmax; the offset of the argmax; the
largest weight on an ordinary key, Voita's confidence) need the row's maximum, and without
it every score of the row (:mod:`headmech.stream.rows`: a block of ``q · kᵀ`` per layer,
the cost between the row path and the bare forward). With the maximum ``m_i`` over a set
of keys and the kernel's log-sum-exp, the largest weight is ``exp(m_i − LSE_i)`` and a key
is the argmax where its score equals ``m_i``: O(d_head) per query and key of interest
(:class:`headmech.stream.points.Points`).

:class:`RowMaxima` gives a layer's maxima over any key set, each set computed once per
layer. Where they come from, under :func:`row_maxima`:

* ``"kernel"``: on CUDA, FlexAttention computes the layer's output, log-sum-exp and row
  maxima in one call (``return_aux=AuxRequest(lse=True, max_scores=True)``), and the
  maxima over a key subset (the ordinary keys, without the sink) in one more call with
  those keys masked (:func:`flex_call`). torch 2.13 refuses ``max_scores`` on CPU, so on a
  CPU this mode is ``"off"``. Not yet measured on a GPU (issue 62).
* ``"explicit"``: computed from blocks of the layer's scores, in the kernel's order (the
  product, then the scale): the reference the kernel's maxima are checked against, and
  the emulation of the kernel route on a CPU (no faster than the row path).
* ``"off"`` (default): no maxima from here; the row path, except where the pass
  computes the layer's output itself on a CPU (shared scores) and every statistic reads
  points and maxima: then the tiles that compute the output give the log-sum-exp and the
  maxima over every key and the declared key sets (:mod:`headmech.stream.tiles`), the
  flash kernel's cost plus a maximum a row (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

__all__ = [
    "KERNEL_DEVICES",
    "MODES",
    "RowMaxima",
    "engaged",
    "explicit_maxima",
    "flex_call",
    "forget",
    "mode",
    "row_maxima",
]

MODES = ("off", "explicit", "kernel")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("headmech_row_maxima", default="off")
# bytes of scores per block of rows when the maxima are computed explicitly
BLOCK_BYTES = 64 * 2**20

Keys = Bool[Tensor, "batch k_pos"]
Maxima = Float[Tensor, "batch n_heads q_pos"]


@contextlib.contextmanager
def row_maxima(how: str) -> Iterator[None]:
    """Inside the block, attention calls that return the log-sum-exp also give their rows'
    maxima (module docstring): ``"kernel"``, ``"explicit"`` or ``"off"``.

    Raises:
        ValueError: an unknown mode.
    """
    if how not in MODES:
        raise ValueError(f"row maxima: unknown mode {how!r}; known: {', '.join(MODES)}")
    token = _MODE.set(how)
    try:
        yield
    finally:
        _MODE.reset(token)


def mode() -> str:
    """The mode :func:`row_maxima` set (``"off"`` outside it)."""
    return _MODE.get()


class RowMaxima:
    """One layer's row maxima of the scaled, masked scores over any set of keys.

    ``maxima(keys)`` is ``[batch, n_heads, q_pos]``: each row's largest score over the keys
    it may attend to where ``keys`` (``Bool[batch, k_pos]``) is True, or over every key it
    may attend to for ``None``; ``-inf`` for a row with none. Each key set is computed once
    (by ``compute``), then read from a cache: several statistics ask for the same set.

    Args:
        compute: ``compute(keys)`` → the maxima.
        every: the maxima over every key where they are already known (the kernel's).
        known: key sets whose maxima are already known, with them
            (:func:`headmech.stream.tiles.attend`'s).
    """

    def __init__(
        self,
        compute: Callable[[Keys | None], Maxima],
        every: Maxima | None = None,
        known: Sequence[tuple[Keys, Maxima]] = (),
    ):
        self._compute = compute
        self._cache: list[tuple[Keys | None, Maxima]] = [] if every is None else [(None, every)]
        self._cache += list(known)

    def __call__(self, keys: Keys | None = None) -> Maxima:
        for known, out in self._cache:
            if known is None or keys is None:
                if known is keys:
                    return out
            elif known is keys or torch.equal(known, keys):
                return out
        out = self._compute(keys)
        self._cache.append((keys, out))
        return out


def _allowed_rows(call: Any, rows: slice, width: int) -> Tensor | None:
    """``Bool[batch | 1, 1, rows, width]``: where the rows may attend (None: everywhere)."""
    if call.mask is not None:
        return call.mask[..., rows, :width]
    if call.causal:
        offset = int(call.k.shape[2]) - int(call.q.shape[2])
        q_pos = torch.arange(rows.start, rows.stop, device=call.q.device) + offset
        return (torch.arange(width, device=call.q.device)[None, :] <= q_pos[:, None])[None, None]
    return None


def _block_scores(
    q: Float[Tensor, "batch n_heads rows d_head"], k: Float[Tensor, "batch n_kv_heads width d_head"]
) -> Float[Tensor, "batch n_heads rows width"]:
    """``q · kᵀ`` of every query head; grouped-query keys (one per key-value head) meet the
    rows of every query head they serve in one product, not repeated."""
    n_seqs, n_heads, n_rows = (int(d) for d in q.shape[:3])
    n_kv = int(k.shape[1])
    if n_kv == n_heads:
        return torch.matmul(q, k.transpose(-1, -2))
    qg = q.reshape(n_seqs, n_kv, (n_heads // n_kv) * n_rows, -1)
    s = torch.matmul(qg, k.transpose(-1, -2))  # [batch, n_kv, group · rows, width]
    return s.view(n_seqs, n_heads, n_rows, -1)


def explicit_maxima(
    call: Any, every: Maxima | None = None, known: Sequence[tuple[Keys, Maxima]] = ()
) -> RowMaxima:
    """The row maxima of ``call`` (a :class:`~headmech.stream.attention_call.LayerCall`,
    which imports this module) computed from blocks of its scores (module docstring),
    but those already known (``every``, ``known``: as :class:`RowMaxima` takes them)."""

    def compute(keys: Keys | None) -> Maxima:
        n_seqs, n_heads, n_q = (int(d) for d in call.q.shape[:3])
        n_keys = int(call.k.shape[2])
        out = torch.full((n_seqs, n_heads, n_q), float("-inf"), device=call.q.device)
        step = max(1, BLOCK_BYTES // (4 * n_seqs * n_heads * n_keys))
        for start in range(0, n_q, step):
            rows = slice(start, min(n_q, start + step))
            causal = call.causal and n_keys == n_q
            width = min(n_keys, rows.stop) if causal else n_keys
            s = _block_scores(call.q[:, :, rows], call.k[:, :, :width]).mul_(call.scale)
            if call.softcap is not None:
                s = s.div_(call.softcap).tanh_().mul_(call.softcap)
            hidden = _allowed_rows(call, rows, width)
            if keys is not None:
                chosen = keys[:, None, None, :width]
                hidden = chosen if hidden is None else hidden & chosen
            if hidden is not None:
                s = s.masked_fill_(~hidden, float("-inf"))
            out[:, :, rows] = s.amax(-1)
        return out

    return RowMaxima(compute, every, known)


# --- FlexAttention (CUDA) ---------------------------------------------------------------

_FLEX: list[Any] = []  # the compiled flex_attention, made on first use
_WARNED: list[bool] = [False]
# devices whose FlexAttention returns the rows' maxima (torch 2.13 refuses them on CPU/MPS)
KERNEL_DEVICES = ("cuda",)
# the last block masks built, with the mask and keys they were built from: every layer of a
# pass gets the same mask tensor and asks for the same key sets
_BLOCKS: list[tuple[Any, Any, tuple[int, int, bool], Any]] = []


def forget() -> None:
    """Drop the block masks kept for the pass (and the masks they hold)."""
    _BLOCKS.clear()


def _flex() -> Any:
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        # default dynamic shapes: a pass meets several lengths (short checks, the probe),
        # and a recompile per length would soon reach dynamo's cache limit (then eager)
        _FLEX.append(torch.compile(flex_attention))
    return _FLEX[0]


def _block_mask(
    mask: Tensor | None, causal: bool, keys: Keys | None, n_q: int, n_k: int, device: Any
) -> Any:
    """FlexAttention's block mask for the model's boolean mask (``[batch | 1, 1, q, k]``;
    None: causal with queries aligned to the last keys, or every key) and the chosen keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    shape = (n_q, n_k, causal)
    for known_mask, known_keys, known_shape, block in _BLOCKS:
        if known_mask is mask and known_keys is keys and known_shape == shape:
            return block
    offset = n_k - n_q
    per_seq = (mask is not None and mask.shape[0] > 1) or keys is not None
    n_seqs = max(mask.shape[0] if mask is not None else 1, keys.shape[0] if keys is not None else 1)

    def mask_mod(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        if mask is not None:
            ok = mask[b if mask.shape[0] > 1 else 0, 0, i, j]
        else:
            ok = (j <= i + offset) if causal else j >= 0
        return ok if keys is None else ok & keys[b, j]

    block = create_block_mask(
        mask_mod,
        n_seqs if per_seq else 1,
        None,
        n_q,
        n_k,
        device=device,
        _compile=torch.device(device).type == "cuda",  # no T x T mask on the way
    )
    _BLOCKS[:] = [*_BLOCKS[-3:], (mask, keys, shape, block)]
    return block


def engaged(device: torch.device) -> bool:
    """Whether an attention call on ``device`` gets its rows' maxima: ``"explicit"``
    anywhere, ``"kernel"`` on :data:`KERNEL_DEVICES`."""
    return mode() == "explicit" or (mode() == "kernel" and device.type in KERNEL_DEVICES)


def flex_call(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor, RowMaxima] | None:
    """On CUDA under ``row_maxima("kernel")``: the attention output ``[batch, q_pos,
    n_heads, d_head]``, the rows' log-sum-exp and their :class:`RowMaxima` from
    FlexAttention (one call; one more per key subset asked for); None elsewhere, or where
    FlexAttention fails (warned once: the engine's row path runs instead)."""
    if mode() != "kernel" or not engaged(query.device):
        return None
    try:
        from torch.nn.attention.flex_attention import AuxRequest

        flex, n_q, n_k = _flex(), query.shape[2], key.shape[2]
        gqa = query.shape[1] != key.shape[1]

        def run(keys: Keys | None) -> tuple[Tensor, Any]:
            block = _block_mask(mask, causal, keys, n_q, n_k, query.device)
            aux = AuxRequest(lse=True, max_scores=True)
            return flex(
                query, key, value, block_mask=block, scale=scale, enable_gqa=gqa, return_aux=aux
            )

        out, aux = run(None)
        maxima = RowMaxima(lambda keys: run(keys)[1].max_scores.float(), aux.max_scores.float())
        return out.transpose(1, 2).contiguous(), aux.lse.float(), maxima
    except Exception as err:  # noqa: BLE001 - any failure of the kernel: the row path
        if not _WARNED[0]:
            _WARNED[0] = True
            warnings.warn(
                f"row maxima from FlexAttention failed ({type(err).__name__}: {err}); "
                "statistics use the row path",
                stacklevel=2,
            )
        return None
