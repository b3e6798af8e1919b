"""Speed and memory of physically pruned models against the full model.

SmolLM2 uses grouped-query attention (9 query heads in 3 groups of 3 per layer): a KV head
can only be dropped with its whole group, so the pruned models remove 1 or 2 whole groups
per layer (33% and 67% of heads; the issue's 25/50/75% levels fall between). Prints the
forward-pass speed-up and the parameter memory saving, measured in the same run.

Usage: python benchmarks/bench_pruning.py [--model smollm2-135m] [--tokens 512]
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(model, ids: torch.Tensor, repeats: int) -> float:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        model(ids)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids)
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from headmech.models import load_hf
    from headmech.pruning import prune_heads

    hf, _ = load_hf(args.model)
    n_layers, n_heads = hf.config.num_hidden_layers, hf.config.num_attention_heads
    group = n_heads // hf.config.num_key_value_heads
    ids = torch.randint(100, 10_000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    full_t = timed(hf, ids, args.repeats)
    full_p = sum(p.numel() for p in hf.parameters())
    attn_p = sum(p.numel() for n, p in hf.named_parameters() if "self_attn" in n)
    print(
        f"{args.model}: full model {full_t * 1000:.0f} ms per {args.tokens}-token pass, {full_p / 1e6:.1f}M parameters ({attn_p / 1e6:.1f}M in attention)"
    )
    for groups in range(1, n_heads // group):
        heads = [(la, h) for la in range(n_layers) for h in range(groups * group)]
        small = prune_heads(hf, heads).eval()
        t = timed(small, ids, args.repeats)
        p = sum(q.numel() for q in small.parameters())
        print(
            f"  {len(heads) / (n_layers * n_heads):.0%} of heads removed: speed-up {full_t / t:.2f}x, "
            f"parameters -{(full_p - p) / 1e6:.1f}M ({(full_p - p) / full_p:.1%} of the model, "
            f"{(full_p - p) / attn_p:.0%} of attention), memory saving {(full_p - p) * 4 / 2**20:.0f} MB fp32"
        )


if __name__ == "__main__":
    main()
