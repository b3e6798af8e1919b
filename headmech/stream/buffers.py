"""Named buffers of one statistics pass, reused by every block and layer."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["Buffers"]


class Buffers:
    """Named buffers of one pass, each grown to the largest size asked of it and reused by
    every block and layer: a pass allocates its large temporaries once, so its peak memory
    does not depend on how the C allocator treats many freed buffers of about the same
    size (at 8,192 tokens, glibc's heap kept SmolLM2's per-layer buffers of ~19 MB)."""

    def __init__(self) -> None:
        self._flat: dict[str, Tensor] = {}

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        reserve: int = 0,
    ) -> Tensor:
        """A contiguous ``shape`` view of buffer ``name`` (its values are whatever was
        left: write before reading). ``reserve``: elements to allocate when the buffer
        must grow (the largest size the caller will ask for), so that a run of growing
        requests (causal blocks) allocates once."""
        n = math.prod(shape)
        flat = self._flat.get(name)
        if (
            flat is None
            or flat.numel() < n
            or flat.dtype != dtype
            or flat.device != torch.device(device)
        ):
            self._flat.pop(name, None)  # the old buffer goes before the new one is allocated
            flat = self._flat[name] = torch.empty(max(n, reserve), dtype=dtype, device=device)
        return flat[:n].view(shape)

    def release(self, name: str) -> None:
        """Free buffer ``name`` (the next :meth:`take` allocates it again)."""
        self._flat.pop(name, None)

    def repeat_heads(self, name: str, x: Tensor, rep: int) -> Tensor:
        """``x.repeat_interleave(rep, dim=1)`` (``[batch, heads, pos, d]``: grouped-query
        key heads for the query heads they serve) into buffer ``name``."""
        b, h, n, d = (int(v) for v in x.shape)
        out = self.take(name, (b, h, rep, n, d), x.dtype, x.device)
        out.copy_(x[:, :, None].expand(b, h, rep, n, d))
        return out.view(b, h * rep, n, d)
