"""Long context: head statistics against a bare fused-attention forward, 2k to 8k tokens.

One sequence of ``T`` tokens (BOS, ``T/2`` random tokens, the same tokens again: the
induction probe at length ``T``), the reducers of every catalog type that reads attention
on a token sequence (positional, previous token, duplicate token, induction, attention
sink) plus Voita's confidence, three ways, each in a fresh subprocess:

* ``bare``: the same blocks with no hooks, attention as fused SDPA (the floor);
* ``blocks``: ``stream_statistics(attention="blocks")``: patterns rebuilt from q and k in
  blocks of query rows while the model runs SDPA (what ``classify`` does by default);
* ``pattern``: ``stream_statistics(attention="pattern")``: eager attention, reducers on
  every layer's whole ``hook_pattern`` (the path before pattern-free statistics);
* ``points``: only the types whose statistics are point masses (induction, duplicate
  token: attention on one key per query) in the pattern-free path, where models whose
  attention call returns the log-sum-exp (:mod:`headmech.stream.attention_call`) build no
  pattern rows but the few whose argmax the points leave open;
* ``all``: every built-in type whose statistics read attention and whose probe data a
  token sequence holds (those of ``blocks``, and any other type whose ``prepare`` takes the
  sequence), as ``classify`` runs them (``attention="blocks"``: inside the attention call,
  rows from scores and the kernel's log-sum-exp, :mod:`headmech.stream.rows`).

Rotary decoders (SmolLM2, Gemma 3) reduce inside their attention call; Gemma 3's sliding
windows are in the mask that call receives.

Peak memory above the loaded model (CPU: ``VmHWM`` reset after loading; CUDA: the
allocator's peak) and seconds of one pass, as ratios to ``bare``; targets at 8,192
tokens: memory <= 1.25x and time <= 1.5x. Writes a table and ``long.png``.

Usage:
    python benchmarks/bench_long.py [--lengths 2048,4096,8192] [--threads 2]
    python benchmarks/bench_long.py --model gemma3-270m --lengths 2048,4096,8192
    python benchmarks/bench_long.py --lengths 16384,32768 --modes bare,blocks,points
    python benchmarks/bench_long.py --lengths 8192 --modes bare,all --threads 1 --repeats 3
    python benchmarks/bench_long.py --device cuda --model-config llama-1b --dtype bfloat16 \\
        --lengths 8192,32768,65536   # random weights from a config: no download
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_arguments, clock, isa, memory_mb, peak_mb, record, reset_peak, start

MODES = ("bare", "blocks", "pattern", "points", "all")
TYPES = ("positional", "previous_token", "duplicate_token", "induction", "attention_sink")
POINT_TYPES = ("duplicate_token", "induction")
# targets at 8,192 tokens (memory, time) as ratios to the bare forward: the point
# statistics' (the issue "statistics at the cost of the forward"), every type's (issue 62,
# "statistics at the forward's cost where researchers run")
TARGETS = {
    "points": {"smollm2-135m": (1.1, 1.2), "gemma3-270m": (1.2, 1.3)},
    "all": {"smollm2-135m": (1.1, 1.2), "gemma3-270m": (1.1, 1.2)},
}
# a LLaMA-3.2-1B-shaped config (grouped-query: 32 query heads, 8 KV heads), as sizes and
# config fields of headmech.models.tiny.tiny_hf
CONFIGS = {
    "llama-1b": dict(
        d_model=2048,
        d_mlp=8192,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        n_ctx=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
}


def _load(args: argparse.Namespace):  # noqa: ANN202
    import headmech

    if not args.model_config:
        return headmech.load_model(args.model, device=args.device, dtype=args.dtype)
    from headmech.models.tiny import tiny_model

    # random weights (transformers' initialisation) with SmolLM2's tokenizer, whose pad
    # token is no padding row of the embedding
    return tiny_model(
        "llama",
        tempfile.mkdtemp(prefix="bench_long_"),
        tokenizer=headmech.load_model("smollm2-135m").tokenizer,
        init=0.02,
        pad_token_id=None,
        device=args.device,
        dtype=args.dtype,
        **CONFIGS[args.model_config],
    )


def one_pass(args: argparse.Namespace, mode: str, n: int) -> dict:
    """In a subprocess: seconds and peak memory above the model of one pass."""
    import headmech
    from headmech.attribution.confidence import confidence_reducer
    from headmech.probes import ProbeOptions, build_probe
    from headmech.stream.engine import bare_forward, stream_statistics
    from headmech.stream.forward import fast_attention

    model = _load(args)
    opts = ProbeOptions(n_sequences=1, half_len=(n - 1) // 2, batch_size=1)
    batches = build_probe("repeated_random", model, opts).batches
    short = build_probe("repeated_random", model, ProbeOptions(n_sequences=1, half_len=32)).batches
    if mode == "points":
        reducers = [r for t in POINT_TYPES for r in headmech.get_head_type(t)().reducers()]
    elif mode == "all":
        reducers = [confidence_reducer(), *_sequence_reducers(model, short[0])]
    else:
        reducers = [r for t in TYPES for r in headmech.get_head_type(t)().reducers()]
        reducers.append(confidence_reducer())

    def run(b: list) -> None:
        if mode == "bare":
            with fast_attention(model) as on:
                assert on, "no fused attention for this model"
                bare_forward(model, b)
        else:
            how = "blocks" if mode in ("points", "all") else mode
            stream_statistics(model, b, reducers, attention=how)

    run(short)  # warm-up (and the once-per-model check)
    gc.collect()
    reset_peak(args.device)
    base = memory_mb(args.device)
    t0, c0 = clock(args.device), time.process_time()
    run(batches)
    seconds = clock(args.device) - t0
    return {
        "mode": mode,
        "tokens": batches[0].n_tokens,
        "seconds": seconds,
        # the process's CPU seconds (every thread): steadier than the wall clock where other
        # work shares the cores (with --threads 1, no thread waits on another)
        "cpu_seconds": time.process_time() - c0,
        "peak_mb": peak_mb(args.device) - base,
    }


def _sequence_reducers(model, batch) -> list:  # noqa: ANN001
    """The reducers of every registered type that reads attention (``hook_pattern``) and
    whose statistics a plain token sequence can feed: each type's reducers are run once
    on ``batch`` (a short sequence); types that need parses, word counts, a needle or
    prompts of their own (their ``prepare`` or their reduction reads data the sequence
    lacks) are left out."""
    import headmech
    from headmech.stream.engine import stream_statistics

    out = []
    for name in headmech.head_types():
        reducers = headmech.get_head_type(name)().reducers()
        if not reducers or any(r.hook != "hook_pattern" for r in reducers):
            continue
        try:
            stream_statistics(model, [batch], reducers, attention="blocks")
        except Exception:  # noqa: BLE001 - the type needs data this sequence lacks
            continue
        out += reducers
    return out


def _median(runs: list[dict]) -> dict:
    """The pass of median seconds (the lower middle of an even count), its peak memory the
    median of the passes'."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    peaks = sorted(r["peak_mb"] for r in runs)
    return {**ordered[(len(ordered) - 1) // 2], "peak_mb": peaks[(len(peaks) - 1) // 2]}


def _paired(runs: list[dict], bare: list[dict]) -> str:
    """Each turn's time ratio to the bare pass of the same turn, lowest to highest ("" for
    one turn, or where a pass failed and the turns no longer pair)."""
    if len(runs) < 2 or len(runs) != len(bare):
        return ""
    ratios = sorted(r["seconds"] / b["seconds"] for r, b in zip(runs, bare, strict=True))
    return ", ".join(f"{x:.2f}x" for x in ratios)


def measure(args: argparse.Namespace, mode: str, n: int) -> dict:
    cmd = [sys.executable, __file__, "--_pass", mode, str(n), "--model", args.model]
    for flag in ("device", "threads", "dtype", "model_config"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = dict(os.environ)
    if args.mmap_threshold:  # glibc: buffers above it are mapped and unmapped, not kept
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        return {"mode": mode, "error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def figure(table: dict[int, dict[str, dict]], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    data = {"tokens": [], "mode": [], "memory": [], "time": []}
    for n, row in table.items():
        for mode in ("blocks", "all", "points", "pattern"):
            if (
                mode in row
                and "error" not in row[mode]
                and "error" not in row.get("bare", {"error": 1})
            ):
                data["tokens"].append(n)
                data["mode"].append(mode)
                data["memory"].append(row[mode]["peak_mb"] / row["bare"]["peak_mb"])
                data["time"].append(row[mode]["seconds"] / row["bare"]["seconds"])
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, what, target in zip(axes, ("memory", "time"), (1.25, 1.5), strict=True):
        sns.barplot(x=data["tokens"], y=data[what], hue=data["mode"], ax=ax)
        ax.axhline(target, color="k", ls="--", lw=1)
        ax.set_xlabel("tokens")
        ax.set_ylabel(f"{what} / bare SDPA forward")
    fig.suptitle(f"{name}: head statistics at long context")
    fig.tight_layout()
    suffix = "" if name == "smollm2-135m" else f"_{name}"
    suffix += "" if sorted(table) == [2048, 4096, 8192] else "_" + "_".join(map(str, sorted(table)))
    fig.savefig(Path(__file__).with_name(f"long{suffix}.png"), dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model-config", default=None, choices=sorted(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="glibc's MALLOC_MMAP_THRESHOLD_ in every pass (e.g. 65536): freed buffers go back "
        "to the system at once, so peak RSS counts live tensors, not the allocator's heap",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes per mode, the modes in turn; the table gives medians and each turn's "
        "ratio to its bare pass (the bare forward alone moves +-5%% run to run on a 2-core VM)",
    )
    ap.add_argument("--_pass", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    start(args)
    if args._pass:
        print(json.dumps(one_pass(args, args._pass[0], int(args._pass[1]))))
        return
    name = args.model_config or args.model
    table: dict[int, dict[str, dict]] = {}
    rows = []
    print(
        f"{name} ({args.dtype or 'float32'}, {args.device or 'cpu'}"
        + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold})" if args.mmap_threshold else ")")
    )
    print(
        f"{'tokens':>7} {'mode':>8} {'seconds':>8} {'peak MB':>8} {'time x':>7} {'cpu x':>6} "
        f"{'mem x':>6}"
    )
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = args.modes.split(",")
    for n in lengths:
        table[n] = row = {}
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        # the modes in turn, --repeats times: a slow spell of the machine falls on every mode
        for _ in range(args.repeats):
            for mode in modes:
                t = time.perf_counter()
                r = measure(args, mode, n)
                if "error" in r:
                    print(f"{n:>7} {mode:>8} failed: {r['error']} ({time.perf_counter() - t:.0f}s)")
                    continue
                runs[mode].append(r)
                if args.repeats > 1:
                    print(f"{n:>7} {mode:>8} {r['seconds']:>8.2f} {r['peak_mb']:>8.0f}", flush=True)
        for mode in modes:
            if not runs[mode]:
                row[mode] = {"mode": mode, "error": "every pass failed"}
                continue
            row[mode] = r = _median(runs[mode])
            bare = row.get("bare", {})
            tx = r["seconds"] / bare["seconds"] if "seconds" in bare else float("nan")
            mx = r["peak_mb"] / bare["peak_mb"] if "peak_mb" in bare else float("nan")
            cx = r["cpu_seconds"] / bare["cpu_seconds"] if "cpu_seconds" in bare else float("nan")
            spread = _paired(runs[mode], runs.get("bare", []))
            print(
                f"{n:>7} {mode:>8} {r['seconds']:>8.2f} {r['peak_mb']:>8.0f} {tx:>7.2f} "
                f"{cx:>6.2f} {mx:>6.2f}" + (f"  (each turn: {spread})" if spread else ""),
                flush=True,
            )
            if mode == "bare":
                continue
            last = n == max(lengths)
            result = (
                f"memory {mx:.2f}x ({r['peak_mb']:.0f} vs {bare.get('peak_mb', 0):.0f} MB), "
                f"time {tx:.2f}x ({r['seconds']:.1f} vs {bare.get('seconds', 0):.1f} s), "
                f"CPU time {cx:.2f}x" + (f"; each turn: {spread}" if spread else "")
            )
            if "seconds" not in bare:  # no bare pass in this run: the pass alone, no ratio
                result = f"{r['seconds']:.1f} s, {r['peak_mb']:.0f} MB (no bare pass to compare)"
                target, met = "", None
            elif mode == "blocks":
                target, met = "memory <= 1.25x, time <= 1.5x at 8,192", mx <= 1.25 and tx <= 1.5
            elif mode in TARGETS and name in TARGETS[mode] and n == 8192:
                mem, t = TARGETS[mode][name]
                target, met = f"memory <= {mem}x, time <= {t}x at 8,192", mx <= mem and tx <= t
            else:
                target, met = "", None
            rows.append(
                {
                    "figure": "long",
                    "what": f"{mode} statistics vs bare SDPA forward, one {n}-token sequence "
                    f"({name}, {args.dtype or 'float32'})"
                    + (" (induction, duplicate token)" if mode == "points" else "")
                    + (
                        f", glibc mmap threshold {args.mmap_threshold} B"
                        if args.mmap_threshold
                        else ""
                    )
                    + (f", medians of {args.repeats} turns" if args.repeats > 1 else ""),
                    "result": result,
                    "target": target,
                    "met": met if last or mode != "blocks" else None,
                    "values": {"tokens": n, mode: r, "bare": bare, "turns": runs[mode]},
                }
            )
    figure(table, name)
    # one results.json entry per model (SmolLM2's unnamed) and for lengths past 8,192
    key = "bench_long" + ("" if name == "smollm2-135m" else f"_{name}")
    default = lengths == [2048, 4096, 8192]
    key += "" if default else "_" + "_".join(str(n) for n in lengths)
    key += "_mmap" if args.mmap_threshold else ""
    key += f"_x{args.repeats}" if args.repeats > 1 else ""  # medians: a record of its own
    key += "_avx2" if isa() == "avx2" else ""  # ratios 1.4x those of AVX-512 CPUs: their own
    record(key, args.device, rows)


if __name__ == "__main__":
    main()
