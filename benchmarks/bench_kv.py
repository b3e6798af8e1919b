"""Catalog-guided KV-cache compression: does the catalog pick the heads that need the cache?

For each context length and KV budget (a fraction of the whole cache's size at that
length), three plans of equal budget (:mod:`headmech.kv`), evaluated exactly by masks:

* ``catalog``: the best KV heads by the catalog's retrieval score keep the whole cache,
  every other head keeps 4 sinks + a window (256 tokens, widened to spend the budget:
  :func:`headmech.kv.split_budget`);
* ``random``: as many full KV heads in every layer as ``catalog``, drawn at random
  (``--draws`` draws; the table shows their median);
* ``windowed``: no head full, every head's window as wide as the budget allows;
* ``labelled`` / ``labelled_random`` (``--plans``): the catalog's labelled heads' KV heads
  full and every other window as wide as the budget allows
  (``KVPlan.from_catalog(fill="window")``), against as many random KV heads per layer.

Metrics (:func:`headmech.kv.evaluate`): needle recall (greedy-exact answers) and the
answer's log-probability over needle depths, and perplexity on long prose, against the
full cache. The smallest budget that keeps >= 95% of the full cache's recall and
perplexity within 1% is reported per plan. ``--generate`` also runs the compressed cache
(:class:`headmech.kv.PlanCache`) on a needle prompt: measured cache bytes, tokens/s, and
whether it answers as the masked evaluation says.

Evaluations are cached in ``benchmarks/kv.json`` (one key per context/budget/plan/draw) and
a run stops starting new ones after ``--max-seconds``, so the grid can be filled by
several short runs; ``--report`` prints the table, writes ``kv.png`` and records rows.

The catalog is ``--catalog`` or ``benchmarks/kv_catalog.json`` (``headmech classify
smollm2-135m --types retrieval`` at its default needle lengths; made when missing).

Usage (what docs/kv-compression.md reports; each run a few minutes, 1 thread on a shared CPU):
    python benchmarks/bench_kv.py --threads 1 --max-seconds 120  # 2,048 tokens, 20-75%
    python benchmarks/bench_kv.py --threads 1 --budgets 0.9 \
        --plans catalog,random,windowed,labelled,labelled_random
    python benchmarks/bench_kv.py --threads 1 --budgets 0.3,0.5,0.75 \
        --plans labelled,labelled_random
    python benchmarks/bench_kv.py --threads 1 --contexts 4096 --budgets 0.3,0.5
    python benchmarks/bench_kv.py --threads 1 --generate   # the compressed cache at 2,048
    python benchmarks/bench_kv.py --threads 1 --report     # table, kv.png, results.json
The issue's full grid: ``--contexts 2048,4096,8192 --budgets 0.1,0.2,0.3,0.5,0.75,0.9``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import add_arguments, machine, record, start

HERE = Path(__file__).parent
STORE = HERE / "kv.json"
# catalog / random: the best-ranked KV heads full, 256-token windows for the rest (matched
# random control); labelled / labelled_random: the labelled heads' KV heads full, every
# other window as wide as the budget allows; windowed: no head full
PLANS = ("catalog", "random", "windowed", "labelled", "labelled_random")


def _load_store() -> dict[str, Any]:
    return json.loads(STORE.read_text()) if STORE.exists() else {"evals": {}, "generation": {}}


def _save_store(data: dict[str, Any]) -> None:
    STORE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _catalog(args: argparse.Namespace, model: Any) -> Any:
    import headmech

    if args.catalog:
        return headmech.HeadCatalog.load(args.catalog)
    path = HERE / "kv_catalog.json"
    if path.exists():
        return headmech.HeadCatalog.load(path)
    catalog = headmech.classify(model, ["retrieval"], progress=True)
    catalog.save(path)
    return catalog


def make_plan(model: Any, catalog: Any, args: argparse.Namespace, key: tuple) -> Any:
    """The plan of one grid cell ``(context, budget, kind, draw)``."""
    from headmech.kv import KVPlan

    context, budget, kind, draw = key
    if kind == "full":
        return None
    if kind == "windowed":
        return KVPlan.windowed(model, sinks=args.sinks, window=int(budget * context) - args.sinks)
    plan = KVPlan.from_catalog(
        catalog, model, args.types.split(","), sinks=args.sinks, window=args.window,
        budget=budget, context=context, fill="window" if "labelled" in kind else "heads",
    )  # fmt: skip
    if kind.endswith("random"):
        salt = 0 if kind == "random" else 7919
        seed = 1_000_003 * context + 1009 * round(budget * 1000) + draw + salt
        plan = plan.random_matched(torch.Generator().manual_seed(seed), draw=draw)
    return plan


def grid(args: argparse.Namespace) -> list[tuple]:
    """Every cell, the first draw of every plan before the other random draws."""
    cells = []
    for context in (int(c) for c in args.contexts.split(",")):
        cells.append((context, 1.0, "full", 0))
        for draw in range(args.draws):
            for budget in (float(b) for b in args.budgets.split(",")):
                for kind in args.plans.split(","):
                    if draw == 0 or kind.endswith("random"):
                        cells.append((context, budget, kind, draw))
    return cells


def cell_name(key: tuple, seeds: str = "0") -> str:
    """The store key of a cell; needle trials from other seeds than 0 are other cells."""
    return f"{key[0]}/{key[1]:g}/{key[2]}/{key[3]}" + (f"/seeds={seeds}" if seeds != "0" else "")


def _seeds(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(s) for s in args.seeds.split(","))


def run_grid(args: argparse.Namespace, model: Any, catalog: Any, data: dict) -> bool:
    """Evaluate the grid's missing cells; False if it stopped at ``--max-seconds``."""
    from headmech.kv import evaluate, needle_batches, prose_batches

    t_start = time.perf_counter()
    batches: dict[int, tuple] = {}
    depths = tuple(float(d) for d in args.depths.split(","))
    for key in grid(args):
        name = cell_name(key, args.seeds)
        if name in data["evals"] and not args.redo:
            continue
        if time.perf_counter() - t_start > args.max_seconds:
            print(f"stopping after {args.max_seconds}s; run again to continue")
            return False
        context = key[0]
        if context not in batches:
            batches[context] = (
                needle_batches(model, context, depths, seeds=_seeds(args)),
                prose_batches(model, context, n=args.prose),
            )
        result = evaluate(model, make_plan(model, catalog, args, key), *batches[context])
        data["evals"][name] = dict(
            result.to_json(), seconds=result.seconds, threads=torch.get_num_threads()
        )
        _save_store(data)
        print(
            f"{name:>24}: recall {result.recall:.2f} logprob {result.logprob:7.2f} "
            f"ppl {result.perplexity:6.2f}  kv {result.plan['kv_fraction']:.3f} "
            f"({result.seconds:.0f}s)"
        )
    return True


