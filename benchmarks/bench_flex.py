"""Can the attention kernel give the row statistics? FlexAttention's row maxima on a GPU.

The row path (:mod:`headmech.stream.rows`) recomputes ``scale * q @ k.T`` in blocks because
the fused kernel returns each row's log-sum-exp but not its maximum. FlexAttention
(``torch.nn.attention.flex_attention``) returns both (``return_aux=AuxRequest(lse=True,
max_scores=True)``) on CUDA (torch 2.13 refuses ``max_scores`` on CPU). With the maximum, a
row's statistics need only a few point scores: a target or offset key is the argmax where
its score equals the maximum; the largest weight is ``exp(max - LSE)``. This script measures,
for one layer's attention at LLaMA-3.2-1B's shape (32 query heads, 8 KV heads, d_head 64,
causal, bf16), per length:

* ``sdpa``: ``scaled_dot_product_attention`` (the bare forward's kernel);
* ``flex``: compiled ``flex_attention`` with the log-sum-exp and row maxima;
* ``flex-ordinary``: the same with the first key (the sink) masked out, the second call
  Voita's confidence (largest weight on an ordinary key) would need;
* ``scores``: the row path's cost for the maxima, ``q @ k.T`` and ``amax`` in blocks of
  query rows (``--block-mb``), as :class:`~headmech.stream.rows.RowBlock` computes it;

and checks flex's maxima and LSE against the explicit scores at the shortest length.

Usage (a CUDA machine; no TransformerLens needed):
    python benchmarks/bench_flex.py --lengths 8192,32768,65536
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def _time(fn, repeats: int = 5) -> float:  # noqa: ANN001
    fn()
    if not torch.cuda.is_available():  # a dry run of the script on a CPU
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1000


def one_length(args: argparse.Namespace, n: int, check: bool) -> dict:  # noqa: PLR0915
    """Seconds (and CUDA peak MB) of each way at ``n`` tokens; with ``check``, flex's
    maxima and LSE against the explicit scores."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    dev, dtype = args.device, torch.bfloat16
    flex = torch.compile(flex_attention, dynamic=False)
    scale = 1 / math.sqrt(args.d_head)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, args.heads, n, args.d_head, device=dev, dtype=dtype, generator=g)
    k = torch.randn(1, args.kv_heads, n, args.d_head, device=dev, dtype=dtype, generator=g)
    v = torch.randn(1, args.kv_heads, n, args.d_head, device=dev, dtype=dtype, generator=g)
    causal = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, n, n, device=dev)
    ordinary = create_block_mask(lambda b, h, i, j: (j <= i) & (j > 0), 1, 1, n, n, device=dev)
    # refused on CPU (compiled flex on CPU returns neither): a dry run there
    aux = AuxRequest(lse=True, max_scores=True) if dev != "cpu" else None
    group = args.heads // args.kv_heads
    rows = max(1, args.block_mb * 2**20 // (4 * args.heads * n))

    def sdpa() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def run_flex(mask=causal):  # noqa: ANN001, ANN202
        return flex(q, k, v, block_mask=mask, enable_gqa=True, return_aux=aux)

    def blocks(reduce) -> torch.Tensor:  # noqa: ANN001
        kk = k.repeat_interleave(group, 1).float()
        out = torch.empty(1, args.heads, n, device=dev)
        for s in range(0, n, rows):
            e = min(n, s + rows)
            blk = (q[:, :, s:e].float() @ kk.transpose(-1, -2)) * scale
            hidden = torch.ones(e - s, n, dtype=torch.bool, device=dev).triu(s + 1)
            out[..., s:e] = reduce(blk.masked_fill_(hidden, -math.inf))
        return out

    def scores() -> torch.Tensor:
        return blocks(lambda b: b.amax(-1))

    row: dict = {"tokens": n}
    if check:
        res = run_flex()
        o, a = res if isinstance(res, tuple) else (res, None)
        if a is not None:
            row["max_scores_err"] = float((a.max_scores.float() - scores()).abs().max())
            row["lse_err"] = float((a.lse.float() - blocks(lambda b: b.logsumexp(-1))).abs().max())
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        row["out_err"] = float((o.float() - ref.float()).abs().max())
    ways = {
        "sdpa": sdpa,
        "flex": run_flex,
        "flex-ordinary": lambda: run_flex(ordinary),
        "scores": scores,
    }
    for name, fn in ways.items():
        if dev == "cpu":
            row[name] = _time(fn)
            continue
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        row[name] = _time(fn)
        row[name + "_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,32768,65536")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d-head", type=int, default=64)
    ap.add_argument("--block-mb", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = []
    for n in (int(x) for x in args.lengths.split(",")):
        out.append(one_length(args, n, check=not out))
        print(json.dumps(out[-1]), flush=True)
    print(f"{'tokens':>7} {'sdpa s':>8} {'flex x':>7} {'+ordinary x':>11} {'scores x':>9}")
    for r in out:
        s = r["sdpa"]
        print(
            f"{r['tokens']:>7} {s:>8.4f} {r['flex'] / s:>7.2f} "
            f"{r['flex-ordinary'] / s:>11.2f} {r['scores'] / s:>9.2f}"
        )


if __name__ == "__main__":
    main()
