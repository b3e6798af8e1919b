"""Engine overhead and memory against bare forward passes and run_with_cache.

Prints ratios measured in the same run (the machine is shared and noisy):

* time: stream_statistics (previous-token reducer on every layer) / bare forward passes
  over exactly the same batches and blocks;
* memory: peak resident memory above the loaded model, for the engine and for
  ``run_with_cache`` keeping every layer's attention pattern, at several sequence
  lengths (each measured in a fresh subprocess).

Usage: python benchmarks/bench_engine.py [--model smollm2-135m] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_probe(model_name: str, mode: str, seq_len: int, device: str | None) -> dict:
    """Run in a subprocess: peak memory of one pass at `seq_len` tokens."""
    import headmech
    from headmech.engine import stream_statistics
    from headmech.probes import batch_sequences, random_token_ids

    model = headmech.load_model(model_name, device=device)
    tok = model.tokenizer
    ids = random_token_ids(tok, torch.Generator().manual_seed(0), (1, seq_len)).tolist()
    batches = batch_sequences(ids, tok, 1)
    T = headmech.get_head_type("previous_token")()
    # warm-up on a short input so allocator start-up is not counted
    stream_statistics(model, batch_sequences([ids[0][:16]], tok, 1), T.reducers())
    base = rss_mb()
    if device and device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if mode == "engine":
        stream_statistics(model, batches, T.reducers())
    else:
        with torch.inference_mode():
            _, cache = model.run_with_cache(
                batches[0].input_ids.to(model.cfg.device),
                names_filter=lambda n: n.endswith("hook_pattern"),
            )
        del cache
    out = {"mode": mode, "seq_len": seq_len, "peak_above_model_mb": round(peak_mb() - base, 1)}
    if device and device.startswith("cuda"):
        out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None)
    ap.add_argument("--n-sentences", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--_memory", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory:
        mode, n = args._memory
        print(json.dumps(memory_probe(args.model, mode, int(n), args.device)))
        return

    import headmech
    from headmech.engine import bare_forward, stream_statistics
    from headmech.probes import ProbeOptions, build_probe

    t = time.perf_counter()
    model = headmech.load_model(args.model, device=args.device)
    print(f"model {args.model}: loaded in {time.perf_counter() - t:.1f}s")
    probe = build_probe("prose", model, ProbeOptions(n_sentences=args.n_sentences, batch_size=16))
    T = headmech.get_head_type("previous_token")()
    bare_forward(model, probe.batches[:1])  # warm-up
    bare, eng = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        bare_forward(model, probe.batches)
        bare.append(time.perf_counter() - t)
        t = time.perf_counter()
        stream_statistics(model, probe.batches, T.reducers())
        eng.append(time.perf_counter() - t)
    print(
        f"time: {probe.n_tokens} tokens in {len(probe.batches)} batches; bare {min(bare):.2f}s, "
        f"engine {min(eng):.2f}s, ratio engine/bare = {min(eng) / min(bare):.2f} (target <= 1.3)"
    )
    for n in [int(x) for x in args.lengths.split(",")]:
        rows = {}
        for mode in ("engine", "run_with_cache"):
            cmd = [sys.executable, __file__, "--model", args.model, "--_memory", mode, str(n)]
            if args.device:
                cmd += ["--device", args.device]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        e, c = rows["engine"]["peak_above_model_mb"], rows["run_with_cache"]["peak_above_model_mb"]
        print(
            f"memory @ {n} tokens: engine peak +{e:.0f} MB, run_with_cache(all patterns) +{c:.0f} MB, "
            f"ratio cache/engine = {c / max(e, 1.0):.1f}"
        )


if __name__ == "__main__":
    main()
