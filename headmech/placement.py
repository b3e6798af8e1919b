"""Where a model runs and in which dtype, decided in one place: the device exists on this
machine, the dtype is one headmech supports, and casting a loaded model keeps the buffers
whose precision matters (rotary frequencies) in fp32. Analysis arithmetic (statistics,
captures, losses) is fp32 whatever the weights' dtype: see ``headmech.engine`` and
``headmech.interventions.capture``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headmech.errors import InputError

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "cast_parameters", "device", "dtype"]

# the weight dtypes a model can be loaded in; statistics and metrics accumulate in fp32
DTYPES = ("float32", "bfloat16", "float16")


def device(spec: Any) -> Any:
    """A torch device that exists on this machine (None: the default); a one-line error
    for nonsense, ``cuda`` without a GPU, an index past the device count, absent ``mps``."""
    if spec is None:
        return None
    import torch

    try:
        d = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(
            f"device {spec!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)"
        ) from None
    if d.type == "cpu":
        return spec
    if d.type == "meta":
        raise InputError("device 'meta' holds no weights: use cpu or a GPU")
    if d.type == "mps":
        available, n = torch.backends.mps.is_available(), 1
    else:
        backend = getattr(torch, d.type, None)
        available = bool(getattr(backend, "is_available", lambda: False)())
        n = int(getattr(backend, "device_count", lambda: 1)()) if available else 0
    if not available:
        raise InputError(f"device {str(spec)!r}: no {d.type} device is available on this machine")
    if d.index is not None and d.index >= n:
        raise InputError(f"device {str(spec)!r}: this machine has {n} {d.type} device(s)")
    return spec


def dtype(spec: Any) -> Any:
    """A ``torch.dtype`` from ``float32``/``bfloat16``/``float16`` (or a floating
    ``torch.dtype``); None stays None (the weights' own dtype, fp32 for the bundled models)."""
    if spec is None:
        return None
    import torch

    name = str(spec).removeprefix("torch.")
    if name not in DTYPES:
        raise InputError(f"dtype {spec!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def cast_parameters(model: torch.nn.Module, to: torch.dtype | None) -> None:
    """Cast ``model``'s parameters (not its buffers: rotary ``inv_freq`` keeps its
    precision, as TransformerLens does) in place; None leaves them as loaded."""
    if to is None:
        return
    for p in model.parameters():
        p.data = p.data.to(to)
