"""Classification cost against bare forward passes, and against TransformerLens' detector.

Figure 1: ``classify`` with every catalog type on a model, against bare forward passes over
exactly the same token batches (the probes built once; the same blocks run; no hooks).
Target: at most 1.3x.

Figure 2: previous-token, duplicate-token and induction scores of every head on the same
prompts, headmech (one batched streaming pass for all three) against
``transformer_lens.head_detector.detect_head`` (one call per type and prompt, as users
call it). Target: at least 5x faster, scores equal within 1e-5 on TL's definition (every
query row, "mul" error measure). Prompts all have the same token length, so TL's mean of
per-prompt scores equals headmech's token-weighted mean.

Usage: python benchmarks/bench_classify.py [--model smollm2-135m] [--device cpu] [--threads N] [--n-prompts 16]
"""

from __future__ import annotations

import argparse

import torch
from common import add_arguments, clock, record, start


def figure_1(model, device) -> dict:  # type: ignore[no-untyped-def]
    import headmech
    from headmech.headtypes.registry import collect_statistics, resolve_types
    from headmech.models import model_info
    from headmech.probes import ProbeOptions, build_probe
    from headmech.stream.engine import bare_forward

    info = model_info(model)
    types = [t for t in resolve_types(None) if t.check_model(info) is None]
    options = ProbeOptions(n_sentences=128, n_sequences=16, half_len=32, needle_lengths=(300, 600))
    groups: dict[str, list] = {}
    for t in types:
        groups.setdefault(t.probe, []).append(t)
    probes = {name: build_probe(name, model, options) for name in groups}
    batches = [b for p in probes.values() for b in p.batches]
    bare_forward(model, batches[:1])  # warm-up
    t0 = clock(device)
    bare_forward(model, batches)
    bare = clock(device) - t0
    t0 = clock(device)
    for name, group in groups.items():
        collect_statistics(group, model, probes[name].batches)
    engine = clock(device) - t0
    n_tok = sum(p.n_tokens for p in probes.values())
    ratio = engine / bare
    print(
        f"figure 1: {len(types)} types on {len(probes)} probes ({n_tok} tokens, {len(batches)} batches): "
        f"bare {bare:.2f}s, classify streaming {engine:.2f}s, ratio = {ratio:.2f} (target <= 1.3)"
    )
    del headmech
    return {
        "figure": "1",
        "what": f"classify with all {len(types)} types / bare forward passes over the same batches "
        f"({info.name}, {n_tok} tokens on {len(probes)} shared probes)",
        "result": f"{ratio:.2f}x ({engine:.1f} s vs {bare:.1f} s)",
        "target": "<= 1.3",
        "met": ratio <= 1.3,
        "values": {"classify_s": engine, "bare_s": bare},
    }


def tl_targets(kind: str):  # type: ignore[no-untyped-def]
    """TransformerLens' detection patterns as per-query target sets (Bool[batch, q, k])."""

    def fn(batch):  # type: ignore[no-untyped-def]
        ids = batch.input_ids
        n = ids.shape[1]
        if kind == "previous_token_head":
            return torch.ones(n, n, dtype=torch.bool).tril(-1).triu(-1).expand(ids.shape[0], n, n)
        dup = (ids[:, :, None] == ids[:, None, :]) & torch.ones(n, n, dtype=torch.bool).tril(-1)
        if kind == "duplicate_token_head":
            return dup
        shifted = torch.zeros_like(dup)  # induction: the duplicate pattern one column right
        shifted[:, :, 1:] = dup[:, :, :-1]
        return shifted

    return fn


def figure_2(model, n_prompts: int, seq_len: int, device) -> dict:  # type: ignore[no-untyped-def]
    from transformer_lens.head_detector import detect_head

    from headmech.probes import batch_sequences, random_token_ids
    from headmech.stream.engine import stream_statistics, target_reducer

    tok = model.tokenizer
    g = torch.Generator().manual_seed(0)
    prompts: list[str] = []
    tokens: list[list[int]] = []
    while len(prompts) < n_prompts:  # random-token prompts whose re-tokenisation is stable
        half = random_token_ids(tok, g, (seq_len // 2,)).tolist()
        text = tok.decode(half + half)
        ids = model.to_tokens(text)[0].tolist()
        if len(ids) == (tokens[0].__len__() if tokens else len(ids)):
            prompts.append(text)
            tokens.append(ids)
    kinds = ["previous_token_head", "duplicate_token_head", "induction_head"]
    t0 = clock(device)
    want = {k: torch.stack([detect_head(model, p, k) for p in prompts]).mean(0) for k in kinds}
    tl = clock(device) - t0
    batches = batch_sequences(tokens, tok, batch_size=16)
    t0 = clock(device)
    stats = stream_statistics(model, batches, [target_reducer(k, tl_targets(k)) for k in kinds])
    ours = clock(device) - t0
    err = max(float((stats.mean(f"{k}.rows") - want[k].float().cpu()).abs().max()) for k in kinds)
    print(
        f"figure 2: 3 detector scores, {n_prompts} prompts of {len(tokens[0])} tokens: TL detect_head {tl:.2f}s, "
        f"headmech {ours:.2f}s, speed-up = {tl / ours:.1f}x (target >= 5), max |difference| = {err:.1e} (target 1e-5)"
    )
    return {
        "figure": "2",
        "what": "previous-token, duplicate-token and induction scores of all heads vs "
        f"TransformerLens detect_head, one call per type and prompt ({n_prompts} prompts of "
        f"{len(tokens[0])} tokens)",
        "result": f"{tl / ours:.1f}x faster ({ours:.1f} s vs {tl:.1f} s), max difference {err:.1e}",
        "target": ">= 5x, within 1e-5",
        "met": tl / ours >= 5 and err <= 1e-5,
        "values": {"headmech_s": ours, "tl_s": tl, "max_diff": err},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    start(args)
    import headmech

    model = headmech.load_model(args.model, device=args.device)
    rows = [
        figure_1(model, args.device),
        figure_2(model, args.n_prompts, args.seq_len, args.device),
    ]
    record("bench_classify", args.device, rows)


if __name__ == "__main__":
    main()
