"""Exact all-head zero ablation, side by side: headmech, nnsight, TransformerLens, a plain loop.

Every peer computes the same numbers on the same probe: the induction task's loss (the
repeated half of random-token sequences, 32 sequences x 65 tokens by default) with one
head's output zeroed, for every head (or the heads of ``--layers``). The peers:

* ``headmech`` — ``importance(model, "zero", "induction")``: the clean pass records each
  block's input, each chunk of ablations runs only the blocks from its layer on, as copies
  along the batch axis (on the CPU as many as keep each activation small: one copy of
  16 x 65 tokens), attention as fused SDPA (no pattern is read), the last block's MLP and
  the loss (in vocabulary tiles) only at the scored positions;
* ``headmech-full`` — the same runner with the prefix reuse and SDPA switched off (what
  headmech did before: every ablation a whole forward, eager attention);
* ``loop`` — a hand-written loop over plain Hugging Face forwards (SDPA attention), a
  forward pre-hook on ``o_proj`` zeroing the head's input columns, full logits;
* ``nnsight`` — nnsight 0.8's idiom, one ``model.trace`` per head setting the head's slice
  of ``o_proj``'s input to zero; ``nnsight-invokes`` — 8 invokes (heads) per trace;
* ``tl`` — TransformerLens' ``get_act_patch_attn_head_out_all_pos`` on the bridge,
  patching ``hook_z`` from a cache of zeros (one ``run_with_hooks`` per head).

Agreement with headmech: max |difference| of the 270 ablated losses and the overlap of the
top 10 heads. Time ratios are to the fastest nnsight idiom and to the plain loop.

The floor (:func:`floor_seconds`): what exact single-head ablation must still run — one
clean pass, and per head in layer ``l`` the blocks ``l..L-1`` plus the loss at the scored
positions — timed from one clean pass's blocks and loss. ``headmech / floor`` says what
the runner adds to it; ``floor / peer`` is the best ratio any exact method can reach.

nnsight is an optional benchmark dependency: ``pip install -e ".[bench]"``.

Usage: python benchmarks/bench_peers.py [--layers all|0,5,10] [--peers headmech,loop,...]
    [--n-sequences 32] [--half-len 32] [--threads N] [--device cpu]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from common import add_arguments, clock, record, start

PEERS = ("headmech", "headmech-full", "loop", "nnsight", "nnsight-invokes", "tl")


def _select(task: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    query, target = task.select(batch)
    return query, target


def _loss_from_logits(
    logits: torch.Tensor, query: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Sum of the induction loss over the selected positions (the task's units)."""
    return F.cross_entropy(logits[query].float(), target[query], reduction="sum")


def run_headmech(model: Any, task: Any, batches: list, heads: list, fast: bool) -> torch.Tensor:
    from headmech.interventions import run_variants
    from headmech.interventions.ablation import ablation_variants

    variants = ablation_variants(model, batches, [[h] for h in heads], "zero")
    values, _ = run_variants(model, task, batches, variants, reuse_prefix=fast, fast=fast)
    return values


def run_loop(hf: Any, task: Any, batches: list, heads: list, d_head: int) -> torch.Tensor:
    """Plain forwards, one per head and batch, a pre-hook zeroing the head's o_proj input."""
    out = torch.zeros(len(heads), dtype=torch.float64)
    n = 0
    with torch.inference_mode():
        for batch in batches:
            query, target = _select(task, batch)
            n += int(query.sum())
            for i, (layer, head) in enumerate(heads):
                sl = slice(head * d_head, (head + 1) * d_head)

                def zero(module: Any, args: Any, sl: slice = sl) -> Any:
                    x = args[0].clone()
                    x[..., sl] = 0
                    return (x, *args[1:])

                o_proj = hf.model.layers[layer].self_attn.o_proj
                handle = o_proj.register_forward_pre_hook(zero)
                try:
                    logits = hf(batch.input_ids, attention_mask=batch.attention_mask).logits
                finally:
                    handle.remove()
                out[i] += float(_loss_from_logits(logits, query, target))
    return (out / n).float()


def run_nnsight(
    lm: Any, task: Any, batches: list, heads: list, d_head: int, invokes: int
) -> torch.Tensor:
    """nnsight 0.8 (``LanguageModel`` around the same Hugging Face model): one trace per
    head (``invokes=1``) or ``invokes`` heads per trace, batched by nnsight."""
    out = torch.zeros(len(heads), dtype=torch.float64)
    n = 0
    for batch in batches:
        query, target = _select(task, batch)
        n += int(query.sum())
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        for g in range(0, len(heads), invokes):
            group = heads[g : g + invokes]
            with torch.inference_mode(), lm.trace() as tracer:
                saved = list().save()
                for layer, head in group:
                    with tracer.invoke(inputs):
                        o_proj = lm.model.layers[layer].self_attn.o_proj
                        o_proj.input[..., head * d_head : (head + 1) * d_head] = 0
                        saved.append(lm.output.logits)
            for i, logits in enumerate(saved):
                out[g + i] += float(_loss_from_logits(logits, query, target))
    return (out / n).float()


