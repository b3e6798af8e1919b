"""Load times of the bundled models: first load (SmolLM2's GGUF dequantised into an
empty cache) against a cached load, each in a fresh process.

Usage: python benchmarks/bench_load.py [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from common import add_arguments, record, start

SNIPPET = (
    "import time; t=time.perf_counter(); import headmech; "
    "m=headmech.load_model('{name}', device={device!r}); print(round(time.perf_counter()-t, 2))"
)


def timed_load(name: str, cache: str, device: str | None, threads: int | None) -> float:
    env = {**os.environ, "HEADMECH_CACHE": cache}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    r = subprocess.run(
        [sys.executable, "-c", SNIPPET.format(name=name, device=device)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap, model=None)
    args = ap.parse_args()
    start(args)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name in ("minilm-l6", "smollm2-135m"):
            first = timed_load(name, cache, args.device, args.threads)
            cached = timed_load(name, cache, args.device, args.threads)
            print(
                f"{name}: first load {first:.1f}s, cached load {cached:.1f}s, "
                f"ratio first/cached = {first / cached:.1f} (process start and imports included)"
            )
            rows.append(
                {
                    "figure": "load",
                    "what": f"{name} load, first (empty cache) vs cached, fresh processes",
                    "result": f"{first:.1f} s vs {cached:.1f} s ({first / cached:.1f}x)",
                    "target": "",
                    "met": None,
                    "values": {"first_s": first, "cached_s": cached},
                }
            )
    record("bench_load", args.device, rows)


if __name__ == "__main__":
    main()
