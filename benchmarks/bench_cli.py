"""How fast the command line answers what needs no model: ``headmech --help``,
``models``, ``types`` and a mistyped name (issue 65's target: at most 1.5 s each).

Each command runs ``--repeats`` times (5) in a fresh process, after one warm-up run (the
file cache holds Python's and headmech's files, as on a second call); the median wall time
is reported, and for comparison the time of ``python -c "import torch"`` alone, which the
command line no longer pays for these answers (tests/test_registry_index.py checks that
torch is not imported).

Usage: python benchmarks/bench_cli.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import add_arguments, record, start

TARGET_S = 1.5
COMMANDS = {
    "--help": ["--help"],
    "models": ["models"],
    "types": ["types"],
    "mistyped model": ["classify", "smollm2-13m"],
    "mistyped type": ["classify", "smollm2-135m", "--types", "inductoin"],
}


def wall(cmd: list[str], repeats: int) -> float:
    """Median seconds of ``repeats`` runs of ``cmd`` (after one warm-up)."""
    subprocess.run(cmd, capture_output=True, check=False)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap, model=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    start(args)
    cli = [sys.executable, "-m", "headmech"]
    got = {name: wall(cli + argv, args.repeats) for name, argv in COMMANDS.items()}
    torch_s = wall([sys.executable, "-c", "import torch"], args.repeats)
    for name, s in got.items():
        print(f"headmech {name}: {s:.2f} s ({s / TARGET_S:.2f}x the {TARGET_S} s target)")
    print(f"python -c 'import torch' alone: {torch_s:.2f} s")
    worst = max(got.values())
    record(
        "bench_cli",
        args.device,
        [
            {
                "figure": "cli/start",
                "what": "headmech --help, models, types and a mistyped model or type name: "
                "the slowest median wall time of a fresh process",
                "result": f"{worst:.2f} s ({worst / TARGET_S:.2f}x the target; importing torch "
                f"alone: {torch_s:.2f} s)",
                "target": f"<= {TARGET_S} s",
                "met": worst <= TARGET_S,
                "values": {"seconds": got, "import_torch_s": torch_s, "repeats": args.repeats},
            }
        ],
    )


if __name__ == "__main__":
    main()
