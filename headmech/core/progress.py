"""Progress for long work: a tqdm bar showing tokens per second and peak memory, and the
run record (``run.json``) the command line writes beside its results.

Result files stay byte-identical across reruns (no timings in them); how long a run took
and how much memory it used live in ``run.json``.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

__all__ = ["bar", "peak_memory_mb", "reporting", "run_record", "steps"]

T = TypeVar("T")

# on inside ``reporting()``: the phases deep in a computation (validation, weight
# statistics over the vocabulary, indirect effects, bootstrap) show bars without every
# signature on the way carrying a ``progress`` flag
_REPORTING: ContextVar[bool] = ContextVar("headmech_progress", default=False)


@contextlib.contextmanager
def reporting(on: bool = True) -> Iterator[None]:
    """Within the block, :func:`steps` shows bars (``on``) or not."""
    token = _REPORTING.set(bool(on))
    try:
        yield
    finally:
        _REPORTING.reset(token)


def active() -> bool:
    """Whether progress is being reported here (inside ``reporting()``, on rank 0)."""
    from headmech.core import distributed

    return _REPORTING.get() and distributed.is_main()


def steps(
    items: Iterable[T],
    desc: str,
    total: int | None = None,
    tokens: Callable[[T], int] | None = None,
) -> Iterable[T]:
    """:func:`bar` inside ``reporting()``, else ``items`` unchanged."""
    return bar(items, desc, total, tokens) if active() else items


def peak_memory_mb() -> float:
    """Peak memory of this process so far: CUDA's allocator peak on a GPU machine, else
    the peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def bar(
    items: Iterable[T],
    desc: str,
    total: int | None = None,
    tokens: Callable[[T], int] | None = None,
) -> Iterator[T]:
    """``items`` under a tqdm bar (time left as tqdm estimates it) with tokens/s and peak
    memory as its postfix; ``tokens(item)`` counts an item's tokens."""
    from tqdm.auto import tqdm

    seen, start = 0, time.perf_counter()
    with tqdm(items, desc=desc, total=total, leave=False) as it:
        for item in it:
            yield item
            seen += tokens(item) if tokens else 0
            rate = seen / max(time.perf_counter() - start, 1e-9)
            it.set_postfix_str(f"{rate:,.0f} tok/s, peak {peak_memory_mb():,.0f} MB", refresh=False)


def import_tqdm_quietly() -> None:
    """Import ``tqdm.auto`` once, without its warning. In a Jupyter kernel without
    ipywidgets, the first import of ``tqdm.auto`` (transformers' own, when headmech loads a
    model) warns in a block of stderr (``TqdmWarning: IProgress not found``) before it
    falls back to the text bar, which works in a notebook: ``import headmech`` calls this
    first, so a notebook shows its bars and no such block."""
    if "tqdm.autonotebook" in sys.modules:
        return
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401


def run_record(command: str, result: Any, seconds_load: float, seconds_total: float) -> dict:
    """What ``run.json`` holds: seconds (load, compute), the probe's tokens and tokens per
    second of compute, peak memory, processes and device."""
    from headmech.core import distributed

    probes = getattr(result, "provenance", {}).get("probes", {})
    n_tokens = sum(int(p.get("n_tokens", 0)) for p in probes.values())
    compute = max(seconds_total - seconds_load, 1e-9)
    model = getattr(result, "provenance", {}).get("model", {})
    return {
        "command": command,
        "seconds": {"load": round(seconds_load, 2), "compute": round(compute, 2)},
        "probe_tokens": n_tokens,
        "probe_tokens_per_second": round(n_tokens / compute, 1),
        "peak_memory_mb": round(peak_memory_mb(), 1),
        "processes": distributed.world()[1],
        "device": model.get("device"),
        "dtype": model.get("dtype"),
    }