def run_generation(args: argparse.Namespace, model: Any, catalog: Any, data: dict) -> None:
    """The compressed cache on one needle prompt per context: bytes, tokens/s, answer."""
    from headmech.kv import generate, needle_batches
    from headmech.probes.needle import needle_spans

    for context in (int(c) for c in args.contexts.split(",")):
        batch = needle_batches(model, context, (0.5,))[0]
        answer_pos, _, valid, _ = needle_spans(batch)
        first = int(answer_pos[0, 0])
        prompt, answer = batch.input_ids[:, :first], batch.input_ids[0, answer_pos[0][valid[0]]]
        for spec in ["full:1", *args.gen_plans.split(",")]:
            kind, budget = spec.split(":")
            key = (context, float(budget), kind, 0)
            g = generate(model, make_plan(model, catalog, args, key), prompt, len(answer))
            row = {
                "nbytes": g.nbytes, "prefill_s": g.prefill_s, "decode_s": g.decode_s,
                "tokens_per_s": g.tokens_per_s, "answered": bool((g.tokens[0] == answer).all()),
                "prompt_tokens": int(prompt.shape[1]), "new_tokens": int(len(answer)),
            }  # fmt: skip
            data["generation"][cell_name(key)] = row
            _save_store(data)
            print(f"generate {cell_name(key)}: {row}")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(args: argparse.Namespace, data: dict) -> dict[int, dict]:
    """Per context: per plan and budget the metrics (random: median over draws)."""
    out: dict[int, dict] = {}
    for name, ev in data["evals"].items():
        c, b, kind, _, *rest = name.split("/")
        if (rest[0] if rest else "seeds=0") != f"seeds={args.seeds}":
            continue  # another set of needle trials
        cell = out.setdefault(int(c), {}).setdefault(kind, {}).setdefault(float(b), [])
        cell.append(ev)
    table: dict[int, dict] = {}
    for context, kinds in out.items():
        table[context] = {}
        for kind, budgets in kinds.items():
            table[context][kind] = {
                b: {
                    k: _median([e[k] for e in evs])
                    for k in ("recall", "token_accuracy", "logprob", "perplexity")
                }
                | {
                    "n": len(evs),
                    "kv_fraction": evs[0]["plan"]["kv_fraction"],
                    "n_full": evs[0]["plan"].get("n_full"),
                    "window": evs[0]["plan"].get("window"),
                    "seconds": _median([e["seconds"] for e in evs]),
                    "range_logprob": [
                        min(e["logprob"] for e in evs),
                        max(e["logprob"] for e in evs),
                    ],
                }
                for b, evs in sorted(budgets.items())
            }
    return table


