"""Can bf16 score blocks give the row statistics exactly? (issue 62, item 2, on CPU)

The row path (:mod:`headmech.stream.rows`) spends most of its extra time in the score
blocks' fp32 ``q · kᵀ`` and the rows' maxima. One proposal: compute the scores in bf16 and
refine in fp32 only the rows whose top two scores lie within bf16's rounding, so argmax
and maxima stay exact. This script measures, on a real model's queries and keys (one
repeated-random sequence of ``T`` tokens, every layer, as the attention call hands them
over):

* ``speed``: the fp32 ``q · kᵀ`` of one layer over the bf16 one (fastest of 3, one thread);
* ``argmax wrong``: the share of rows whose bf16 argmax (over every key, and over keys
  1.., the ordinary keys after a BOS) is not the fp32 one;
* ``undecided``: the share of rows whose bf16 top-two gap is within twice a rigorous bound
  of the bf16 error, which would have to be recomputed in fp32. The bound: inputs
  rounded to bf16 (``(2u + u²) · ‖q_i‖ · max_{j<=i} ‖k_j‖``, Cauchy-Schwarz, ``u = 2^-8``)
  plus, where the product comes back in bf16 (torch's CPU matmul has no fp32 output for
  bf16 inputs), ``u · max_j |s_ij|``; ``undecided (fp32 out)`` leaves the second term out
  (a kernel that accumulates and returns fp32, as GPU GEMMs can).

Usage:
    python benchmarks/bench_bf16_scores.py [--models smollm2-135m,gemma3-270m] [--tokens 1024] \\
        [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import add_arguments, fastest, record, start

U = 2.0**-8  # bf16's unit roundoff (8 significant bits)


def _layer_shares(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> dict[str, float]:
    """Shares of rows (with at least two keys) per measure, over every key and keys 1.."""
    s = torch.matmul(q, k.transpose(-1, -2)).masked_fill_(~allowed, float("-inf"))
    sb = torch.matmul(q.bfloat16(), k.bfloat16().transpose(-1, -2)).float()
    sb.masked_fill_(~allowed, float("-inf"))
    inputs = (2 * U + U * U) * q.norm(dim=-1) * torch.cummax(k.norm(dim=-1), -1).values
    output = U * sb.abs().masked_fill(~allowed, 0.0).amax(-1)
    out: dict[str, float] = {}
    for lo, keys in ((0, "every key"), (1, "keys 1..")):
        x, xb = s[..., lo:], sb[..., lo:]
        top = xb.topk(2, -1).values
        gap = top[..., 0] - top[..., 1]
        rows = allowed[..., lo:].sum(-1) >= 2  # [heads, T] (or broadcast)
        rows = rows.expand_as(gap)
        n = rows.sum().clamp_min(1)
        wrong = (xb.argmax(-1) != x.argmax(-1)) & rows
        out[f"argmax wrong, {keys}"] = float(wrong.sum() / n)
        out[f"undecided, {keys}"] = float(((gap <= 2 * (inputs + output)) & rows).sum() / n)
        out[f"undecided (fp32 out), {keys}"] = float(((gap <= 2 * inputs) & rows).sum() / n)
    return out


def measure(name: str, tokens: int, device: str | None) -> dict:
    """The speed ratio and every layer's shares on model ``name``."""
    import headmech
    from headmech.probes import ProbeOptions, build_probe
    from headmech.stream import attention_call
    from headmech.stream.forward import run_blocks

    model = headmech.load_model(name, device=device)
    opts = ProbeOptions(n_sequences=1, half_len=(tokens - 1) // 2, batch_size=1)
    batch = build_probe("repeated_random", model, opts).batches[0]
    shares: list[dict[str, float]] = []
    speed: list[float] = []

    def on_call(layer: int, call: attention_call.LayerCall) -> None:
        q, k = call.q[0], call.k[0]  # [heads, T, d_head]
        n = q.shape[1]
        if call.mask is not None:
            allowed = call.mask[0, 0]
        else:
            allowed = torch.ones(n, k.shape[1], dtype=torch.bool, device=q.device).tril()
        shares.append(_layer_shares(q, k, allowed))
        if layer == 0:
            qb, kb = q.bfloat16(), k.bfloat16()
            full = fastest(lambda: torch.matmul(q, k.transpose(-1, -2)), 3, device)
            half = fastest(lambda: torch.matmul(qb, kb.transpose(-1, -2)), 3, device)
            speed.append(full / half)

    with attention_call.reducing(model, list(range(int(model.cfg.n_layers))), on_call):
        run_blocks(model, batch.input_ids, batch.attention_mask)
    print(f"{name}, {batch.n_tokens} tokens, {len(shares)} layers")
    print(f"  fp32 / bf16 q·kᵀ time (layer 0): {speed[0]:.2f}x")
    rows = []
    for key in shares[0]:
        values = [s[key] for s in shares]
        mean, worst = statistics.mean(values), max(values)
        print(f"  {key}: mean {mean:.4f}, worst layer {worst:.4f}")
        rows.append({"what": key, "mean": mean, "worst": worst})
    undecided = statistics.mean(s["undecided, keys 1.."] for s in shares)
    return {
        "figure": "62",
        "what": f"{name}, {batch.n_tokens} tokens: bf16 score blocks, rows an exact "
        "refinement would recompute",
        "result": f"q·kᵀ {speed[0]:.2f}x faster in bf16; {undecided:.1%} of rows undecided "
        "(keys 1..)",
        "target": "few rows undecided (else no saving)",
        "met": undecided < 0.1,
        "values": {"speedup": speed[0], "rows": rows},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, model=None)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    start(args)
    rows = [measure(m, args.tokens, args.device) for m in args.models.split(",")]
    record("bench_bf16_scores", args.device, rows)


if __name__ == "__main__":
    main()
