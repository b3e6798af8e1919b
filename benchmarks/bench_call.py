"""Head statistics inside the attention call against the bare forward, on a Hugging Face
model alone (no TransformerLens: it runs where only torch and transformers are installed,
such as a GPU machine).

A LLaMA-shaped decoder with random weights (``--config``: SmolLM2-135M's shape or
LLaMA-3.2-1B's; grouped-query attention) runs one sequence of ``T`` tokens (BOS, ``T/2``
random tokens, the same tokens again: the induction probe) five ways:

* ``bare``: transformers' SDPA attention, nothing else;
* ``points``: every layer through :func:`headmech.stream.attention_call.stats_attention` with the
  induction and duplicate-token statistics (attention mass on one target key per query,
  and whether it is the row's argmax) from point masses ``exp(scale · q · k − LSE)``, the
  log-sum-exp coming from the fused kernel that computes the output (CPU: flash
  attention; CUDA: memory-efficient attention), only the rows the points leave open
  computed whole;
* ``mass``: the same without the argmax hits: nothing but point masses, O(d_head) a
  query;
* ``blocks``: the same statistics from blocks of query rows' scores (``--block-mb``) and
  the kernel's log-sum-exp (:mod:`headmech.stream.rows`), the path of reducers with row
  statistics;
* ``all``: every registered type that reads attention and whose probe data a token
  sequence holds, with Voita's confidence, in one pass (as ``classify`` runs them);
* ``unshared``: ``all`` with shared scores off (:mod:`headmech.stream.rows`): on a CPU the
  fused kernel computes the output and the statistics compute the rows' scores again
  (the path before shared scores);
* ``maxima``: the same statistics from points and each row's maximum
  (:mod:`headmech.stream.maxima`): on CUDA FlexAttention computes the output, the
  log-sum-exp and the rows' maxima in one call (one more for the maxima over the ordinary
  keys); on a CPU the maxima are computed from the scores (an emulation, for the check).

Before timing, the paths are compared with each other and with the eager attention
weights (``output_attentions``) at ``--check-length`` tokens (``maxima`` against ``all``:
equal up to near-ties, rows whose top two scores lie within float32 rounding). Reports time and peak
memory above the model as ratios to ``bare`` (CUDA: events and the allocator's peak).

Usage:
    python benchmarks/bench_call.py --lengths 2048,4096 --threads 2
    python benchmarks/bench_call.py --device cuda --dtype bfloat16 --config llama-1b \\
        --lengths 8192,32768,65536
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("transformer_lens") is None:
    # headmech's __init__ needs TransformerLens; the modules used here do not
    package = types.ModuleType("headmech")
    package.__path__ = [str(HERE.parent / "headmech")]
    sys.modules["headmech"] = package

from common import add_arguments, clock, memory_mb, peak_mb, record, reset_peak, start  # noqa: E402

from headmech.core.stats import HeadStats, ProbeBatch  # noqa: E402
from headmech.stream import attention_call, maxima, passes  # noqa: E402
from headmech.stream.points import Points  # noqa: E402
from headmech.stream.reducers import target_reducer  # noqa: E402

CONFIGS = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
    ),
}  # fmt: skip


WHAT = {
    "mass": "induction, duplicate token, no argmax hits",
    "points": "induction, duplicate token",
    "blocks": "induction, duplicate token, rows from score blocks",
    "all": "every type on a token sequence, with confidence",
    "unshared": "every type on a token sequence, with confidence, shared scores off",
    "maxima": "every type on a token sequence, with confidence, from points and the rows' "
    "maxima (CUDA: FlexAttention's; CPU: computed, an emulation)",
}
TARGETS = {
    "mass": "time <= 1.5x",
    "points": "time <= 1.5x",
    "all": "time <= 1.2x, memory <= 1.1x",
    "unshared": "time <= 1.2x, memory <= 1.1x",
    "maxima": "time <= 1.3x, memory <= 1.2x",
}


def probe(n: int, vocab: int, device: str) -> ProbeBatch:
    """BOS, then ``h`` random tokens twice (``n = 2h + 1``)."""
    half = (n - 1) // 2
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (1, half), generator=g)
    ids = torch.cat([torch.ones(1, 1, dtype=torch.long), tokens, tokens], 1)
    mask = torch.ones_like(ids)
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, 0] = True
    return ProbeBatch(ids, mask, special).to(device)


def reducers(half: int, mode: str, batch: ProbeBatch | None = None, model: Any = None) -> list:
    """The two statistics; ``mode`` ``mass``: no argmax hits; ``blocks``: no points (rows
    from score blocks and the kernel's log-sum-exp, :mod:`headmech.stream.rows`); ``all``
    and ``maxima``: every registered type that reads attention and whose statistics this
    token sequence feeds, with Voita's confidence (what ``classify`` runs on it)."""
    if mode in ("all", "unshared", "maxima"):
        return all_reducers(batch, model)

    def induction(b: ProbeBatch) -> torch.Tensor:  # the token after the earlier copy
        pos = torch.arange(b.input_ids.shape[1], device=b.input_ids.device)
        return torch.where(pos > half, pos - half + 1, -1).expand_as(b.input_ids)

    def duplicate(b: ProbeBatch) -> torch.Tensor:  # the earlier copy itself
        pos = torch.arange(b.input_ids.shape[1], device=b.input_ids.device)
        return torch.where(pos > half, pos - half, -1).expand_as(b.input_ids)

    hits = mode != "mass"
    out = [
        target_reducer("induction", induction, hits=hits),
        target_reducer("duplicate", duplicate, hits=hits),
    ]
    return [dataclasses.replace(r, points=None) for r in out] if mode == "blocks" else out


def all_reducers(batch: ProbeBatch | None, model: Any = None) -> list:
    """Confidence and every registered type's reducers whose ``prepare`` accepts ``batch``
    and, with ``model``, that run on a short token sequence (as benchmarks/bench_long.py's
    ``all`` mode; types that need parses, word counts, a needle or prompts of their own
    are left out)."""
    from headmech.attribution.confidence import confidence_reducer
    from headmech.headtypes import get_head_type, head_types

    out = [confidence_reducer()]
    short = None if model is None else probe(33, model.config.vocab_size, model.device.type)
    for name in head_types():
        try:
            rs = get_head_type(name)().reducers()
            if not rs or any(r.hook != "hook_pattern" for r in rs):
                continue
            for r in rs:
                if r.prepare is not None:
                    r.prepare(batch)
            if short is not None:
                statistics(model, short, rs, 2**24)
        except Exception:  # noqa: BLE001 - the type needs data (or a library) this run lacks
            continue
        out += rs
    return out


def build(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=131072,
        initializer_range=args.init,
        **CONFIGS[args.config],
    )
    torch.manual_seed(0)
    with torch.device(args.device or "cpu"):
        model = LlamaForCausalLM(cfg)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32
    return model.to(dtype).eval()


def statistics(model: Any, batch: ProbeBatch, rs: list, budget: int) -> HeadStats:
    """One pass of the decoder (no unembedding) with ``rs`` reduced inside every layer's
    attention call, as the engine does it (:func:`headmech.stream.passes.call_reducer`)."""
    cfg = model.config
    stats = HeadStats(cfg.num_hidden_layers, cfg.num_attention_heads)
    state = {
        "batch": batch,
        "budget": budget,
        "prepared": {r.name: r.prepare(batch) for r in rs},
    }
    on_call = passes.call_reducer(rs, stats, state)
    attention_call._register()
    layers = model.model.layers
    old = cfg._attn_implementation
    try:
        cfg._attn_implementation = attention_call.IMPLEMENTATION
        for i, layer in enumerate(layers):
            layer.self_attn.__dict__["_headmech_stats"] = lambda call, i=i: on_call(i, call)
            # shared scores where the pass builds every row (attention_call.reducing's way)
            layer.self_attn.__dict__["_headmech_shared"] = getattr(on_call, "every_row", False)
        with torch.inference_mode():
            model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        cfg._attn_implementation = old
        for layer in layers:
            layer.self_attn.__dict__.pop("_headmech_stats", None)
            layer.self_attn.__dict__.pop("_headmech_shared", None)
    return stats


def bare(model: Any, batch: ProbeBatch) -> None:
    with torch.inference_mode():
        model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)


