"""Exact JSON: values stored so that they read back equal, bit for bit.

The finished units of a resumable run (:mod:`headmech.runs.resume`, which re-exports
:func:`encode` and :func:`decode`) are stored this way: tensors as their raw bytes (dtype,
shape and device kept), floats by ``repr`` (NaN and infinities included), tuples, head
indices and dicts with other keys than strings tagged.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import torch

from headmech.core.head_index import HeadIndex

__all__ = ["decode", "encode"]


_TAGS = ("__tensor__", "__tuple__", "__head__", "__items__")


def encode(value: Any) -> Any:
    """``value`` as JSON-ready data that :func:`decode` turns back into an equal value,
    bit for bit: tensors as their bytes (dtype, shape, device kept), floats by ``repr``
    (NaN and infinities included), tuples, head indices and dicts with other keys than
    strings tagged. Anything else: ``TypeError``."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return float(value)
    if isinstance(value, torch.Tensor):
        t = value.detach()
        raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {
            "__tensor__": {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "device": str(t.device),
                "bytes": base64.b64encode(raw).decode("ascii"),
            }
        }
    if isinstance(value, HeadIndex):
        return {"__head__": [int(value.layer), int(value.head)]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item) and type(value).__module__ == "numpy":
        return encode(item())
    raise TypeError(f"a finished unit cannot hold a {type(value).__name__}")


def _tensor(record: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, record["dtype"])
    raw = base64.b64decode(record["bytes"])
    shape = [int(n) for n in record["shape"]]
    if not raw:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    device = record.get("device", "cpu")
    if device != "cpu":
        with contextlib.suppress(RuntimeError, AssertionError):  # that device is gone
            t = t.to(device)
    return t


def decode(data: Any) -> Any:
    """The value :func:`encode` was given."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, inner), *_ = data.items()
        if tag == "__tensor__":
            return _tensor(inner)
        if tag == "__head__":
            return HeadIndex(int(inner[0]), int(inner[1]))
        if tag == "__tuple__":
            return tuple(decode(v) for v in inner)
        if tag == "__items__":
            return {decode(k): decode(v) for k, v in inner}
    return {k: decode(v) for k, v in data.items()}
