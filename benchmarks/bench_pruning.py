"""Speed and memory of physically pruned models against the full model.

Figure 5, at 25%, 50% and 75% of the heads removed. SmolLM2 uses grouped-query attention
(9 query heads in 3 groups of 3 per layer): a KV head can only be dropped with its whole
group, so the levels are counts of whole KV groups out of 90 (the nearest to each level:
the exact fraction is printed), spread over the layers as evenly as they go.

:func:`headmech.pruning.prune_heads` keeps the same number of heads in every layer (a
Hugging Face config has one global head count): on its own it reaches only 33% and 67%.
For the other levels each layer's attention is taken from a ``prune_heads`` model with
that layer's number of groups removed (the attention modules infer their head count from
the weights, so mixed layers run; such a model lives in memory only: its config cannot
describe it), and a layer with every group removed has no attention at all (its output is
zero, as zero-ablating all its heads gives, ``o_proj`` having no bias). Its logits are
checked against the masked model (``prune_heads`` zeroing the same heads in place).

Prints the forward-pass speed-up and the parameter memory saving, measured in the same
run.

Usage: python benchmarks/bench_pruning.py [--model smollm2-135m] [--tokens 512] [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from common import add_arguments, fastest, record, start
from torch import nn


class NoAttention(nn.Module):
    """A self-attention with every head removed: adds ``o_proj``'s bias (none in LLaMA)."""

    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, None]:
        if self.bias is None:
            return hidden_states.new_zeros(()), None
        return self.bias.expand_as(hidden_states), None


def prune_groups(hf, groups: list[int]) -> nn.Module:  # type: ignore[no-untyped-def]
    """A copy of ``hf`` without the first ``groups[layer]`` KV groups of each layer."""
    from headmech.pruning import prune_heads

    cfg = hf.config
    n_kv = int(cfg.num_key_value_heads)
    size = int(cfg.num_attention_heads) // n_kv
    out = prune_heads(hf, []).eval()
    for g in sorted(set(groups) - {0, n_kv}):
        heads = [(la, h) for la in range(len(groups)) for h in range(g * size)]
        donor = prune_heads(hf, heads)
        for la in (la for la, n in enumerate(groups) if n == g):
            out.model.layers[la].self_attn = donor.model.layers[la].self_attn
    for la in (la for la, n in enumerate(groups) if n == n_kv):
        out.model.layers[la].self_attn = NoAttention(out.model.layers[la].self_attn.o_proj.bias)
    return out


def spread(n_groups: int, n_layers: int) -> list[int]:
    """``n_groups`` removals over ``n_layers`` layers, differing by at most one per layer."""
    return [n_groups // n_layers + (la < n_groups % n_layers) for la in range(n_layers)]


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--levels", default="0.25,0.5,0.75")
    args = ap.parse_args()
    start(args)
    from headmech.models import load_hf
    from headmech.pruning import prune_heads

    device = args.device or "cpu"
    hf, _ = load_hf(args.model)
    hf = hf.to(device).eval()
    cfg = hf.config
    n_layers, n_heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    n_kv = int(cfg.num_key_value_heads)
    size = n_heads // n_kv
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 10_000, (1, args.tokens), generator=g).to(device)
    full_p = sum(p.numel() for p in hf.parameters())
    attn_p = sum(p.numel() for n, p in hf.named_parameters() if "self_attn" in n)
    itemsize = next(hf.parameters()).element_size()
    full_runs = [fastest(partial(hf, ids, use_cache=False), args.repeats, device)]
    results = []
    for level in (float(x) for x in args.levels.split(",")):
        n_groups = round(level * n_layers * n_kv)
        groups = spread(n_groups, n_layers)
        small = prune_groups(hf, groups)
        heads = [(la, h) for la, n in enumerate(groups) for h in range(n * size)]
        with torch.inference_mode():
            masked = prune_heads(hf, heads).eval()  # the same heads zeroed in place
            logits = masked(ids, use_cache=False).logits
            err = float((small(ids, use_cache=False).logits - logits).abs().max())
            effect = float((hf(ids, use_cache=False).logits - logits).abs().max())
        del masked, logits
        # the machine may be shared: the full model is timed again next to each pruned one
        full_runs.append(fastest(partial(hf, ids, use_cache=False), args.repeats, device))
        t = fastest(partial(small, ids, use_cache=False), args.repeats, device)
        saved = full_p - sum(q.numel() for q in small.parameters())
        results.append((n_groups, groups, len(heads), t, saved, err, effect))
        del small
    full_t = min(full_runs)
    print(
        f"{args.model}: full model {full_t * 1000:.0f} ms per {args.tokens}-token pass, "
        f"{full_p / 1e6:.1f}M parameters ({attn_p / 1e6:.1f}M in attention), "
        f"{n_layers} layers x {n_kv} KV groups of {size} heads"
    )
    rows = []
    for n_groups, groups, n_removed, t, saved, err, effect in results:
        frac = n_removed / (n_layers * n_heads)
        mb = saved * itemsize / 2**20
        layout = ", ".join(f"{groups.count(k)} layers -{k}" for k in sorted(set(groups)) if k)
        print(
            f"  {frac:.1%} of heads removed ({n_groups} of {n_layers * n_kv} KV groups; {layout}): "
            f"speed-up {full_t / t:.2f}x, parameters -{saved / 1e6:.1f}M ({saved / full_p:.1%} "
            f"of the model, {saved / attn_p:.0%} of attention), memory saving {mb:.0f} MB; "
            f"max |logit - masked model's| = {err:.1e} (masking moves the logits by up to {effect:.1f})"
        )
        rows.append(
            {
                "figure": "5",
                "what": f"{args.model} with {frac:.1%} of heads physically removed "
                f"({n_groups}/{n_layers * n_kv} KV groups) / full model, {args.tokens}-token forward pass",
                "result": f"{full_t / t:.2f}x faster, {saved / 1e6:.1f}M fewer parameters "
                f"({mb:.0f} MB, {saved / full_p:.1%} of the model); max logit difference from "
                f"the masked model {err:.1e}",
                "target": "",
                "met": None,
                "values": {
                    "fraction": frac,
                    "speedup": full_t / t,
                    "params_saved": saved,
                    "max_logit_diff": err,
                },
            }
        )
    record("bench_pruning", args.device, rows)


if __name__ == "__main__":
    main()