def check(args: argparse.Namespace, model: Any, budget: int) -> dict:
    """Points vs blocks vs the eager attention weights, at ``--check-length`` tokens."""
    n = args.check_length
    batch = probe(n, model.config.vocab_size, args.device or "cpu")
    half = (n - 1) // 2
    a = statistics(model, batch, reducers(half, "points"), budget)
    b = statistics(model, batch, reducers(half, "blocks"), budget)
    out: dict[str, float] = {}
    for k in a.sums:
        out[f"points-blocks {k}"] = float((a.mean(k) - b.mean(k)).abs().max())
    cfg = model.config
    old = cfg._attn_implementation
    try:
        cfg._attn_implementation = "eager"
        with torch.inference_mode():
            att = model.model(input_ids=batch.input_ids, output_attentions=True).attentions
    finally:
        cfg._attn_implementation = old
    for name, r in zip(("induction", "duplicate"), reducers(half, "points"), strict=True):
        prepared = r.prepare(batch)
        t, has = prepared.index, prepared.has
        want = torch.stack(
            [
                (a_.float().gather(-1, t[:, None, :, None].expand(-1, a_.shape[1], -1, 1))[..., 0]
                 * has[:, None]).sum((0, 2)) / has.sum()
                for a_ in att
            ]
        )  # fmt: skip
        out[f"points-eager {name}.mass"] = float((a.mean(f"{name}.mass") - want.cpu()).abs().max())
        out[f"{name}.mass max"] = float(want.max())
    # the rows path of every type: Voita's confidence (each real query's largest weight on
    # an ordinary key) against the eager weights
    c = statistics(model, batch, reducers(half, "all", batch, model), budget)
    ordinary = ~batch.special
    want = torch.stack(
        [
            (a_.float().masked_fill(~ordinary[:, None, None, :], 0).amax(-1) * ordinary[:, None])
            .sum((0, 2)) / ordinary.sum()
            for a_ in att
        ]
    )  # fmt: skip
    out["rows-eager confidence.max"] = float((c.mean("confidence.max") - want.cpu()).abs().max())
    out["confidence.max max"] = float(want.max())
    out["all statistics"] = len(c.sums)
    # the maxima route (issue 62) against the row path: equal up to near-ties
    kernel_calls: list[int] = []
    real = maxima.flex_call

    def counting(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        kernel_calls.append(got is not None)
        return got

    maxima.flex_call = counting  # type: ignore[assignment]
    try:
        with maxima.row_maxima(_maxima_mode(args.device)):
            m = statistics(model, batch, reducers(half, "maxima", batch, model), budget)
    finally:
        maxima.flex_call = real  # type: ignore[assignment]
    out["maxima route"] = (
        f"kernel in {sum(kernel_calls)} of {len(kernel_calls)} calls"
        if _maxima_mode(args.device) == "kernel"
        else "explicit (CPU emulation)"
    )
    diffs = {k: float((m.mean(k) - c.mean(k)).abs().max()) for k in c.sums}
    worst = max(diffs, key=diffs.__getitem__)
    out["maxima-rows max"], out["maxima-rows worst statistic"] = diffs[worst], worst
    out["maxima-eager confidence.max"] = float((m.mean("confidence.max") - want.cpu()).abs().max())
    return out


def _maxima_mode(device: str | None) -> str:
    """The maxima route's source: FlexAttention on CUDA, computed maxima elsewhere."""
    return "kernel" if device and str(device).startswith("cuda") else "explicit"


def time_one(args: argparse.Namespace, model: Any, mode: str, n: int, budget: int) -> dict:
    batch = probe(n, model.config.vocab_size, args.device or "cpu")
    half = (n - 1) // 2

    rs = reducers(half, mode, batch, model) if mode != "bare" else []

    def run() -> None:
        if mode == "bare":
            bare(model, batch)
        elif mode == "maxima":
            with maxima.row_maxima(_maxima_mode(args.device)):
                statistics(model, batch, rs, budget)
        elif mode == "unshared":
            attention_call.SHARED_SCORES = False
            try:
                statistics(model, batch, rs, budget)
            finally:
                attention_call.SHARED_SCORES = True
        else:
            statistics(model, batch, rs, budget)

    counted: list[int] = []
    real = Points.argmax

    def counting(self: Any, rows: torch.Tensor) -> torch.Tensor:
        counted.append(int(rows.sum()))
        return real(self, rows)

    Points.argmax = counting  # type: ignore[method-assign]
    try:
        reset_peak(args.device)
        base = memory_mb(args.device)
        t0 = clock(args.device)
        run()
        seconds = clock(args.device) - t0
    finally:
        Points.argmax = real  # type: ignore[method-assign]
    # rows with a target, over the heads and layers, for each of the two statistics
    rows = 2 * model.config.num_attention_heads * model.config.num_hidden_layers * (n - 1 - half)
    if args.profile and n > 257:
        print(f"{mode}, {n} tokens:")
        _profile(run, args.profile)
    return {
        "seconds": seconds,
        "peak_mb": peak_mb(args.device) - base,
        "whole_rows": sum(counted) / rows if mode == "points" else None,
        "launches": _launches(run, args.device) if args.launches else None,
    }


def _launches(run: Any, device: str | None) -> int:
    """Kernels one more (untimed) pass launches: CUDA kernels on a GPU, aten operators on
    a CPU (the unit a launch-bound pass pays per call)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bool(device) and str(device).startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
    if cuda:
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def _profile(run: Any, rows: int) -> None:
    """Print the ``rows`` aten operators of one more (untimed) pass that took the most
    self CPU time (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap, model=None)
    ap.add_argument("--config", default="smollm2-135m", choices=sorted(CONFIGS))
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--check-length", type=int, default=513)
    ap.add_argument("--block-mb", type=int, default=256, help="memory for a block of rows")
    ap.add_argument("--blocks-max", type=int, default=32768, help="longest blocks/all run")
    ap.add_argument(
        "--launches",
        action="store_true",
        help="count the kernels of one more pass per mode (torch profiler, untimed)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="print this many aten operators of one more pass per mode (by self CPU time)",
    )
    ap.add_argument("--modes", default="bare,mass,points,blocks,all,maxima")
    ap.add_argument(
        "--init",
        type=float,
        default=0.02,
        help="weight scale: 0.02 (Hugging Face's) gives near-uniform attention, the points' "
        "worst case; 0.1 peaked rows, closer to a trained model's",
    )
    args = ap.parse_args()
    start(args)
    model = build(args)
    budget = args.block_mb * 2**20
    Points.ROW_BYTES = budget  # rows the points leave open, a chunk at a time
    agreement = check(args, model, budget)
    print(json.dumps(agreement, indent=1))
    modes = tuple(args.modes.split(","))
    for mode in modes:  # warm-up
        time_one(args, model, mode, 257, budget)
    rows = []
    print(f"{'tokens':>7} {'mode':>7} {'seconds':>8} {'peak MB':>8} {'time x':>7} {'mem x':>6}")
    for n in (int(x) for x in args.lengths.split(",")):
        results: dict[str, dict] = {}
        for mode in (
            m
            for m in modes
            if n <= args.blocks_max or m not in ("blocks", "all", "unshared", "maxima")
        ):
            results[mode] = r = time_one(args, model, mode, n, budget)
            tx = r["seconds"] / results["bare"]["seconds"]
            mx = r["peak_mb"] / max(results["bare"]["peak_mb"], 1e-9)
            extra = f"  whole rows {r['whole_rows']:.4f}" if r["whole_rows"] is not None else ""
            extra += f"  launches {r['launches']}" if r["launches"] is not None else ""
            print(
                f"{n:>7} {mode:>7} {r['seconds']:>8.3f} {r['peak_mb']:>8.0f} {tx:>7.2f} {mx:>6.2f}{extra}"
            )
            sys.stdout.flush()
            if mode != "bare":
                rows.append(
                    {
                        "figure": "call",
                        "what": f"{mode} statistics ({WHAT[mode]}) in the attention call "
                        f"vs bare SDPA forward, one {n}-token sequence ({args.config} shape, random "
                        f"weights of scale {args.init}, {args.dtype or 'float32'})",
                        "result": f"time {tx:.2f}x ({r['seconds']:.2f} vs {results['bare']['seconds']:.2f} s), "
                        f"memory {mx:.2f}x",
                        "target": TARGETS.get(mode, ""),
                        "met": {
                            "all": tx <= 1.2 and mx <= 1.1,
                            "unshared": tx <= 1.2 and mx <= 1.1,
                            "maxima": tx <= 1.3 and mx <= 1.2,
                            "blocks": None,
                        }.get(mode, tx <= 1.5),
                        "values": {"tokens": n, "config": args.config, "init": args.init, mode: r,
                                   "bare": results["bare"], "agreement": agreement},
                    }
                )  # fmt: skip
        # recorded after every length: a run stopped at a longer one keeps the shorter ones
        dev = "cuda" if args.device and args.device.startswith("cuda") else "cpu"
        record(f"bench_call_{args.config}_{dev}_init{args.init:g}", args.device, rows)


if __name__ == "__main__":
    main()
