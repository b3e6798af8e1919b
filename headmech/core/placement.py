"""Where a model runs and in which dtype, decided in one place: the device exists on this
machine, the dtype is one headmech supports, and casting a loaded model keeps the buffers
whose precision matters (rotary frequencies) in fp32. Analysis arithmetic (statistics,
captures, losses) is fp32 whatever the weights' dtype: see ``headmech.stream.engine`` and
``headmech.interventions.capture``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headmech.core.errors import HeadmechWarning, InputError
from headmech.core.scratch import scratch_folder

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "Placement",
    "cast_parameters",
    "device",
    "dispatch",
    "dtype",
    "materialised",
    "memory_map",
    "model_device",
    "slow_on_cpu",
]

# the weight dtypes a model can be loaded in; statistics and metrics accumulate in fp32
DTYPES = ("float32", "bfloat16", "float16")


def model_device(model: Any) -> torch.device:
    """The device of the model's first parameter (where its inputs go)."""
    return next(model.parameters()).device


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


def slow_on_cpu(to: Any) -> str | None:
    """Why weights of dtype ``to`` would run slowly on this CPU, or None: bf16 and fp16
    matrix products run several times slower than fp32 on a CPU without matrix
    instructions for them (oneDNN's check; docs/scaling.md, "Devices and dtypes": 5.3x for
    bf16 on an AVX2-only EPYC)."""
    import torch

    probes = {
        torch.bfloat16: ("bfloat16", "_is_mkldnn_bf16_supported"),
        torch.float16: ("float16", "_is_mkldnn_fp16_supported"),
    }
    if to not in probes:
        return None
    name, probe = probes[to]
    try:
        native = bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a torch without the check: no claim
        return None
    if native:
        return None
    return (
        f"{name} weights on a CPU without {name} matrix instructions run several times "
        "slower than float32 (5.3x measured for bfloat16 on an AVX2-only CPU): "
        "use float32 on this machine, or a GPU"
    )


def cast_parameters(model: torch.nn.Module, to: torch.dtype | None) -> None:
    """Cast ``model``'s parameters (not its buffers: rotary ``inv_freq`` keeps its
    precision, as TransformerLens does) in place; None leaves them as loaded."""
    if to is None:
        return
    for p in model.parameters():
        p.data = p.data.to(to)


def memory_map(spec: str | dict[Any, Any] | None) -> dict[Any, Any] | None:
    """``max_memory`` for accelerate from ``"cpu=2GiB,0=70GiB"`` (GPU indices as ints) or
    a dict; None stays None. A one-line error for anything else."""
    if spec is None or isinstance(spec, dict):
        return spec
    out: dict[Any, Any] = {}
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        dev, eq, amount = part.partition("=")
        if not eq or not dev.strip() or not amount.strip():
            raise InputError(
                f"--max-memory {spec!r}: expected DEVICE=SIZE,... e.g. cpu=2GiB,0=70GiB"
            )
        dev = dev.strip()
        out[int(dev) if dev.isdigit() else dev] = amount.strip()
    if not out:
        raise InputError(f"--max-memory {spec!r}: expected DEVICE=SIZE,... e.g. cpu=2GiB,0=70GiB")
    return out


def dispatch(
    model: torch.nn.Module,
    device_map: str | dict[str, Any] | None,
    max_memory: dict[Any, Any] | None,
    offload_folder: str | None = None,
) -> None:
    """Place a loaded Hugging Face model across devices with accelerate
    (``infer_auto_device_map`` within ``max_memory``, then ``dispatch_model``; modules that
    fit nowhere go to ``disk``, under ``offload_folder`` or a temporary folder). Nothing
    happens when neither ``device_map`` nor ``max_memory`` is given."""
    if device_map is None and max_memory is None:
        return
    from accelerate import dispatch_model, infer_auto_device_map

    if not isinstance(device_map, dict):  # "auto", or a memory budget alone
        if device_map not in (None, "auto"):
            raise InputError(f"device map {device_map!r}: use 'auto' or a dict of modules")
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        device_map = dict(
            infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
        )
    if "disk" in device_map.values() and offload_folder is None:
        # the offloaded weights go with the model (or at exit), not left in /tmp
        offload_folder = str(scratch_folder("headmech-offload-", owner=model))
    dispatch_model(model, device_map=device_map, offload_dir=offload_folder)


@dataclass(frozen=True)
class Placement:
    """Where a model goes and in which dtype, checked before it loads (:meth:`checked`)
    and applied to the loaded Hugging Face model (:meth:`apply`)."""

    device: Any = None
    dtype: Any = None
    device_map: str | dict[str, Any] | None = None
    max_memory: dict[Any, Any] | None = None
    offload_folder: str | None = None

    @classmethod
    def checked(
        cls,
        device_: Any = None,
        dtype_: Any = None,
        device_map: str | dict[str, Any] | None = None,
        max_memory: str | dict[Any, Any] | None = None,
        offload_folder: str | None = None,
    ) -> Placement:
        """Every setting validated (one-line :class:`InputError` otherwise)."""
        budget = memory_map(max_memory)
        where = cls(device(device_), dtype(dtype_), device_map, budget, offload_folder)
        on_cpu = where.device is None or str(where.device).startswith("cpu")
        spread = where.device_map is not None or where.max_memory is not None  # accelerate's
        if on_cpu and not spread and (why := slow_on_cpu(where.dtype)):
            warnings.warn(why, HeadmechWarning, stacklevel=2)
        return where

    def apply(self, model: torch.nn.Module) -> None:
        """Cast, then dispatch across devices/disk or move to the device."""
        cast_parameters(model, self.dtype)
        if self.device_map is not None or self.max_memory is not None:
            dispatch(model, self.device_map, self.max_memory, self.offload_folder)
        elif self.device is not None:
            model.to(self.device)


@contextlib.contextmanager
def materialised(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, weights that accelerate offloaded (``device_map``) are loaded into
    their modules, so code that reads weights directly (``model.W_Q``, ``W_U``, norms) sees
    values; a no-op for a model loaded whole. Read the weights inside the block and run
    no forward pass there: a forward puts offloaded weights back (accelerate's hooks)."""
    from accelerate.utils import align_module_device, has_offloaded_params

    with contextlib.ExitStack() as stack:
        for module in model.modules():
            if has_offloaded_params(module):
                stack.enter_context(align_module_device(module))
        yield


def is_offloaded(model: torch.nn.Module) -> bool:
    """True when accelerate keeps some of the model's weights on disk or CPU (offload)."""
    from accelerate.utils import has_offloaded_params

    return any(has_offloaded_params(m) for m in model.modules())