def smallest_budget(rows: dict[float, dict], full: dict) -> float | None:
    for b, r in sorted(rows.items()):
        if r["recall"] >= 0.95 * full["recall"] and r["perplexity"] <= 1.01 * full["perplexity"]:
            return b
    return None


def _markdown(kinds: dict, full: dict) -> None:
    """One context's table, as Markdown (random plans: median, log-prob range)."""
    print("| budget | plan | full KV heads | window | recall | answer log-prob | perplexity |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 100% | full cache | 90 | - | {full['recall']:.2f} | {full['logprob']:.1f} | "
          f"{full['perplexity']:.2f} |")  # fmt: skip
    for b in sorted({b for k in PLANS for b in kinds.get(k, {})}):
        for kind in PLANS:
            r = kinds.get(kind, {}).get(b)
            if r is None:
                continue
            lp = f"{r['logprob']:.1f}"
            if r["n"] > 1:
                lp += f" ({r['range_logprob'][0]:.1f} to {r['range_logprob'][1]:.1f})"
            name = f"{kind}, median of {r['n']}" if r["n"] > 1 else kind
            print(f"| {b:.0%} | {name} | {r['n_full']} | {r['window']} | {r['recall']:.2f} | "
                  f"{lp} | {r['perplexity']:.2f} ({r['perplexity'] / full['perplexity'] - 1:+.1%}) |")  # fmt: skip


def report(args: argparse.Namespace, data: dict) -> list[dict]:
    table = summarise(args, data)
    rows = []
    trials = len(args.depths.split(",")) * len(_seeds(args))
    for context, kinds in sorted(table.items()):
        full = kinds.get("full", {}).get(1.0)
        if full is None:
            continue
        print(f"\n{context} tokens, {trials} needle trials per plan (seeds {args.seeds})")
        _markdown(kinds, full)
        for kind in PLANS:
            if kind not in kinds:
                continue
            best = smallest_budget(kinds[kind], full)
            top = max(kinds[kind])
            text = f"{best:.0%}" if best is not None else f"none up to {top:.0%}"
            print(
                f"smallest budget with >= 95% of full recall and perplexity within 1%, {kind}: {text}"
            )
            rows.append({
                "figure": "kv", "what": f"smallest KV budget within 95% recall / 1% perplexity, "
                f"{kind} plan, {context} tokens, {trials} needle trials", "result": text,
                "target": "", "met": None,
                "values": {"context": context, "plan": kind, "budget": best},
            })  # fmt: skip
    generation = data.get("generation", {}) if args.seeds == "0" else {}  # reported once
    for name, g in sorted(generation.items()):
        print(f"generation {name}: {g['nbytes'] / 2**20:.2f} MiB, prefill {g['prefill_s']:.1f} s, "
              f"{g['tokens_per_s']:.2f} tok/s, answered {g['answered']}")  # fmt: skip
        rows.append({"figure": "kv", "what": f"compressed cache {name}", "met": None,
                     "result": f"{g['nbytes'] / 2**20:.2f} MiB, {g['tokens_per_s']:.2f} tok/s",
                     "target": "", "values": g})  # fmt: skip
    figure(table, "kv.png" if args.seeds == "0" else f"kv_seeds{args.seeds.replace(',', '')}.png")
    return rows