def run_tl(model: Any, task: Any, batches: list, heads: list) -> torch.Tensor:
    """TransformerLens' patching utility (``generic_activation_patch`` with
    ``layer_head_vector_patch_setter``, what ``get_act_patch_attn_head_out_all_pos`` runs,
    restricted to ``heads``), patching ``hook_z`` from a cache of zeros: zero ablation,
    one ``run_with_hooks`` per head."""
    import pandas as pd
    from transformer_lens import ActivationCache
    from transformer_lens.patching import generic_activation_patch, layer_head_vector_patch_setter

    index = pd.DataFrame(heads, columns=["layer", "head"])
    total = torch.zeros(len(heads), dtype=torch.float64)
    n = 0
    for batch in batches:
        assert bool(batch.attention_mask.all()), "TransformerLens' patching takes no mask"
        query, target = _select(task, batch)
        n += int(query.sum())
        with torch.inference_mode():
            _, cache = model.run_with_cache(
                batch.input_ids, names_filter=lambda name: name.endswith("hook_z")
            )
        zeros = ActivationCache({k: torch.zeros_like(v) for k, v in cache.items()}, model)

        def metric(
            logits: torch.Tensor, query: torch.Tensor = query, target: torch.Tensor = target
        ) -> torch.Tensor:
            return _loss_from_logits(logits, query, target)

        with torch.inference_mode():
            out = generic_activation_patch(
                model, batch.input_ids, zeros, metric, layer_head_vector_patch_setter, "z",
                index_df=index,
            )  # fmt: skip
        total += out.double().cpu().flatten()
    return (total / n).float()


def floor_seconds(model: Any, task: Any, batches: list, heads: list, device: Any) -> dict:
    """The cost floor of exact single-head ablation, from two timings per batch: the
    blocks of one clean pass and the loss at the scored positions. The floor is the clean
    pass plus, per head in layer ``l``, the last ``L - l`` blocks and the loss (what prefix
    reuse must still run); its ratio to a peer is the best any exact method can do."""
    from common import fastest

    from headmech.stream.forward import fast_attention, run_blocks
    from headmech.tasks import token_losses

    n_layers = int(model.cfg.n_layers)
    suffix = sum((n_layers - layer) / n_layers for layer, _ in heads)
    blocks = loss = 0.0
    for batch in batches:
        query, target = task.select(batch)
        with fast_attention(model):
            blocks += fastest(lambda b=batch: run_blocks(model, b.input_ids, b.attention_mask), 3, device)  # fmt: skip
            with torch.inference_mode():
                resid = run_blocks(model, batch.input_ids, batch.attention_mask)[query]
        loss += fastest(lambda r=resid, t=target[query]: token_losses(model, r, t), 3, device)
    return {
        "blocks_s": blocks,
        "loss_s": loss,
        "floor_s": (blocks + loss) * 1 + blocks * suffix + loss * len(heads),
        "suffix_fraction": suffix / len(heads),
    }


def _agreement(a: torch.Tensor, b: torch.Tensor, k: int = 10) -> tuple[float, int]:
    top_a = set(a.topk(min(k, a.numel())).indices.tolist())
    top_b = set(b.topk(min(k, b.numel())).indices.tolist())
    return float((a - b).abs().max()), len(top_a & top_b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument(
        "--layers",
        default="2,7,12,17,22,27",
        help="layers whose heads are ablated: all, or a list (default: every 5th layer from 2, "
        "54 of SmolLM2's 270 heads, whose mean number of blocks after them equals all layers')",
    )
    ap.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma-separated, from {', '.join(PEERS)}"
    )
    ap.add_argument("--n-sequences", type=int, default=32)
    ap.add_argument("--half-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    start(args)

    import headmech
    from headmech.models import load_hf
    from headmech.probes import ProbeOptions
    from headmech.tasks import get_task

    model = headmech.load_model(args.model, device=args.device)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    layers = range(n_layers) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    heads = [(la, h) for la in layers for h in range(n_heads)]
    task = get_task("induction", model)
    opts = ProbeOptions(
        n_sequences=args.n_sequences, half_len=args.half_len, batch_size=args.batch_size
    )
    batches = [b.to(args.device or "cpu") for b in task.batches(model, opts)]
    hf, tokenizer = load_hf(args.model)  # a plain Hugging Face copy for the loop and nnsight
    hf.config._attn_implementation = "sdpa"
    hf = hf.to(args.device or "cpu")
    lm = None
    if any(p.startswith("nnsight") for p in args.peers.split(",")):
        from nnsight import LanguageModel

        lm = LanguageModel(hf, tokenizer=tokenizer)
    d_head = int(model.cfg.d_head)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "headmech": lambda: run_headmech(model, task, batches, heads, True),
        "headmech-full": lambda: run_headmech(model, task, batches, heads, False),
        "loop": lambda: run_loop(hf, task, batches, heads, d_head),
        "nnsight": lambda: run_nnsight(lm, task, batches, heads, d_head, 1),
        "nnsight-invokes": lambda: run_nnsight(lm, task, batches, heads, d_head, 8),
        "tl": lambda: run_tl(model, task, batches, heads),
    }
    seconds, values = {}, {}
    floor = floor_seconds(model, task, batches, heads, args.device)
    print(
        f"floor: {floor['floor_s']:.1f}s (blocks {floor['blocks_s']:.2f}s + loss "
        f"{floor['loss_s']:.2f}s per probe pass; suffixes {floor['suffix_fraction']:.3f} of "
        "the blocks on average)",
        flush=True,
    )
    for peer in args.peers.split(","):
        t0 = clock(args.device)
        values[peer] = runs[peer]()
        seconds[peer] = clock(args.device) - t0
        print(f"{peer}: {seconds[peer]:.1f}s", flush=True)
    report(args, seconds, values, len(heads), [b.input_ids.shape for b in batches], floor)


