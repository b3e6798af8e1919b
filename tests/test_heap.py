"""The C heap's free pages given back between layers (:mod:`headmech.core.heap`): only
above the limit, a no-op without glibc, a real drop of resident memory on a fragmented
heap, and once after every CPU layer of a statistics pass inside the attention call."""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import pytest
import torch

from headmech.core import heap
from headmech.stream import attention_call
from headmech.stream.engine import ProbeBatch, stream_statistics, target_reducer

MiB = 2**20


def test_release_trims_only_above_the_limit(monkeypatch):
    trims = []
    fake = SimpleNamespace(
        mallinfo2=lambda: SimpleNamespace(fordblks=100 * MiB),
        malloc_trim=lambda pad: trims.append(pad) or 1,
    )
    monkeypatch.setattr(heap, "_glibc", lambda: fake)
    assert heap.free_bytes() == 100 * MiB
    assert not heap.release(100 * MiB) and trims == []  # at the limit: kept
    assert heap.release(99 * MiB) and trims == [0]
    assert not heap.release(None) and trims == [0]  # None: never
    monkeypatch.setattr(heap, "_glibc", lambda: None)  # another C library: nothing to do
    assert heap.free_bytes() is None and not heap.release(0)


def _resident() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(heap._glibc() is None, reason="glibc 2.33+ only (Linux)")
def test_release_gives_a_fragmented_heaps_pages_back():
    """2,048 blocks of 64 KiB (below any mmap threshold: on the heap), every other one
    freed: 64 MiB of holes between live blocks, which trimming the heap's top cannot
    return. ``release`` gives their pages back: resident memory drops by most of it."""
    libc = heap._glibc()
    malloc, free = libc.malloc, libc.free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    size = 64 * 1024
    blocks = [malloc(size) for _ in range(2048)]
    try:
        assert all(blocks)
        for p in blocks:
            ctypes.memset(p, 1, size)  # resident
        for p in blocks[::2]:
            free(p)
        assert heap.free_bytes() >= 64 * MiB
        before = _resident()
        assert heap.release(32 * MiB)
        dropped = before - _resident()
    finally:
        for p in blocks[1::2]:
            free(p)
    assert dropped > 48 * MiB, dropped / MiB


def test_each_cpu_layer_of_a_pass_gives_the_heap_back(tiny_models, monkeypatch):
    """Inside the attention call, each layer's end of a long sequence asks for the heap back with
    ``attention_call.HEAP_LIMIT`` (the kernel's route and the shared scores' alike); the
    statistics are the same with it off (None)."""
    from headmech.attribution.confidence import confidence_reducer

    model = tiny_models["llama"]
    n_layers = int(model.cfg.n_layers)
    ids = torch.randint(
        3, int(model.cfg.d_vocab), (2, 24), generator=torch.Generator().manual_seed(0)
    )
    batch = ProbeBatch(ids, torch.ones_like(ids), torch.zeros_like(ids, dtype=torch.bool))
    points = [target_reducer("prev", lambda b: torch.arange(24).expand_as(b.input_ids) - 1)]
    asked = []
    monkeypatch.setattr(heap, "release", lambda limit: asked.append(limit) or False)
    stream_statistics(model, [batch], points, attention="blocks")
    assert asked == []  # 24 tokens: below HEAP_MIN_TOKENS, no trim
    monkeypatch.setattr(attention_call, "HEAP_MIN_TOKENS", 24)
    for reducers in (points, [confidence_reducer()]):  # the kernel's route; shared scores
        asked.clear()
        on = stream_statistics(model, [batch], reducers, attention="blocks")
        assert asked == [heap.LIMIT] * n_layers, asked
    monkeypatch.setattr(attention_call, "HEAP_LIMIT", None)
    asked.clear()
    off = stream_statistics(model, [batch], reducers, attention="blocks")
    assert asked == [None] * n_layers
    for k in on.sums:
        torch.testing.assert_close(off.sums[k], on.sums[k], atol=0, rtol=0, msg=k)
