"""KV plans chosen by measured long-range importance, against the catalog, random heads
and plain windows, at equal budget (issue 31; DuoAttention's setting).

Per context length:

1. **Importance** (:func:`headmech.kv.kv_importance`): every KV head alone restricted to
   4 sinks + a 256-token window, the increase of the needle answers' NLL plus the prose
   NLL, on *calibration* data: needle seeds ``--calib-seeds`` with haystacks and prose
   drawn from the even-numbered sentences of the corpus.
2. **Plans** at each budget (a fraction of the model's own cache; for a model with
   sliding-window layers, what is left beyond them: :meth:`KVPlan.from_ranking`):
   ``importance`` (costliest heads full), ``catalog`` (the catalog's retrieval ranking),
   ``union`` (the catalog's labelled retrieval KV heads first, then importance order),
   ``random`` (as many full KV heads as the others, drawn uniformly among those a plan
   may choose, ``--draws`` draws, median), ``windowed`` (no head full, every window as wide as the budget allows),
   and on request ``restored``: the ranking of ``kv_importance(mode="restored")`` (every
   KV head windowed, each alone given its whole cache back; the share of the loss gap it
   closes), measured on the same calibration data; ``importance-task`` / ``restored-task``:
   the same measurements ranked per task in turn (``KVImportance.ranking(by="task")``).
3. **Evaluation** on *held-out* data: needle seeds ``--seeds`` x depths (9 trials by
   default) with haystacks from the odd-numbered sentences, and ``--prose`` prose
   sequences of the same sentences. Where a half of the corpus is shorter than the
   context it is repeated in fresh shuffled orders (``corpus_repeats`` in the store: the
   prose then recurs at least a half-corpus apart, which rewards copying from far back).
4. ``--generate``: the compressed cache (:class:`headmech.kv.PlanCache`) at the best
   budgets: its measured bytes and decode tokens/s.

Everything goes to ``--store`` (JSON, written after each cell; a rerun skips finished
cells; cells measured on other held-out data, by a hash of its token ids, move to
``stale`` and are measured again), so a run stopped at ``--max-seconds`` or by a lost machine keeps what it did.
``--report`` prints the tables, draws ``kv_plans.png`` and records results.json rows.

The model is a bundled name (``--model``) or, where TransformerLens is not installed
(a GPU machine), a Hugging Face folder or GGUF file (``--hf``) with ``--catalog``.

Usage:
    python benchmarks/bench_kv_plans.py --model smollm2-135m --contexts 2048 --threads 1
    python benchmarks/bench_kv_plans.py --hf /tmp/smol --catalog catalog/smollm2-135m \
        --device cuda --contexts 2048,4096,8192 --store /tmp/out/kv_plans_smollm2.json
    python benchmarks/bench_kv_plans.py --report --store benchmarks/kv_plans_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from common import add_arguments, machine, record, start

HERE = Path(__file__).parent
PLANS = ("importance", "union", "catalog", "random", "windowed")
# measured on request (--plans ...,restored): every KV head windowed, each alone restored
RANKED = ("importance", "restored")
CRITERIA = "recall >= 95% of the full cache's and perplexity within 1%"
# bundled models with sliding-window layers: a plan chooses among the few global KV heads
# (Gemma 3: 3 of 18 layers), so the issue states their saving instead of DuoAttention's bar
OWN_WINDOWS = {"gemma3-270m"}


# --- the model and the data ------------------------------------------------------------
def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(hf, shim)``: the plain Hugging Face model and what the probes read (tokenizer,
    ``cfg.n_ctx``)."""
    import transformers as hf_lib

    if args.hf:
        path = Path(args.hf)
        if path.suffix == ".gguf":
            tok = hf_lib.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            hf = hf_lib.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
        else:
            tok = hf_lib.AutoTokenizer.from_pretrained(path)
            hf = hf_lib.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf = hf.to(args.device or "cpu").eval()
    else:
        import headmech
        from headmech.kv import hf_model

        bridge = headmech.load_model(args.model, device=args.device)
        hf, tok = hf_model(bridge), bridge.tokenizer
    n_ctx = int(getattr(hf.config, "max_position_embeddings", 0) or 1 << 20)
    return hf, SimpleNamespace(tokenizer=tok, cfg=SimpleNamespace(n_ctx=n_ctx))


