"""Classify per head type on each decoder: seconds and peak memory, Gemma 3 against SmolLM2.

Gemma 3 270M has 5x SmolLM2's vocabulary (262,144 tokens), so every computation over the
vocabulary (the tiled token losses of validation, copy suppression's own-token ranks over
the whole vocabulary, the unembedding in the function-vector effects) costs more, while
its 72 heads are fewer than SmolLM2's 270. For every type that fits both models: one
``classify(model, [type])`` at the published check size (``--validate``: with validation,
2 control sets), in one process per model (the model loaded once), seconds and peak memory
above the loaded model (CPU: ``VmHWM`` reset before each type), and Gemma's time as a ratio
to SmolLM2's.

Usage: python benchmarks/bench_types.py [--models smollm2-135m,gemma3-270m] [--threads 2] [--validate]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import add_arguments, memory_mb, peak_mb, record, reset_peak, start


def one_model(name: str, device: str | None, validate: bool) -> dict[str, dict[str, float]]:
    """Every applicable type of ``name``, one at a time."""
    import headmech
    from headmech.publish import CHECK, applicable_types

    model = headmech.load_model(name, device=device)
    types, skipped = applicable_types(model)
    names = types or [t for t in headmech.head_types() if t not in skipped]
    base = memory_mb(device)
    out: dict[str, dict[str, float]] = {}
    for t in names:
        reset_peak(device)
        t0 = time.perf_counter()
        options = CHECK.probe_options()
        headmech.classify(model, [t], validate=validate, n_random=2, n_boot=CHECK.n_boot, **options)
        out[t] = {"seconds": time.perf_counter() - t0, "peak_mb": peak_mb(device) - base}
        print(
            f"{name} {t}: {out[t]['seconds']:.1f} s, +{out[t]['peak_mb']:.0f} MB", file=sys.stderr
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap, model=None)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--validate", action="store_true", help="validate each type (2 controls)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one model, JSON out
    args = ap.parse_args()
    start(args)
    if args.one:
        print(json.dumps(one_model(args.one, args.device, args.validate)))
        return
    models = args.models.split(",")
    got = {}
    for m in models:  # a fresh process per model: one model's memory does not hide the other's
        cmd = [sys.executable, __file__, "--one", m]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        cmd += ["--device", args.device] if args.device else []
        cmd += ["--validate"] if args.validate else []
        got[m] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    a, b = models[0], models[-1]
    rows = []
    print(f"| type | {a} s | {a} MB | {b} s | {b} MB | {b} / {a} time |")
    print("|---|---|---|---|---|---|")
    for t in sorted(set(got[a]) & set(got[b])):
        x, y = got[a][t], got[b][t]
        ratio = y["seconds"] / x["seconds"]
        print(
            f"| {t} | {x['seconds']:.1f} | {x['peak_mb']:.0f} | {y['seconds']:.1f} | "
            f"{y['peak_mb']:.0f} | {ratio:.2f}x |"
        )
        rows.append(
            {
                "figure": f"types/{t}",
                "what": f"classify {t} at the check size{' with validation' if args.validate else ''}, "
                f"{b} vs {a}",
                "result": f"{ratio:.2f}x ({y['seconds']:.1f} s vs {x['seconds']:.1f} s)",
                "target": "",
                "met": None,
                "values": {"type": t, a: x, b: y},
            }
        )
    record("bench_types", args.device, rows)


if __name__ == "__main__":
    main()
