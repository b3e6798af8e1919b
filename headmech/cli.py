"""The ``headmech`` command.

Every command prints a one-line reason and exits with status 2 on bad input (unknown
model or head type, empty, missing or too-long corpus text, a model without attention
hooks); long work shows a progress bar on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headmech.errors import HeadmechError

EXIT_BAD_INPUT = 2


def _cmd_models(args: argparse.Namespace) -> int:
    from headmech.models import list_models

    rows = list_models()
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name'].ljust(w)}  {r['description']}  [{r['status']}]")
    return 0


def _cmd_types(args: argparse.Namespace) -> int:
    from headmech.heads import head_types

    types = head_types()
    w = max((len(n) for n in types), default=4)
    for name, cls in types.items():
        extra = " (decoders only)" if cls.causal_only else ""
        print(
            f"{name.ljust(w)}  {cls.reference}: {cls.description}{extra}  [threshold {cls.default_threshold:g}, probe {cls.probe}]"
        )
        if args.verbose and cls.citation:
            print(f"{''.ljust(w)}  {cls.citation}")
    return 0


def _cmd_classify(args: argparse.Namespace) -> int:
    import headmech
    from headmech.heads import resolve_types

    types = resolve_types(args.types) if args.types else None  # fail fast, before loading
    if args.corpus is not None:
        from headmech.probes import load_sentences

        load_sentences(args.corpus)  # fail fast on a missing or empty file
    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr)
    model = headmech.load_model(args.model, device=args.device)
    t1 = time.perf_counter()
    options = {
        "corpus": args.corpus,
        "seed": args.seed,
        "batch_size": args.batch_size,
    }
    if args.n_sentences is not None:
        options["n_sentences"] = args.n_sentences
    if args.n_sequences is not None:
        options["n_sequences"] = args.n_sequences
    catalog = headmech.classify(
        model, types, validate=args.validate, n_random=args.n_random, progress=True, **options
    )
    t2 = time.perf_counter()
    out = Path(args.out)
    path = catalog.save(out)
    catalog.heatmap(out / "heatmap.png")
    print(catalog.table())
    _print_evidence(catalog)
    for name, reason in catalog.meta.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")
    print(
        f"\nwrote {path} and {out / 'heatmap.png'} (load {t1 - t0:.1f}s, classify {t2 - t1:.1f}s)"
    )
    return 0


def _print_evidence(catalog) -> None:  # type: ignore[no-untyped-def]
    """Each type's own evidence (e.g. syntactic: per relation, best head vs baseline) and
    validation effects."""
    from headmech.heads import head_types

    registry = head_types()
    for name, r in catalog.types.items():
        lines = registry[name]().report(r.details) if name in registry else []
        v = r.details.get("validation")
        if v and v.get("n_heads"):
            lines.append(
                f"validation ({v['mode']} ablation, {v['metric']}): labelled heads {v['effect']:+.4f}, "
                f"{len(v['random_effects'])} random sets of {v['n_heads']} ({v['control']}) {v['random_mean']:+.4f} on average"
            )
        if lines:
            print(f"\n{name}:")
            for line in lines:
                print(f"  {line}")


def _cmd_importance(args: argparse.Namespace) -> int:
    import headmech
    from headmech.attribution import METHODS, UnknownMethodError, importance
    from headmech.tasks import TASKS, UnknownTaskError, get_task

    if args.method not in METHODS:  # fail fast, before loading
        raise UnknownMethodError(f"unknown method '{args.method}' (have: {', '.join(METHODS)})")
    if args.task not in TASKS:
        raise UnknownTaskError(f"unknown task '{args.task}' (have: {', '.join(sorted(TASKS))})")
    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr)
    model = headmech.load_model(args.model, device=args.device)
    get_task(args.task, model)  # a causal-only task on an encoder: one-line error
    options = _probe_options(args)
    result = importance(
        model, args.method, args.task, probe_options=options, progress=True, seed=args.seed
    )
    path = result.save(args.out)
    top = ", ".join(f"L{la}H{h}" for la, h in result.top(5))
    print(f"{result.method} / {result.task}: clean {result.metric_clean}  top heads: {top}")
    print(
        f"wrote {path} and {Path(args.out) / 'importance.png'} ({result.seconds:.1f}s, "
        f"{result.forward_equivalents:.1f} forward-pass equivalents; total {time.perf_counter() - t0:.1f}s)"
    )
    return 0


def _cmd_circuit(args: argparse.Namespace) -> int:
    import headmech
    from headmech.circuits import draw, graph, save_graph
    from headmech.heads import resolve_types

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in ("q", "k", "v") for k in kinds):
        raise HeadmechError(f"--kinds takes q, k and v, got '{args.kinds}'")
    types = resolve_types(args.types) if args.types else None
    print(f"loading {args.model} ...", file=sys.stderr)
    model = headmech.load_model(args.model, device=args.device)
    catalog = headmech.classify(model, types, progress=True, seed=args.seed)
    G = graph(model, catalog, kinds=kinds, top_k=args.top_k)  # type: ignore[arg-type]
    out = Path(args.out)
    files = save_graph(G, out)
    draw(G, out / "circuit.png")
    edges = sorted(G.edges(data=True), key=lambda e: -e[2]["ratio"])
    print(f"{G.number_of_nodes()} heads, {G.number_of_edges()} edges (score / random baseline):")
    for u, v, d in edges[:40]:
        tu, tv = G.nodes[u]["types"] or "-", G.nodes[v]["types"] or "-"
        print(f"  {u} ({tu}) -{d['kind']}-> {v} ({tv})  {d['score']:.3f}  x{d['ratio']:.1f}")
    print(f"\nwrote {files['graphml']}, {files['json']} and {out / 'circuit.png'}")
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    import json

    import headmech
    from headmech.pruning import PruningResult, michel_prune
    from headmech.tasks import TASKS, UnknownTaskError, get_task

    if args.method not in ("michel", "l0", "mae"):
        raise HeadmechError(f"unknown pruning method '{args.method}' (have: michel, l0, mae)")
    if args.task not in TASKS:
        raise UnknownTaskError(f"unknown task '{args.task}' (have: {', '.join(sorted(TASKS))})")
    try:
        lams = [float(x) for x in args.lams.split(",") if x.strip()]
    except ValueError:
        raise HeadmechError(f"--lams takes comma-separated numbers, got '{args.lams}'") from None
    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr)
    model = headmech.load_model(args.model, device=args.device)
    task = get_task(args.task, model)
    options = _probe_options(args)
    catalog = None
    if args.catalog:
        from headmech.classify import HeadCatalog

        catalog = HeadCatalog.load(args.catalog)
        if (catalog.model.n_layers, catalog.model.n_heads) != (
            model.cfg.n_layers,
            model.cfg.n_heads,
        ):
            raise HeadmechError(f"{args.catalog} describes a model of another shape")
    out = Path(args.out)
    if args.method == "mae":
        from headmech.pruning.mae import compare_mae

        c = compare_mae(model, task, probe_options=options, seed=args.seed)
        out.mkdir(parents=True, exist_ok=True)
        data = {
            "method": "mae",
            "task": task.name,
            "steps": [],
            "survival": {},
            "comparison": {
                "base": c.base,
                "mae": c.mae,
                "finetuned": c.finetuned,
                "model_steps": c.model_steps,
            },
            "mae_improves": c.mae_improves,
        }
        (out / "pruning.json").write_text(json.dumps(data, indent=1) + "\n")
        print(
            f"mae / {task.name} (held out, lower is better): base {c.base:.4f}, "
            f"MAE gates + {c.model_steps} model steps {c.mae:.4f}, fine-tuned alone {c.finetuned:.4f}"
        )
        print(f"wrote {out / 'pruning.json'} (total {time.perf_counter() - t0:.1f}s)")
        return 0
    if args.method == "l0":
        from headmech.pruning.l0 import l0_sweep
        from headmech.pruning.survival import survival

        sweep = l0_sweep(
            model, lams, steps=args.l0_steps, task=task, probe_options=options, seed=args.seed
        )
        n_heads = int(model.cfg.n_heads)
        steps: list[dict[str, Any]] = [
            {
                "n_kept": int(model.cfg.n_layers) * n_heads,
                "heads_kept": [
                    [la, h] for la in range(int(model.cfg.n_layers)) for h in range(n_heads)
                ],
                "metric": sweep.results[0].base_metric,
                "lambda": 0.0,
            }
        ]
        for r in sorted(sweep.results, key=lambda r: (-r.heads_kept, r.lam)):
            kept = [[int(a), int(b)] for a, b in (r.hard_mask > 0).nonzero().tolist()]
            steps.append(
                {"n_kept": r.heads_kept, "heads_kept": kept, "metric": r.metric, "lambda": r.lam}
            )
        result = PruningResult(
            method="l0",
            task=task.name,
            steps=steps,
            survival=survival([st["heads_kept"] for st in steps], catalog) if catalog else {},
            n_heads_total=int(model.cfg.n_layers) * n_heads,
            metric=task.metric,
            model=str(getattr(model, "headmech_name", args.model)),
        )
    else:
        result = michel_prune(
            model,
            args.task,
            fraction=args.fraction,
            steps=args.steps,
            probe_options=options,
            catalog=catalog,
            progress=True,
        )
    path = result.save(out)
    if catalog is not None:
        from headmech.pruning.survival import enrichment, removal_order

        n_kept = [st["n_kept"] for st in result.steps]
        print("types by when pruning removed half their heads (heads kept then):")
        for row in removal_order(result.survival, n_kept):
            print(f"  {row['type']}: {row['half_removed_at_n_kept']}")
        half = min(result.steps, key=lambda st: abs(st["n_kept"] - n_kept[0] / 2))
        print(
            f"enrichment of catalogued heads among the {half['n_kept']} kept: {enrichment(half['heads_kept'], catalog)}"
        )
    for st in result.steps:
        lam = f"  (lambda {st['lambda']:g})" if "lambda" in st else ""
        print(f"  {st['n_kept']:4d} heads kept: {st['metric']:.4f}{lam}")
    print(
        f"{args.method} / {result.task}: {result.removable_fraction(0.05):.0%} of heads removable at <= 5% metric loss"
    )
    print(f"wrote {path} and {out / 'pruning.png'} (total {time.perf_counter() - t0:.1f}s)")
    return 0


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """Output folder, seed, device and probe sizes (importance and prune)."""
    p.add_argument(
        "--out", default="headmech-out", metavar="DIR", help="output folder (default: headmech-out)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    p.add_argument("--n-sentences", type=int, default=None, help="prose sentences (default 256)")
    p.add_argument(
        "--n-sequences", type=int, default=None, help="repeated random sequences (default 32)"
    )
    p.add_argument(
        "--half-len", type=int, default=None, help="tokens per repeated half (default 32)"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="sequences per forward pass (default 16)"
    )


def _probe_options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """ProbeOptions from the run options; unset sizes keep the library defaults."""
    from headmech.probes import ProbeOptions

    sizes = {k: getattr(args, k) for k in ("n_sentences", "n_sequences", "half_len")}
    return ProbeOptions(
        seed=args.seed,
        batch_size=args.batch_size,
        **{k: v for k, v in sizes.items() if v is not None},
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headmech",
        description="Mechanistic analysis of attention heads: classify heads into a cited catalog of types.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "models", help="list bundled and toy models", description="List bundled and toy models."
    )
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser(
        "types",
        help="list catalog head types with citations",
        description="List catalog head types with citations.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also print full citations")
    p.set_defaults(func=_cmd_types)

    p = sub.add_parser(
        "classify",
        help="score and label every head of a model",
        description="Score and label every head of MODEL for catalog head types; writes DIR/catalog.json and DIR/heatmap.png.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="minilm-l6, smollm2-135m, toy-induction, or a local Hugging Face model directory",
    )
    p.add_argument("--types", help="comma-separated head types (default: all that fit the model)")
    p.add_argument(
        "--corpus",
        help="a UTF-8 text file of prose to probe with (default: the CPython docs' prose)",
    )
    p.add_argument(
        "--out", default="headmech-out", metavar="DIR", help="output folder (default: headmech-out)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--n-sentences", type=int, default=None, help="prose sentences to probe with (default 256)"
    )
    p.add_argument(
        "--n-sequences", type=int, default=None, help="repeated random sequences (default 32)"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="sequences per forward pass (default 16)"
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="ablate each type's labelled heads and as many random same-layer heads; record the effects",
    )
    p.add_argument(
        "--n-random", type=int, default=5, help="random head sets for --validate (default 5)"
    )
    p.set_defaults(func=_cmd_classify)

    p = sub.add_parser(
        "importance",
        help="score every head's importance for a task",
        description="Score every head of MODEL for a task by an attribution method; writes DIR/importance.json and DIR/importance.png.",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face model")
    p.add_argument(
        "--method",
        required=True,
        metavar="M",
        help="zero, mean, resample, uniform, patching, attribution_patching, mask_gradient, dla, confidence, lrp",
    )
    p.add_argument(
        "--task", default="lm", metavar="T", help="lm, induction or retrieval (default lm)"
    )
    _add_run_options(p)
    p.set_defaults(func=_cmd_importance)

    p = sub.add_parser(
        "circuit",
        help="graph how catalogued heads compose",
        description="Classify MODEL's heads, then graph which earlier heads feed the labelled heads' "
        "queries, keys and values (weight-based composition, Elhage et al. 2021); writes "
        "DIR/circuit.graphml, DIR/circuit.json and DIR/circuit.png.",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face model")
    p.add_argument(
        "--types", help="comma-separated head types whose heads are receivers (default: all)"
    )
    p.add_argument("--kinds", default="q,k,v", help="composition kinds (default q,k,v)")
    p.add_argument(
        "--top-k", type=int, default=3, help="strongest senders kept per receiver and kind"
    )
    p.add_argument(
        "--out", default="headmech-out", metavar="DIR", help="output folder (default: headmech-out)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for every sampler (default 0)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda")
    p.set_defaults(func=_cmd_circuit)

    p = sub.add_parser(
        "prune",
        help="prune heads iteratively and record the task metric",
        description="Prune MODEL's heads for a task (michel: Michel et al. 2019, 10% of the "
        "remaining heads per step by mask-gradient importance; l0: Voita et al. 2019 Hard "
        "Concrete gates over a λ sweep; mae: Peng et al. 2020 input-dependent gates against "
        "fine-tuning); writes DIR/pruning.json and DIR/pruning.png.",
    )
    p.add_argument("model", metavar="MODEL", help="a bundled, toy or local Hugging Face model")
    p.add_argument("--method", required=True, metavar="M", help="michel, l0 or mae")
    p.add_argument(
        "--task", default="lm", metavar="T", help="lm, induction or retrieval (default lm)"
    )
    _add_run_options(p)
    p.add_argument(
        "--fraction",
        type=float,
        default=0.1,
        help="michel: share of remaining heads per step (0.1)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="michel: stop after N steps (default: all)"
    )
    p.add_argument(
        "--catalog", help="a catalog.json from `headmech classify`: report which types survive"
    )
    p.add_argument(
        "--lams",
        default="0.01,0.1,1,3,10",
        help="l0: λ values of the sweep (default 0.01,0.1,1,3,10)",
    )
    p.add_argument(
        "--l0-steps", type=int, default=100, help="l0: gate training steps per λ (default 100)"
    )
    p.set_defaults(func=_cmd_prune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HeadmechError as e:
        print(f"headmech: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("headmech: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