def corpus_half(shim: Any, context: int, part: int) -> tuple[list[str], int]:
    """The even (0) or odd (1) sentences of the default corpus, repeated in fresh shuffled
    orders until they hold ``context`` + 10% tokens; and how many copies that took."""
    from headmech.probes import load_sentences

    half = load_sentences(None)[part::2]
    tok = shim.tokenizer
    n = sum(len(tok(" " + s, add_special_tokens=False)["input_ids"]) for s in half)
    copies = max(1, -(-int(context * 1.1) // n))
    out = list(half)
    for i in range(1, copies):
        extra = list(half)
        random.Random(7919 * i + part).shuffle(extra)
        out += extra
    return out, copies


def batches(args: argparse.Namespace, shim: Any, context: int, part: int) -> tuple[list, list, int]:
    from headmech.kv import needle_batches, prose_batches

    corpus, copies = corpus_half(shim, context, part)
    seeds = args.calib_seeds if part == 0 else args.seeds
    depths = tuple(float(d) for d in args.depths.split(","))
    needle = needle_batches(shim, context, depths, seeds=_ints(seeds), corpus=corpus)
    prose = prose_batches(shim, context, n=1 if part == 0 else args.prose, seed=part, corpus=corpus)
    return needle, prose, copies


def data_hash(batches: list) -> str:
    """The held-out token ids, hashed: cells measured on other data (another tokenizer,
    corpus, seeds or number of trials) are never compared with these."""
    h = hashlib.sha256()
    for b in batches:
        h.update(b.input_ids.cpu().to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def same_data(ctx: dict, context: int, sha: str) -> None:
    """Cells measured on other held-out data move to ``stale`` (kept, never compared)."""
    if ctx.get("data", sha) != sha and ctx["evals"]:
        old = ctx.setdefault("stale", {})
        old[ctx["data"]] = {"evals": ctx["evals"], "needle_trials": ctx.get("needle_trials"),
                            "prose_sequences": ctx.get("prose_sequences")}  # fmt: skip
        ctx["evals"] = {}
        print(f"{context}: other held-out data than the stored cells'; they move to 'stale'")
    ctx["data"] = sha


def needed_rankings(plans: str) -> set[str]:
    """The measured rankings (:data:`RANKED`) the plans read: ``importance`` for the
    importance, union and catalog plans (and every run measuring one of PLANS), ``restored``
    on request; none for ``def-<name>`` plans alone (``--definitions``: the agreement
    matrix brings its rankings, its KV ranking among them)."""
    kinds = {p.split("-task")[0] for p in plans.split(",")}
    need = {k for k in RANKED if k in kinds}
    if kinds & {"union", "catalog"}:
        need.add("importance")
    return need


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(","))


# --- plans -------------------------------------------------------------------------------
def plan_of(
    hf: Any, kind: str, budget: float, context: int, rankings: dict, draw: int, args
) -> Any:
    from headmech.kv import KVPlan

    size = {"sinks": args.sinks, "window": args.window}
    if kind == "full":
        return None
    if kind == "windowed":
        return KVPlan.from_ranking(hf, [], budget, context, **size, source={"kind": "windowed"})
    if kind == "random":  # as many full KV heads, drawn among all the plan could choose
        pairs = [(la, k) for la in range(hf.config.num_hidden_layers)
                 for k in range(hf.config.num_key_value_heads)]  # fmt: skip
        seed = 1_000_003 * context + 1009 * round(budget * 1000) + draw
        random.Random(seed).shuffle(pairs)
        src = {"kind": "random", "draw": draw, "seed": seed}
        return KVPlan.from_ranking(hf, pairs, budget, context, **size, source=src)
    return KVPlan.from_ranking(hf, rankings[kind], budget, context, **size, source={"kind": kind})


def rankings_for(hf: Any, catalog: Any, importance: list) -> dict[str, list]:
    """The three rankings: importance, the catalog's retrieval scores, and the catalog's
    labelled retrieval KV heads first, then the importance order."""
    from headmech.kv import kv_ranking

    group = hf.config.num_attention_heads // hf.config.num_key_value_heads
    cat = kv_ranking(catalog, ["retrieval"], group)
    labelled = {(h.layer, h.head // group) for h in catalog.heads("retrieval")}
    first = [p for p in importance if p in labelled] + [p for p in cat if p in labelled]
    union = list(dict.fromkeys(first + importance))
    return {"importance": importance, "catalog": cat, "union": union}


def definition_rankings(hf: Any, path: str | None) -> dict[str, list]:
    """``def-<name>``: each retrieval-head definition's KV ranking of an agreement matrix
    (``headmech compare-definitions``' definitions.json; :meth:`AgreementMatrix.kv_ranking`),
    the plans the matrix's KV column is measured with (none without ``--definitions``)."""
    if path is None:
        return {}
    from headmech.compare import AgreementMatrix

    matrix = AgreementMatrix.load(path)
    group = hf.config.num_attention_heads // hf.config.num_key_value_heads
    return {f"def-{name}": matrix.kv_ranking(name, group) for name in matrix.scores}


def measured_rankings(store: dict, ctx: dict) -> dict[str, list]:
    """The measured rankings of a context (``importance``, ``restored`` where stored) and
    their per-task orders (``<kind>-task``: :meth:`KVImportance.ranking` ``by="task"``),
    read from the record at the length they were measured at."""
    from headmech.kv import KVImportance

    out: dict[str, list] = {}
    for key in RANKED:
        if key not in ctx:
            continue
        out[key] = [tuple(p) for p in ctx[key]["ranking"]]
        src = store[str(ctx[key]["from_context"])][key] if "from_context" in ctx[key] else ctx[key]
        out[f"{key}-task"] = KVImportance.from_json(src).ranking("task")
    return out


# --- the run ---------------------------------------------------------------------------
def run(args: argparse.Namespace, store: dict, save: Any) -> None:
    from headmech.classification.results import HeadCatalog
    from headmech.kv import kv_importance

    hf, shim = load(args)
    catalog = HeadCatalog.load(args.catalog)
    t_start = time.perf_counter()
    budgets = [float(b) for b in args.budgets.split(",")]
    for context in _ints(args.contexts):
        ctx = store.setdefault(str(context), {"evals": {}})
        calib_needle, calib_prose, _ = batches(args, shim, context, 0)
        needle, prose, copies = batches(args, shim, context, 1)
        same_data(ctx, context, data_hash(needle + prose))
        ctx.update(corpus_repeats=copies, needle_trials=sum(b.input_ids.shape[0] for b in needle),
                   prose_sequences=len(prose), sinks=args.sinks, window=args.window)  # fmt: skip
        for key in RANKED:
            if key not in needed_rankings(args.plans):
                continue
            if key not in ctx and args.ranking_from:  # another length's ranking
                src = store[str(args.ranking_from)][key]
                ctx[key] = {"ranking": src["ranking"], "from_context": args.ranking_from}
                save()
                print(f"{context}: {key} ranking of {args.ranking_from} tokens: {src['ranking']}")
            if key not in ctx:
                mode = "windowed" if key == "importance" else "restored"
                imp = kv_importance(hf, calib_needle, calib_prose, sinks=args.sinks,
                                    window=args.window, mode=mode, progress=args.progress)  # fmt: skip
                ctx[key] = imp.to_json()
                save()
                print(f"{context}: {key} in {imp.seconds:.0f}s, top {imp.ranking()[:6]}")
        measured = measured_rankings(store, ctx)
        rankings = measured
        if "importance" in measured:
            rankings = rankings_for(hf, catalog, measured["importance"]) | measured
        rankings |= definition_rankings(hf, args.definitions)
        cells = [("full", 1.0, 0)] + [
            (k, b, d) for b in budgets for k in args.plans.split(",")
            for d in range(args.draws if k == "random" else 1)
        ]  # fmt: skip
        pending = [c for c in cells if f"{c[0]}/{c[1]:g}/{c[2]}" not in ctx["evals"]]
        # one shared run per budget; the full cache rides with the first (layers shared)
        full = [c for c in pending if c[0] == "full"]
        for i, budget in enumerate(dict.fromkeys(b for k, b, _ in pending if k != "full")):
            if time.perf_counter() - t_start > args.max_seconds:
                print(f"stopping after {args.max_seconds:.0f}s; run again to continue")
                return
            group = (full if i == 0 else []) + [
                c for c in pending if c[1] == budget and c[0] != "full"
            ]
            evaluate_group(args, hf, group, context, rankings, needle, prose, ctx)
            save()
        if full and len(pending) == len(full):  # nothing else to run
            evaluate_group(args, hf, full, context, rankings, needle, prose, ctx)
            save()
        if args.generate:
            generation(args, hf, shim, context, rankings, ctx, save)


def evaluate_group(
    args, hf: Any, group: list, context: int, rankings: dict, needle: list, prose: list, ctx: dict
) -> None:
    """The cells of one budget, evaluated together (:func:`headmech.kv.evaluate_many`:
    layers where plans agree run once; identical plans once). ``seconds`` is a cell's
    share of the group's time."""
    from headmech.kv import evaluate_many

    names, plans = [], []
    for kind, budget, draw in group:
        name = f"{kind}/{budget:g}/{draw}"
        try:
            plans.append(plan_of(hf, kind, budget, context, rankings, draw, args))
            names.append(name)
        except Exception as e:  # a budget below the model's own windows
            ctx["evals"][name] = {"error": str(e)}
    if not plans:
        return
    t0 = time.perf_counter()
    evs = evaluate_many(hf, plans, needle, prose, progress=args.progress)
    took = time.perf_counter() - t0
    for name, plan, ev in zip(names, plans, evs, strict=True):
        row = ev.to_json() | {"seconds": round(ev.seconds, 2), "device": args.device or "cpu",
                              "group": {"plans": len(plans), "seconds": round(took, 1)}}  # fmt: skip
        if plan is not None:
            row["plan"]["full_heads"] = plan.full_heads()
        ctx["evals"][name] = row
        print(f"{context} {name:>18}: recall {ev.recall:.2f} ppl {ev.perplexity:7.3f} "
              f"kv {row['plan']['kv_fraction']:.3f} (group of {len(plans)}: {took:.0f}s)")  # fmt: skip


def generation(args, hf: Any, shim: Any, context: int, rankings: dict, ctx: dict, save) -> None:
    """The compressed cache on one held-out needle prompt: bytes, tokens/s, the answer."""
    from headmech.kv import generate, needle_batches
    from headmech.probes.needle import needle_spans

    corpus, _ = corpus_half(shim, context, 1)
    batch = needle_batches(shim, context, (0.5,), corpus=corpus)[0]
    answer_pos, _, valid, _ = needle_spans(batch)
    first = int(answer_pos[0, 0])
    prompt, answer = batch.input_ids[:, :first], batch.input_ids[0, answer_pos[0][valid[0]]]
    for spec in ["full:1", *args.gen_plans.split(",")]:
        kind, budget = spec.split(":")
        plan = plan_of(hf, kind, float(budget), context, rankings, 0, args)
        g = generate(hf, plan, prompt, max(len(answer), args.gen_tokens))
        ctx.setdefault("generation", {})[spec] = {
            "nbytes": g.nbytes, "prefill_s": g.prefill_s, "decode_s": g.decode_s,
            "tokens_per_s": g.tokens_per_s, "new_tokens": int(g.tokens.shape[1]),
            "answered": bool((g.tokens[0, : len(answer)].cpu() == answer).all()),
            "prompt_tokens": int(prompt.shape[1]),
        }  # fmt: skip
        save()
        print(f"generate {context} {spec}: {ctx['generation'][spec]}")


# --- the report ----------------------------------------------------------------------------
def summary(ctx: dict) -> dict[str, dict[float, dict]]:
    """Per plan and budget: recall, log-prob, perplexity (random: medians over draws)."""
    out: dict[str, dict[float, list]] = {}
    for name, ev in ctx["evals"].items():
        if "error" in ev:
            continue
        kind, budget, _ = name.split("/")
        out.setdefault(kind, {}).setdefault(float(budget), []).append(ev)
    med = statistics.median
    return {
        kind: {
            b: {k: med([e[k] for e in evs]) for k in ("recall", "logprob", "perplexity")}
            | {
                "n": len(evs),
                "kv_fraction": med([e["plan"]["kv_fraction"] for e in evs]),
                "n_full": evs[0]["plan"].get("n_full"),
                "window": evs[0]["plan"].get("window"),
            }
            for b, evs in sorted(budgets.items())
        }  # fmt: skip
        for kind, budgets in out.items()
    }


def best(rows: dict[float, dict], full: dict) -> tuple[float, float] | None:
    """The smallest budget meeting both criteria: ``(budget, compression)``."""
    for b, r in sorted(rows.items()):
        if r["recall"] >= 0.95 * full["recall"] and r["perplexity"] <= 1.01 * full["perplexity"]:
            return b, 1 / r["kv_fraction"]
    return None


def definitions_column(store: dict, path: str, context: int | None = None) -> dict[str, dict]:
    """The agreement matrix's KV column (:attr:`AgreementMatrix.kv`), written into its
    definitions.json: per definition, the largest compression of its ``def-<name>`` plan
    meeting :data:`CRITERIA` at ``context`` (default: the longest context measuring every
    definition)."""
    from headmech.compare import AgreementMatrix

    matrix = AgreementMatrix.load(path)
    want = [f"def-{n}" for n in matrix.scores]
    done = {
        int(c): summary(ctx) for c, ctx in store.items()
        if c.isdigit() and "full/1/0" in ctx.get("evals", {})
    }  # fmt: skip
    done = {c: t for c, t in done.items() if all(k in t for k in want)}
    if context is None and not done:
        raise SystemExit(f"no context of the store measures every plan of {', '.join(want)}")
    context = context if context is not None else max(done)
    table = done[context]
    full = table["full"][1.0]
    for name in matrix.scores:
        rows = table[f"def-{name}"]
        got = best(rows, full)
        matrix.kv[name] = {
            "context": context, "criteria": CRITERIA, "budgets": sorted(rows),
            "budget": got[0] if got else None, "compression": got[1] if got else None,
            "full": {"recall": full["recall"], "perplexity": full["perplexity"]},
        }  # fmt: skip
    matrix.save(path)
    return matrix.kv


def report(args: argparse.Namespace, store: dict) -> list[dict]:
    rows = []
    model = store.get("model", args.model)
    duo = model not in OWN_WINDOWS  # DuoAttention's 1.67x is the target where plans choose freely
    target = ">= 1.67x (DuoAttention, GQA)" if duo else "stated beyond the model's own windows"
    for context, ctx in sorted(store.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        if not context.isdigit() or "full/1/0" not in ctx.get("evals", {}):
            continue
        table = summary(ctx)
        full = table["full"][1.0]
        print(f"\n{model}, {context} tokens, {ctx.get('needle_trials')} needle trials, "
              f"{ctx.get('prose_sequences')} prose (corpus copies: {ctx.get('corpus_repeats', 1)}); "
              f"full cache: recall {full['recall']:.2f}, perplexity {full['perplexity']:.3f}")  # fmt: skip
        # the plans of PLANS, then the others measured (def-<name>: --definitions)
        kinds = [p for p in PLANS if p in table] + sorted(set(table) - set(PLANS) - {"full"})
        print("| budget | " + " | ".join(kinds) + " |")
        print("|---" * (1 + len(kinds)) + "|")
        for b in sorted({b for p in kinds for b in table[p]}):
            cells = []
            for p in kinds:
                r = table[p].get(b)
                cells.append(
                    "-"
                    if r is None
                    else f"{r['recall']:.2f} / {r['perplexity'] / full['perplexity'] - 1:+.1%}"
                )
            print(f"| {b:.0%} | " + " | ".join(cells) + " |")
        for p in kinds:
            got = best(table[p], full)
            text = f"{got[1]:.2f}x (budget {got[0]:.0%})" if got else "none"
            print(f"  best compression meeting {CRITERIA}, {p}: {text}")
            rows.append({
                "figure": "kv_plans", "what": f"largest KV compression with {CRITERIA}, {model}, "
                f"{p} plan, {context} tokens", "result": text, "target": target,
                "met": bool(got and got[1] >= 1.67) if p == "importance" and duo else None,
                "values": {"model": model, "plan": p, "context": int(context),
                           "budget": got[0] if got else None, "compression": got[1] if got else None},
            })  # fmt: skip
        for spec, g in sorted(ctx.get("generation", {}).items()):
            print(f"  generation {spec}: {g['nbytes'] / 2**20:.2f} MiB, {g['tokens_per_s']:.1f} tok/s, "
                  f"answered {g['answered']}")  # fmt: skip
    figure(store, model, getattr(args, "figure", None))
    return rows


def figure(store: dict, model: str, name: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib import ticker

    contexts = [c for c in sorted(store, key=lambda c: int(c) if c.isdigit() else 0)
                if c.isdigit() and "full/1/0" in store[c]["evals"]]  # fmt: skip
    if not contexts:
        return
    fig, axes = plt.subplots(len(contexts), 2, figsize=(10, 3.2 * len(contexts)), squeeze=False)
    colours = dict(zip(PLANS, sns.color_palette("colorblind", len(PLANS)), strict=True))
    for row, context in zip(axes, contexts, strict=True):
        table = summary(store[context])
        full = table["full"][1.0]
        for p in PLANS:
            xs = sorted(table.get(p, {}))
            if not xs:
                continue
            comp = [1 / table[p][b]["kv_fraction"] for b in xs]
            row[0].plot(comp, [table[p][b]["recall"] for b in xs], "o-", color=colours[p], label=p)
            row[1].plot(comp, [table[p][b]["perplexity"] / full["perplexity"] for b in xs], "o-",
                        color=colours[p], label=p)  # fmt: skip
        row[0].axhline(0.95 * full["recall"], color="k", ls="--", lw=1)
        row[1].axhline(1.01, color="k", ls="--", lw=1)
        for ax, what in zip(row, ("needle recall", "perplexity / full cache"), strict=True):
            ax.axvline(1.67, color="grey", ls=":", lw=1)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1, 1.5, 2, 3, 5, 7)))
            ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%.3gx"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.set_xlabel("compression (own cache / plan's cache)")
            ax.set_ylabel(what)
            ax.set_title(f"{model}, {context} tokens", fontsize=10)
        row[0].legend(fontsize=7)
    fig.suptitle("dotted: DuoAttention's 1.67x (GQA); dashed: the criteria", fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / f"{name or 'kv_plans_' + model}.png", dpi=110)  # the store's name
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    ap.add_argument("--hf", default=None, help="a Hugging Face folder or .gguf (no bridge)")
    ap.add_argument("--catalog", default=None, help="catalog folder (default catalog/<model>)")
    ap.add_argument("--store", default=None, help="default benchmarks/kv_plans_<model>.json")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5,0.6,0.75,0.9")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--seeds", default="0,1,2", help="held-out needle seeds")
    ap.add_argument(
        "--calib-seeds", default="100", help="needle seeds the importance is measured on"
    )
    ap.add_argument(
        "--ranking-from",
        type=int,
        default=None,
        help="use the importance ranking measured at this context (not measured anew)",
    )
    ap.add_argument(
        "--definitions",
        default=None,
        help="an agreement matrix (definitions.json): each definition's KV ranking as plan "
        "def-<name> (add them to --plans)",
    )
    ap.add_argument("--prose", type=int, default=2, help="held-out prose sequences per context")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-seconds", type=float, default=float("inf"))
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--generate", action="store_true", help="run the compressed cache too")
    ap.add_argument("--gen-plans", default="importance:0.5,windowed:0.5")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--report", action="store_true", help="tables, figure, results.json rows")
    args = ap.parse_args()
    start(args)
    store_path = Path(args.store or HERE / f"kv_plans_{args.model}.json")
    args.catalog = args.catalog or str(HERE.parent / "catalog" / args.model)
    store = json.loads(store_path.read_text()) if store_path.exists() else {}
    if args.report:
        args.figure = store_path.stem
        name = f"bench_kv_plans {store.get('model', args.model)}"
        name += " cpu" if store_path.stem.endswith("_cpu") else ""
        where = store.get("machines") or store.get("machine")
        record(name, store.get("device"), report(args, store), where)
        if args.definitions:  # the matrix's KV column, from the def-<name> plans
            for d, c in definitions_column(store, args.definitions).items():
                got = f"{c['compression']:.2f}x" if c["compression"] else "none"
                print(f"{d}: {got} at {c['context']} tokens (written to {args.definitions})")
        return
    dev = args.device or "cpu"
    if "machine" in store and "machines" not in store:  # a store from one machine
        store["machines"] = {store.get("device", "cpu"): store["machine"]}
    store.setdefault("machines", {})[dev] = machine(args.device)  # cells name their device
    store.setdefault("model", args.model)
    store.setdefault("device", dev)
    store.setdefault("machine", store["machines"][dev])

    def save() -> None:
        store_path.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")

    run(args, store, save)
    save()


if __name__ == "__main__":
    main()
