"""Many KV plans at once (``headmech.kv.evaluate_many``) against one ``evaluate`` per plan.

The plan set is :func:`headmech.kv.kv_importance`'s: the full cache and every KV head
alone windowed (SmolLM2: 1 + 90 plans), on one needle trial and one prose sequence. Plans
that agree on layers ``0..l-1`` share them, so the shared run computes about half the
layers of the one-by-one runs. Prints both times, their ratio and the largest difference
between the two runs' results (the shared run must give the same numbers).

Usage:
    python benchmarks/bench_kv_shared.py --context 512 --threads 2
"""

from __future__ import annotations

import argparse
import time

from common import add_arguments, record, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()
    start(args)
    import headmech
    from headmech.kv import evaluate, evaluate_many, hf_model, needle_batches, prose_batches

    bridge = headmech.load_model(args.model, device=args.device)
    hf = hf_model(bridge)
    needle = needle_batches(bridge, args.context, depths=(0.5,))
    prose = prose_batches(bridge, args.context, n=1)
    from headmech.kv.importance import one_windowed_plans

    plans = [None, *one_windowed_plans(hf, 4, args.window)[1]]
    t0 = time.perf_counter()
    shared = evaluate_many(hf, plans, needle, prose)
    t_shared = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [evaluate(hf, p, needle, prose) for p in plans]
    t_alone = time.perf_counter() - t0
    diff = max(
        max(abs(a.nll_sum - s.nll_sum) / abs(a.nll_sum), abs(a.logprob - s.logprob))
        for a, s in zip(alone, shared, strict=True)
    )
    ratio = t_alone / t_shared
    print(f"{args.model}, {len(plans)} plans, {args.context} tokens: one by one {t_alone:.1f}s, "
          f"shared {t_shared:.1f}s: {ratio:.2f}x; largest difference {diff:.2e}")  # fmt: skip
    record(
        "bench_kv_shared",
        args.device,
        [
            {
                "figure": "kv_shared",
                "result": f"{ratio:.2f}x",
                "target": ">= 1.5x, equal results",
                "what": f"evaluate_many vs one evaluate per plan, {args.model}, kv_importance's "
                f"{len(plans)} plans, {args.context} tokens (1 needle trial, 1 prose)",
                "met": bool(ratio >= 1.5 and diff < 1e-4),
                "values": {
                    "model": args.model,
                    "plans": len(plans),
                    "context": args.context,
                    "seconds_alone": round(t_alone, 2),
                    "seconds_shared": round(t_shared, 2),
                    "ratio": round(ratio, 3),
                    "largest_difference": diff,
                },
            }
        ],  # fmt: skip
    )


if __name__ == "__main__":
    main()
