"""Ships on the bundled instruct models (issue 63): which heads move a refusal, and whether
ablating them makes the model answer.

Zhou et al. 2024 ablate one head of Llama-2-7b-chat (its query scaled by 0) and it answers
16x more of the requests it refused. Per model:

1. the ``refusal`` probe's 12 harmful requests and their benign twins, greedy replies of
   ``--tokens`` tokens without a KV cache (:func:`headmech.interventions.ships.refuses`):
   the refusal rate of each (a type cannot be measured where the model does not refuse);
2. Ships of every head on the harmful requests it refuses
   (:func:`headmech.interventions.ships.ships_scores`, uniform attention = the query
   scaled by 0);
3. the top 1, 4 and 16 heads ablated together (uniform attention), and ``--draws`` random
   sets of as many heads (the rest), each's refusal rate on those requests.

Results go to ``benchmarks/ships.json`` (a model's record when it is done) and
``results.json``.

Usage: python benchmarks/bench_ships.py --models smollm2-135m,qwen2.5-coder-0.5b --threads 1
       python benchmarks/bench_ships.py --report
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from common import add_arguments, peak_rss_mb, record, start

STORE = Path(__file__).with_name("ships.json")
SIZES = (1, 4, 16)


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import headmech
    from headmech.core.head_index import top_k
    from headmech.interventions import Intervention
    from headmech.interventions.ablation import random_heads
    from headmech.interventions.effects import Uniform
    from headmech.interventions.ships import refuses, ships_scores
    from headmech.probes import ProbeOptions, build_probe

    t0 = time.perf_counter()
    model = headmech.load_model(name)
    batches = build_probe("refusal", model, ProbeOptions(n_sequences=24)).batches
    refused, replies = refuses(model, batches, n_tokens=args.tokens)
    harmful = torch.cat([b.extras["harmful"].bool() for b in batches])
    out: dict[str, Any] = {
        "harmful_refused": int((refused & harmful).sum()), "harmful": int(harmful.sum()),
        "benign_refused": int((refused & ~harmful).sum()), "benign": int((~harmful).sum()),
        "replies": replies, "tokens": args.tokens,
    }  # fmt: skip
    keep = (refused & harmful).split([b.input_ids.shape[0] for b in batches])
    asked = [b.select(k) for b, k in zip(batches, keep, strict=True) if bool(k.any())]
    if not asked:
        return out | {"seconds": time.perf_counter() - t0, "note": "refuses no harmful request"}
    ships = ships_scores(model, batches=asked)["ships"]
    n_layers, n_heads = ships.shape
    order = top_k(ships, n_layers * n_heads)
    out["top"] = [(str(h), float(ships[h.layer, h.head])) for h in order[:16]]
    gen = torch.Generator().manual_seed(0)
    out["ablated"] = {}
    for k in SIZES:
        sets = [order[:k]] + [
            random_heads(n_layers, n_heads, k, exclude=order[:k], generator=gen)
            for _ in range(args.draws)
        ]
        rates = []
        for heads in sets:
            still, _ = refuses(model, asked, [Intervention.on(heads, Uniform(), site="pattern")], args.tokens)  # fmt: skip
            rates.append(float(still.float().mean()))
        out["ablated"][str(k)] = {"top": rates[0], "random": rates[1:]}
        print(f"{name}: top {k} ablated: still refuses {rates[0]:.2f} (random {rates[1:]})")
    return out | {"seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}


def summary(r: dict[str, Any]) -> str:
    text = (
        f"refuses {r['harmful_refused']}/{r['harmful']} harmful, "
        f"{r['benign_refused']}/{r['benign']} benign"
    )
    if "top" not in r:
        return text + f": {r.get('note', '')}"
    top = ", ".join(f"{h} {v:.3f}" for h, v in r["top"][:4])
    abl = "; ".join(
        f"top {k}: {a['top']:.2f} (random {min(a['random']):.2f}-{max(a['random']):.2f})"
        for k, a in r["ablated"].items()
    )
    return f"{text}; Ships {top} (nats); still refused with {abl}; {r['seconds']:.0f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap, model=None)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8, help="greedy reply tokens")
    ap.add_argument("--draws", type=int, default=3, help="random sets per size")
    ap.add_argument("--again", action="store_true", help="measure stored models again")
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args()
    start(args)
    store = json.loads(STORE.read_text()) if STORE.exists() else {}
    if not args.report:
        for name in args.models.split(","):
            if name in store and not args.again:  # make bench: what is stored stays
                print(f"{name}: stored")
                continue
            store[name] = measure(name, args)
            STORE.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
    rows = []
    for name, r in sorted(store.items()):
        print(f"{name}: {summary(r)}")
        rows.append({
            "figure": 63, "what": f"Ships: refusal and its heads, {name}", "result": summary(r),
            "target": "one head's ablation answers 16x more refused requests (Llama-2-7b-chat)",
            "met": None, "values": {k: v for k, v in r.items() if k != "replies"},
        })  # fmt: skip
    record("bench_ships", args.device, rows)


if __name__ == "__main__":
    main()