def figure(table: dict[int, dict], name: str = "kv.png") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted(c for c in table if "full" in table[c])
    if not contexts:
        return
    fig, axes = plt.subplots(len(contexts), 3, figsize=(11, 3.2 * len(contexts)), squeeze=False)
    for row, context in zip(axes, contexts, strict=True):
        full = table[context]["full"][1.0]
        for kind, style in zip(PLANS, ("o-", "s--", "^:", "D-", "v--"), strict=True):
            rows = table[context].get(kind, {})
            xs = sorted(rows)
            if not xs:
                continue
            for ax, key in zip(row, ("recall", "logprob", "perplexity"), strict=True):
                ys = [rows[b][key] for b in xs]
                if key == "perplexity":
                    ys = [y / full[key] for y in ys]
                label = f"{kind} (median)" if kind.endswith("random") else kind
                line = ax.plot(xs, ys, style, label=label)[0]
                if key == "logprob" and kind.endswith("random"):
                    lo, hi = zip(*(rows[b]["range_logprob"] for b in xs), strict=True)
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        names = ("needle recall", "needle answer log-prob", "perplexity / full cache")
        for ax, key, ref in zip(row, names,
                                (full["recall"], full["logprob"], 1.0), strict=True):  # fmt: skip
            ax.axhline(ref, color="k", lw=1, ls="--")
            ax.set_xlim(0.05, 0.95)
            ax.set_xlabel("KV budget (fraction of the full cache)")
            ax.set_ylabel(key)
            ax.set_title(f"{context} tokens (dashed: full cache)")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / name, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--catalog", default=None, help="catalog.json (default: classify retrieval)")
    ap.add_argument("--types", default="retrieval")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--budgets", default="0.2,0.3,0.5,0.75")
    ap.add_argument("--plans", default="catalog,random,windowed")
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument(
        "--seeds",
        default="0",
        help="needle seeds: each gives every depth another needle and haystack (0,1,2: 9 "
        "trials); cells of other seeds are stored and reported apart",
    )
    ap.add_argument("--prose", type=int, default=1, help="prose sequences per context")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-seconds", type=float, default=float("inf"))
    ap.add_argument("--redo", action="store_true", help="recompute cached cells")
    ap.add_argument("--generate", action="store_true", help="run the compressed cache")
    ap.add_argument("--gen-plans", default="catalog:0.2,labelled:0.5,windowed:0.5")
    ap.add_argument("--report", action="store_true", help="table, figure, results.json rows")
    args = ap.parse_args()
    start(args)
    data = _load_store()
    data["machine"] = machine(args.device)
    script = "bench_kv" if args.seeds == "0" else f"bench_kv --seeds {args.seeds}"
    if args.report:
        record(script, args.device, report(args, data))
        return
    import headmech

    model = headmech.load_model(args.model, device=args.device)
    catalog = _catalog(args, model)
    if args.generate:
        run_generation(args, model, catalog, data)
    elif run_grid(args, model, catalog, data):
        record(script, args.device, report(args, data))


if __name__ == "__main__":
    main()
