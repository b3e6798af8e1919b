"""Engine overhead and memory against bare forward passes and run_with_cache.

Prints ratios measured in the same run (the machine is shared and noisy):

* time: stream_statistics (previous-token reducer on every layer) / bare forward passes
  over exactly the same batches and blocks;
* memory (figure 3): peak memory above the loaded model while classifying one sequence of
  256 to 4096 random tokens (the previous-token type's reducers on every layer), against
  ``run_with_cache`` keeping every layer's attention pattern and against the same blocks
  run with no hooks (the floor). Each configuration runs in a
  fresh subprocess: on CPU the peak resident memory (``ru_maxrss``, reset after the model
  is loaded) minus the resident memory then; on CUDA ``torch.cuda.max_memory_allocated``
  minus the memory allocated then. ``run_with_cache`` runs only where all layers' patterns
  (``n_layers x n_heads x T^2`` floats) take under 40% of the free memory; elsewhere the
  analytic size is printed. The eager attention itself materialises one layer's pattern
  (``n_heads x T^2``, several times: scores, masked scores, softmax), so growth like one
  layer's pattern is the floor; the target is growth of at most 5 layers' patterns, where
  caching all patterns grows by ``n_layers`` of them.

Usage: python benchmarks/bench_engine.py [--model smollm2-135m] [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import torch
from common import (
    add_arguments,
    available_mb,
    clock,
    is_cuda,
    memory_mb,
    peak_mb,
    record,
    reset_peak,
    start,
)


def memory_probe(model_name: str, mode: str, seq_len: int, device: str | None) -> dict:
    """Run in a subprocess: peak memory of one pass at `seq_len` tokens."""
    import headmech
    from headmech.probes import batch_sequences, random_token_ids
    from headmech.stream.engine import bare_forward, stream_statistics

    model = headmech.load_model(model_name, device=device)
    tok = model.tokenizer
    ids = random_token_ids(tok, torch.Generator().manual_seed(0), (1, seq_len)).tolist()
    batches = batch_sequences(ids, tok, 1)
    T = headmech.get_head_type("previous_token")()
    # warm-up on a short input so allocator start-up is not counted
    stream_statistics(model, batch_sequences([ids[0][:16]], tok, 1), T.reducers())
    gc.collect()
    reset_peak(device)
    base = memory_mb(device)
    if mode == "engine":
        stream_statistics(model, batches, T.reducers())
    elif mode == "bare":
        bare_forward(model, batches)
    else:
        with torch.inference_mode():
            _, cache = model.run_with_cache(
                batches[0].input_ids.to(model.cfg.device),
                names_filter=lambda n: n.endswith("hook_pattern"),
            )
        del cache
    return {
        "mode": mode,
        "seq_len": seq_len,
        "peak_above_model_mb": round(peak_mb(device) - base, 1),
    }


def measure(model_name: str, mode: str, n: int, args: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--model", model_name, "--_memory", mode, str(n)]
    if args.device:
        cmd += ["--device", args.device]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(r.stdout.strip().splitlines()[-1])["peak_above_model_mb"])


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--n-sentences", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", default="256,1024,2048,4096")
    ap.add_argument("--_memory", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    start(args)
    if args._memory:
        mode, n = args._memory
        print(json.dumps(memory_probe(args.model, mode, int(n), args.device)))
        return

    import headmech
    from headmech.probes import ProbeOptions, build_probe
    from headmech.stream.engine import bare_forward, stream_statistics

    t = time.perf_counter()
    model = headmech.load_model(args.model, device=args.device)
    print(f"model {args.model}: loaded in {time.perf_counter() - t:.1f}s")
    probe = build_probe("prose", model, ProbeOptions(n_sentences=args.n_sentences, batch_size=16))
    T = headmech.get_head_type("previous_token")()
    bare_forward(model, probe.batches[:1])  # warm-up
    bare, eng = [], []
    for _ in range(args.repeats):
        t = clock(args.device)
        bare_forward(model, probe.batches)
        bare.append(clock(args.device) - t)
        t = clock(args.device)
        stream_statistics(model, probe.batches, T.reducers())
        eng.append(clock(args.device) - t)
    ratio = min(eng) / min(bare)
    print(
        f"time: {probe.n_tokens} tokens in {len(probe.batches)} batches; bare {min(bare):.2f}s, "
        f"engine {min(eng):.2f}s, ratio engine/bare = {ratio:.2f} (target <= 1.3)"
    )
    rows = [
        {
            "figure": "engine",
            "what": f"stream_statistics (previous-token reducer) / bare forward passes over the "
            f"same batches ({args.model}, {probe.n_tokens} tokens)",
            "result": f"{ratio:.2f}x ({min(eng):.2f} s vs {min(bare):.2f} s)",
            "target": "<= 1.3",
            "met": ratio <= 1.3,
            "values": {"engine_s": min(eng), "bare_s": min(bare)},
        }
    ]

    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    itemsize = next(model.parameters()).element_size()  # eager attention keeps the model dtype
    del model
    gc.collect()
    if is_cuda(args.device):
        torch.cuda.empty_cache()  # the subprocesses measure; free what this one cached
    peaks: dict[int, dict[str, float]] = {}
    for n in [int(x) for x in args.lengths.split(",")]:
        one = n_heads * n * n * itemsize / 2**20  # one layer's pattern, MB
        every = n_layers * one
        peaks[n] = p = {mode: measure(args.model, mode, n, args) for mode in ("engine", "bare")}
        free = available_mb(args.device)
        if every < 0.4 * free:
            p["cache"] = c = measure(args.model, "run_with_cache", n, args)
            cache = f"run_with_cache +{c:.0f} MB ({c / every:.2f}x all layers' patterns, {c / p['engine']:.1f}x the engine)"
        else:
            cache = (
                f"run_with_cache not run (would need {every / 1024:.1f} GB for the patterns alone; "
                f"{free / 1024:.1f} GB free)"
            )
        e = p["engine"]
        result = (
            f"engine +{e:.0f} MB = {e / one:.1f}x one layer's pattern, {e / every:.2f}x all layers'; "
            f"bare forward +{p['bare']:.0f} MB; {cache}"
        )
        print(
            f"memory @ {n} tokens (one layer's pattern {one:.0f} MB, all {n_layers} layers' {every:.0f} MB): {result}"
        )
        rows.append(
            {
                "figure": "3",
                "what": f"peak memory above the model, classifying one {n}-token sequence "
                f"({args.model}; one layer's pattern {one:.0f} MB, all layers' {every:.0f} MB)",
                "result": result,
                "target": "",
                "met": None,
                "values": {"tokens": n, "one_layer_mb": one, **p},
            }
        )
    ns = sorted(peaks)
    if (
        len(ns) > 1
    ):  # the target: how the engine's peak grows from the shortest probe to the longest
        lo, hi = ns[0], ns[-1]
        grown = {mode: peaks[hi][mode] - peaks[lo][mode] for mode in ("engine", "bare")}
        one = n_heads * (hi * hi - lo * lo) * itemsize / 2**20
        ok = grown["engine"] <= 5 * one
        result = (
            f"engine +{grown['engine']:.0f} MB = {grown['engine'] / one:.1f}x the growth of one layer's "
            f"pattern ({grown['engine'] / (n_layers * one):.2f}x all {n_layers} layers'); bare forward "
            f"+{grown['bare']:.0f} MB = {grown['bare'] / one:.1f}x"
        )
        print(f"memory growth {lo} -> {hi} tokens: {result}")
        rows.append(
            {
                "figure": "3",
                "what": f"growth of the peak memory, {lo} -> {hi} tokens",
                "result": result,
                "target": f"like one layer's pattern: <= 5x (all layers': {n_layers}x)",
                "met": ok,
                "values": {"one_layer_growth_mb": one, **grown},
            }
        )
    record("bench_engine", args.device, rows)


if __name__ == "__main__":
    main()
