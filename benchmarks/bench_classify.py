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

Usage: python benchmarks/bench_classify.py [--model smollm2-135m] [--device cpu] [--n-prompts 16]
"""

from __future__ import annotations

import argparse
import time

import torch


def figure_1(model, device) -> None:  # type: ignore[no-untyped-def]
    import headmech
    from headmech.engine import bare_forward
    from headmech.heads import collect_statistics, resolve_types
    from headmech.models import model_info
    from headmech.probes import ProbeOptions, build_probe

    info = model_info(model)
    types = [t for t in resolve_types(None) if t.check_model(info) is None]
    options = ProbeOptions(n_sentences=128, n_sequences=16, half_len=32, needle_lengths=(300, 600))
    groups: dict[str, list] = {}
    for t in types:
        groups.setdefault(t.probe, []).append(t)
    probes = {name: build_probe(name, model, options) for name in groups}
    batches = [b for p in probes.values() for b in p.batches]
    bare_forward(model, batches[:1])  # warm-up
    t0 = time.perf_counter()
    bare_forward(model, batches)
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name, group in groups.items():
        collect_statistics(group, model, probes[name].batches)
    engine = time.perf_counter() - t0
    n_tok = sum(p.n_tokens for p in probes.values())
    print(
        f"figure 1: {len(types)} types on {len(probes)} probes ({n_tok} tokens, {len(batches)} batches): "
        f"bare {bare:.2f}s, classify streaming {engine:.2f}s, ratio = {engine / bare:.2f} (target <= 1.3)"
    )
    del headmech


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


def figure_2(model, n_prompts: int, seq_len: int) -> None:  # type: ignore[no-untyped-def]
    from transformer_lens.head_detector import detect_head

    from headmech.engine import stream_statistics, target_reducer
    from headmech.probes import batch_sequences, random_token_ids

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
    t0 = time.perf_counter()
    want = {k: torch.stack([detect_head(model, p, k) for p in prompts]).mean(0) for k in kinds}
    tl = time.perf_counter() - t0
    batches = batch_sequences(tokens, tok, batch_size=16)
    t0 = time.perf_counter()
    stats = stream_statistics(model, batches, [target_reducer(k, tl_targets(k)) for k in kinds])
    ours = time.perf_counter() - t0
    err = max(float((stats.mean(f"{k}.rows") - want[k].float()).abs().max()) for k in kinds)
    print(
        f"figure 2: 3 detector scores, {n_prompts} prompts of {len(tokens[0])} tokens: TL detect_head {tl:.2f}s, "
        f"headmech {ours:.2f}s, speed-up = {tl / ours:.1f}x (target >= 5), max |difference| = {err:.1e} (target 1e-5)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None)
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    import headmech

    model = headmech.load_model(args.model, device=args.device)
    figure_1(model, args.device)
    figure_2(model, args.n_prompts, args.seq_len)


if __name__ == "__main__":
    main()