def report(
    args: argparse.Namespace,
    seconds: dict,
    values: dict,
    n_heads: int,
    shapes: list,
    floor: dict,
) -> None:
    ref = values.get("headmech")
    nn_best = min(
        (seconds[p] for p in ("nnsight", "nnsight-invokes") if p in seconds), default=None
    )
    what = f"{args.model}, induction task, {n_heads} heads zero-ablated one at a time, batches {[tuple(s) for s in shapes]}"
    print(
        f"\n{what}\n{'peer':16s} {'seconds':>9s} {'/ headmech':>11s} {'max |diff|':>11s} {'top-10':>7s}"
    )
    rows = []
    for peer, s in seconds.items():
        diff, top = _agreement(values[peer], ref) if ref is not None else (float("nan"), 0)
        ratio = s / seconds["headmech"] if "headmech" in seconds else float("nan")
        print(f"{peer:16s} {s:9.1f} {ratio:11.2f} {diff:11.1e} {top:7d}")
        rows.append(
            {"peer": peer, "seconds": round(s, 2), "max_abs_diff": diff, "top10_overlap": top}
        )
    out = []
    if "headmech" in seconds:
        h = seconds["headmech"]
        for peer, target in (
            ("nnsight-best", 0.5),
            ("loop", 0.5),
            ("tl", 0.4),
            ("headmech-full", None),
        ):
            base = nn_best if peer == "nnsight-best" else seconds.get(peer)
            if base is None:
                continue
            ratio = h / base
            met = None if target is None else ratio <= target
            tgt = "" if target is None else f"<= {target}"
            out.append(
                {
                    "figure": f"peers: headmech / {peer}",
                    "what": what,
                    "result": f"{ratio:.2f}x time",
                    "target": tgt,
                    "met": met,
                    "values": {"headmech_s": h, f"{peer}_s": base},
                }
            )
            print(
                f"headmech / {peer}: {ratio:.2f}x time"
                + (f" (target {tgt}: {'met' if met else 'NOT met'})" if target else "")
            )
    f = floor["floor_s"]
    floor_row = {"figure": "peers: the floor (clean pass + suffix passes)", "what": what,
                 "result": f"{f:.1f} s", "target": "", "met": None, "values": dict(floor)}  # fmt: skip
    if "headmech" in seconds:
        floor_row["result"] = f"headmech {seconds['headmech'] / f:.2f}x its floor ({f:.1f} s)"
        print(floor_row["result"])
    for peer in ("loop", "tl", "nnsight", "nnsight-invokes"):
        if peer in seconds:
            print(f"floor / {peer}: {f / seconds[peer]:.2f}x (the best an exact method can do)")
            floor_row["values"][f"floor_over_{peer}"] = f / seconds[peer]
    out.append(floor_row)
    figure(seconds, args, f)
    record(
        "bench_peers",
        args.device,
        out
        + [
            {
                "figure": "peers table",
                "what": what,
                "result": "",
                "target": "",
                "met": None,
                "values": {"rows": rows},
            }
        ],
    )


def figure(seconds: dict, args: argparse.Namespace, floor: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(seconds)
    sns.barplot(x=[seconds[n] for n in names], y=names, ax=ax, orient="h", color="tab:blue")
    if floor is not None:
        ax.axvline(floor, color="k", ls="--", lw=1, label="floor: clean + suffix passes")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("seconds (all-head zero ablation, lower is better)")
    ax.set_title(f"{args.model}: exact interventions, {time.strftime('%Y-%m-%d')}")
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("peers.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
