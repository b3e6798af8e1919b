"""Give the C heap's free pages back to the system between layers of a long CPU pass.

On Linux, glibc keeps a freed block of less than its mmap threshold (which grows to 32 MB
after the first large free) on its heap, resident, for the next allocation. A forward at
8,192 tokens frees dozens of 19 MB activations a layer; which of them the heap can reuse
depends on where the allocator placed everything else, and that changes from one process
to the next (address-space randomisation: with it off, two bare SmolLM2 passes peaked
within 0.5 MB of each other). So the same pass peaks at one of two levels: measured on an
AMD EPYC with AVX-512, one thread, SmolLM2-135M at 8,192 tokens, six processes each: the
bare forward 724-725 or 903-1,056 MB above the model, every statistic 778-785 or
1,175-1,309 MB; at the higher level the heap held 400-480 MB of free blocks.

:func:`release` asks glibc to return the heap's free pages (``malloc_trim(0)``) when
``mallinfo2`` counts more than ``limit`` bytes of them; the statistics inside the
attention call (:mod:`headmech.stream.attention_call`) do so after every CPU layer of a
long sequence. Where
the C library is not glibc 2.33 or newer, it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

__all__ = ["LIMIT", "free_bytes", "release"]

# free heap bytes above which a layer's end gives them back: a tiny model's pass never
# gets there; SmolLM2 at 8,192 tokens passes it after nearly every layer
LIMIT = 64 * 2**20


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: ten ``size_t`` counts."""

    _fields_ = [  # noqa: RUF012 - ctypes reads the class attribute
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


@functools.cache
def _glibc() -> Any:
    """glibc with ``mallinfo2`` and ``malloc_trim``, or None (another C library)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        info, trim = libc.mallinfo2, libc.malloc_trim
    except (OSError, AttributeError):  # musl, or glibc before 2.33
        return None
    info.restype, info.argtypes = _MallInfo2, []
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    return libc


def free_bytes() -> int | None:
    """Bytes of free blocks glibc's heaps hold (``mallinfo2().fordblks``), or None."""
    libc = _glibc()
    return None if libc is None else int(libc.mallinfo2().fordblks)


def release(limit: int | None = LIMIT) -> bool:
    """Return the heap's free pages to the system when it holds more than ``limit``
    bytes of them (None: never). Whether it did."""
    libc = _glibc()
    if limit is None or libc is None or libc.mallinfo2().fordblks <= limit:
        return False
    libc.malloc_trim(0)
    return True
