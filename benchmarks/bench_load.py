"""Load times of the bundled models: first load (SmolLM2's GGUF dequantised into an
empty cache) against a cached load, each in a fresh process.

Usage: python benchmarks/bench_load.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

SNIPPET = (
    "import time; t=time.perf_counter(); import headmech; "
    "m=headmech.load_model('{name}'); print(round(time.perf_counter()-t, 2))"
)


def timed_load(name: str, cache: str) -> float:
    env = {**os.environ, "HEADMECH_CACHE": cache}
    r = subprocess.run(
        [sys.executable, "-c", SNIPPET.format(name=name)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        for name in ("minilm-l6", "smollm2-135m"):
            first = timed_load(name, cache)
            cached = timed_load(name, cache)
            print(
                f"{name}: first load {first:.1f}s, cached load {cached:.1f}s, "
                f"ratio first/cached = {first / cached:.1f} (process start and imports included)"
            )


if __name__ == "__main__":
    main()
