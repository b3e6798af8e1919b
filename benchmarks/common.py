"""Helpers shared by the benchmark scripts: clocks, memory readings and the results file.

Every script appends its figures to ``benchmarks/results.json`` with :func:`record`
(replacing its own earlier rows); ``benchmarks/report.py`` turns that file into
``benchmarks/RESULTS.md``. The machine and device are recorded with the rows, so the
table names where it was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# $HEADMECH_BENCH_RESULTS: another file (the tests' runs of the scripts write there)
RESULTS = Path(os.environ.get("HEADMECH_BENCH_RESULTS") or Path(__file__).with_name("results.json"))


def add_arguments(ap: argparse.ArgumentParser, model: str | None = "smollm2-135m") -> None:
    """The options every script takes: ``--device``, ``--threads`` and ``--model``."""
    if model is not None:
        ap.add_argument("--model", default=model)
    ap.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); 1 steadies timings on a shared machine",
    )


def start(args: argparse.Namespace) -> None:
    """Apply the common options (the thread count) before any timing."""
    if args.threads:
        torch.set_num_threads(args.threads)


def is_cuda(device: str | None) -> bool:
    return bool(device) and str(device).startswith("cuda")


def sync(device: str | None) -> None:
    """Wait for queued GPU work, so that a clock read after it counts it."""
    if is_cuda(device):
        torch.cuda.synchronize()


def clock(device: str | None) -> float:
    sync(device)
    return time.perf_counter()


def fastest(run: Callable[[], Any], repeats: int, device: str | None) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``run`` (after one warm-up call), no grad."""
    with torch.inference_mode():
        run()
        best = float("inf")
        for _ in range(repeats):
            t0 = clock(device)
            run()
            best = min(best, clock(device) - t0)
    return best


def rss_mb() -> float:
    """Resident memory of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    """Peak resident memory of this process since :func:`reset_peak`.

    Linux's ``VmHWM``: the ``ru_maxrss`` of ``getrusage`` also keeps the peak seen when any
    thread exited (a thread pool resized after the model loaded), which a reset cannot clear.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_mb(device: str | None) -> float:
    """Memory in use now: tensors on the GPU, or this process's resident memory."""
    if is_cuda(device):
        return torch.cuda.memory_allocated() / 2**20
    return rss_mb()


def peak_mb(device: str | None) -> float:
    """The peak of :func:`memory_mb` since :func:`reset_peak`."""
    if is_cuda(device):
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


def reset_peak(device: str | None) -> None:
    """Start a new peak: the GPU allocator's, or Linux's ``VmHWM`` (``clear_refs`` 5).

    Without the reset the peak of loading the model would hide smaller peaks after it.
    """
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats()
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def available_mb(device: str | None) -> float:
    """Memory free for a new allocation: ``MemAvailable`` on CPU, free GPU memory on CUDA."""
    if is_cuda(device):
        return torch.cuda.mem_get_info()[0] / 2**20
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def isa() -> str:
    """The CPU's widest vector instructions, as the timings depend on them: "avx512" (with
    "+bf16", "+amx" where present), "avx2" or "" (the same CPU model name covers kinds
    whose ratios differ by 1.4x: docs/scaling.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(
                next((ln for ln in f if ln.startswith("flags")), ":").split(":", 1)[1].split()
            )
    except OSError:
        return ""
    if "avx512f" in flags:
        extra = ["bf16"] * ("avx512_bf16" in flags) + ["amx"] * ("amx_tile" in flags)
        return "+".join(["avx512", *extra])
    return "avx2" if "avx2" in flags else ""


def machine(device: str | None) -> dict[str, Any]:
    """CPU model, cores, RAM, library versions and the device the figures ran on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        ram_kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    def version(name: str) -> str | None:  # a GPU machine may have no TransformerLens
        try:
            return installed(name)
        except PackageNotFoundError:
            return None

    out = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "ram_gb": round(ram_kb / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "transformer_lens": version("transformer-lens"),
        "device": str(device or "cpu"),
        "threads": torch.get_num_threads(),
        "isa": isa(),
    }
    if is_cuda(device):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def record(
    script: str, device: str | None, rows: list[dict[str, Any]], where: dict | None = None
) -> None:
    """Replace ``script``'s rows in ``results.json`` (``where``: the machine the figures
    were measured on, when not this one: a GPU machine's record, say).

    Each row: ``figure`` (the issue's number, or a name), ``what``, ``result`` (text with
    the ratio), ``target`` (text or ""), ``met`` (True, False or None) and ``values`` (the
    numbers behind the text).
    """
    data: dict[str, Any] = {"runs": {}}
    if RESULTS.exists():
        data = json.loads(RESULTS.read_text())
    data["runs"][script] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": where or machine(device),
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
