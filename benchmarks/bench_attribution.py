"""Cost of head attribution in forward-pass equivalents, and patching against TransformerLens.

Figure 4. The unit is one plain forward pass of the model (logits included) over the same
probe batch, timed in the same run. Each method's wall time, divided by that unit, is
printed next to the passes headmech counts for it (a backward pass counts as two):

* ``mask_gradient`` (Michel et al. 2019) and ``lrp`` (AttnLRP): one forward and one
  backward pass for all heads. Target: at most 3 forward-pass equivalents.
* ``patching`` (activation patching of every head's output): n_heads + 1 patched runs,
  batched as copies of the batch along the batch dimension (8 runs per forward call), plus
  the pass that captures the source activations; against TransformerLens'
  ``patching.get_act_patch_attn_head_out_all_pos`` (``generic_activation_patch`` with
  ``hook_z``: one ``run_with_hooks`` per head after one ``run_with_cache``), which runs on
  the ``TransformerBridge`` as it is. Both patch clean head outputs into the corrupted run
  (denoising) and measure the task's loss, so their values must agree.

Model: smollm2-135m (30 layers x 9 heads), induction task (BOS + 16 random tokens + the
same 16 again; loss on the repeated half), one batch of 2 sequences, so that TransformerLens'
270 passes take a minute or two on a CPU. The machine may be shared: forward passes are
timed between the methods and every figure takes the fastest of its runs.

Usage: python benchmarks/bench_attribution.py [--model smollm2-135m] [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens' per-head progress bar

import torch
import torch.nn.functional as F
from common import add_arguments, clock, fastest, record, start


def forward_seconds(model, batch, device, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Fastest of ``repeats`` plain forward passes (logits) over ``batch``."""
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    return fastest(lambda: model(ids, attention_mask=mask), repeats, device)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--n-sequences", type=int, default=2)
    ap.add_argument("--half-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    start(args)
    from transformer_lens import patching

    import headmech
    from headmech.attribution import importance
    from headmech.probes import ProbeOptions
    from headmech.tasks import get_task

    device = args.device or "cpu"
    model = headmech.load_model(args.model, device=args.device)
    n_heads = int(model.cfg.n_layers) * int(model.cfg.n_heads)
    task = get_task("induction", model)
    options = ProbeOptions(
        n_sequences=args.n_sequences, half_len=args.half_len, batch_size=args.n_sequences
    )
    batches = task.batches(model, options)
    (batch,) = batches
    assert bool(batch.attention_mask.all()), "TransformerLens' runs take no attention mask"
    shape = "x".join(str(s) for s in batch.input_ids.shape)
    # the machine is shared: forward passes are timed between the methods, and each figure
    # uses the fastest of its runs
    fwd_runs = [forward_seconds(model, batch, device, args.repeats)]
    rows = []
    for method, opts, repeats in (
        ("mask_gradient", {}, args.repeats),
        ("lrp", {}, args.repeats),
        ("patching", {"direction": "denoising"}, 1),
    ):
        runs = []
        for _ in range(repeats):
            runs.append(importance(model, method, task, batches=batches, **opts))
            fwd_runs.append(forward_seconds(model, batch, device, 1))
        rows.append((method, min(runs, key=lambda r: r.seconds)))
    ours = rows[-1][1]

    # TransformerLens: the same denoising patch, the task's loss as its metric
    clean = batch.to(device)
    corrupt = task.corrupt(batch, model, 0).to(device)  # the corruption importance() used
    query, target = task.select(clean)  # type: ignore[attr-defined]

    def induction_loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[query].float(), target[query])

    t0 = clock(device)
    _, cache = model.run_with_cache(clean.input_ids)
    tl_values = patching.get_act_patch_attn_head_out_all_pos(
        model, corrupt.input_ids, cache, induction_loss
    )
    tl = clock(device) - t0
    del cache
    fwd_runs.append(forward_seconds(model, batch, device, 1))
    fwd = min(fwd_runs)
    # headmech's denoising score is loss(corrupted) - loss(corrupted, head patched)
    assert ours.metric_clean is not None
    diff = float(((ours.metric_clean - ours.score) - tl_values.float().cpu()).abs().max())

    what = f"{args.model}, induction task, batch {shape} tokens"
    print(f"{what}: forward pass {fwd * 1000:.0f} ms (the unit below)")
    out = []
    for method, r in rows:
        ratio = r.seconds / fwd
        gradient = method != "patching"
        target = "<= 3" if gradient else ""
        print(
            f"  {method}: {r.seconds:.2f}s = {ratio:.1f} forward passes "
            f"(headmech counts {r.forward_equivalents:.0f}{'; target <= 3' if gradient else ''})"
        )
        out.append(
            {
                "figure": "4",
                "what": f"{method} for all {n_heads} heads / one forward pass ({what})",
                "result": f"{ratio:.1f} forward passes ({r.seconds:.2f} s vs {fwd * 1000:.0f} ms); "
                f"{r.forward_equivalents:.0f} counted",
                "target": target,
                "met": ratio <= 3 if gradient else None,
                "values": {"seconds": r.seconds, "forward_s": fwd, "ratio": ratio},
            }
        )
    print(
        f"  TransformerLens get_act_patch_attn_head_out_all_pos: {tl:.2f}s = {tl / fwd:.1f} "
        f"forward passes; headmech patching {tl / ours.seconds:.1f}x faster; "
        f"max |difference| of the patched losses = {diff:.1e} (losses around {ours.metric_clean:.2f})"
    )
    out.append(
        {
            "figure": "4",
            "what": f"activation patching of all {n_heads} heads, headmech (batched) vs "
            f"TransformerLens get_act_patch_attn_head_out_all_pos on the bridge ({what})",
            "result": f"{tl / ours.seconds:.1f}x faster ({ours.seconds:.1f} s vs {tl:.1f} s = "
            f"{tl / fwd:.0f} forward passes); max difference {diff:.1e}",
            "target": "values equal within 1e-4",
            "met": diff <= 1e-4,
            "values": {"headmech_s": ours.seconds, "tl_s": tl, "forward_s": fwd, "max_diff": diff},
        }
    )
    record("bench_attribution", args.device, out)


if __name__ == "__main__":
    main()
