"""The ``headmech`` subcommands: load, run, print a summary, save the result's own files.

Each command validates its arguments before loading the model (a bad name fails in a
second, not after a minute of loading) and writes its files through the result object's
``save`` (the same files a notebook user gets).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from headmech.errors import HeadmechError

__all__ = ["cmd_circuit", "cmd_classify", "cmd_importance", "cmd_models", "cmd_prune", "cmd_types"]


def _load(args: argparse.Namespace) -> Any:
    from headmech.models import load_model

    print(f"loading {args.model} ...", file=sys.stderr)
    return load_model(args.model, device=args.device)


def cmd_models(args: argparse.Namespace) -> int:
    """``headmech models``."""
    from headmech.models import list_models

    rows = list_models()
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name'].ljust(w)}  {r['description']}  [{r['status']}]")
    return 0


def cmd_types(args: argparse.Namespace) -> int:
    """``headmech types``."""
    from headmech.heads import head_types

    types = head_types()
    w = max((len(n) for n in types), default=4)
    for name, cls in types.items():
        extra = " (decoders only)" if cls.causal_only else ""
        print(
            f"{name.ljust(w)}  {cls.reference}: {cls.description}{extra}  "
            f"[threshold {cls.default_threshold:g}, probe {cls.probe}, task {cls.task}]"
        )
        if args.verbose and cls.citation:
            print(f"{''.ljust(w)}  {cls.citation}")
    return 0


def cmd_classify(args: argparse.Namespace) -> int:
    """``headmech classify``."""
    from headmech.classify import classify
    from headmech.heads import resolve_types

    types = resolve_types(args.types) if args.types else None  # fail fast, before loading
    if args.corpus is not None:
        from headmech.probes import load_sentences

        load_sentences(args.corpus)  # fail fast on a missing or empty file
    t0 = time.perf_counter()
    model = _load(args)
    t1 = time.perf_counter()
    options = {k: v for k, v in vars(_probe_options(args)).items()}
    options["corpus"] = args.corpus
    catalog = classify(
        model, types, validate=args.validate, n_random=args.n_random, progress=True, **options
    )
    t2 = time.perf_counter()
    path = catalog.save(args.out)
    print(catalog.table())
    _print_evidence(catalog)
    for name, reason in catalog.meta.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")
    print(
        f"\nwrote {path} and {Path(args.out) / 'heatmap.png'} (load {t1 - t0:.1f}s, classify {t2 - t1:.1f}s)"
    )
    return 0


def _print_evidence(catalog: Any) -> None:
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


def _method_options(registry: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs, typed by the method's options dataclass, plus ``seed``
    where the method takes one."""
    from dataclasses import fields

    from headmech.registry import parse_options

    entry = registry.entry(name)
    options = parse_options(entry, args.option or [])
    if entry.options is not None and "seed" in {f.name for f in fields(entry.options)}:
        options.setdefault("seed", args.seed)
    return options


def cmd_importance(args: argparse.Namespace) -> int:
    """``headmech importance``."""
    from headmech.attribution import importance
    from headmech.registry import METHODS, TASKS
    from headmech.tasks import get_task

    options = _method_options(METHODS, args.method, args)  # fail fast, before loading
    TASKS.entry(args.task)
    t0 = time.perf_counter()
    model = _load(args)
    get_task(args.task, model)  # a causal-only task on an encoder: one-line error
    result = importance(
        model, args.method, args.task, probe_options=_probe_options(args), progress=True, **options
    )
    path = result.save(args.out)
    top = ", ".join(f"L{la}H{h}" for la, h in result.top(5))
    print(f"{result.method} / {result.task}: clean {result.metric_clean}  top heads: {top}")
    print(
        f"wrote {path} and {Path(args.out) / 'importance.png'} ({result.seconds:.1f}s, "
        f"{result.forward_equivalents:.1f} forward-pass equivalents; total {time.perf_counter() - t0:.1f}s)"
    )
    return 0


def cmd_circuit(args: argparse.Namespace) -> int:
    """``headmech circuit``."""
    from headmech.circuits import circuit
    from headmech.classify import classify
    from headmech.heads import resolve_types

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in ("q", "k", "v") for k in kinds):
        raise HeadmechError(f"--kinds takes q, k and v, got '{args.kinds}'")
    types = resolve_types(args.types) if args.types else None
    model = _load(args)
    catalog = classify(model, types, progress=True, seed=args.seed)
    result = circuit(model, catalog, kinds=kinds, top_k=args.top_k)  # type: ignore[arg-type]
    files = result.save(args.out)
    G = result.graph
    print(f"{G.number_of_nodes()} heads, {G.number_of_edges()} edges (score / random baseline):")
    for u, v, d in result.edges()[:40]:
        tu, tv = G.nodes[u]["types"] or "-", G.nodes[v]["types"] or "-"
        print(f"  {u} ({tu}) -{d['kind']}-> {v} ({tv})  {d['score']:.3f}  x{d['ratio']:.1f}")
    print(f"\nwrote {files['graphml']}, {files['json']} and {files['png']}")
    return 0


def _prune_options(args: argparse.Namespace) -> dict[str, Any]:
    from headmech.registry import PRUNING_METHODS

    options = _method_options(PRUNING_METHODS, args.method, args)
    if args.method == "michel":
        options.setdefault("fraction", args.fraction)
        options.setdefault("steps", args.steps)
    elif args.method == "l0":
        try:
            lams = tuple(float(x) for x in args.lams.split(",") if x.strip())
        except ValueError:
            raise HeadmechError(
                f"--lams takes comma-separated numbers, got '{args.lams}'"
            ) from None
        options.setdefault("lams", lams)
        options.setdefault("steps", args.l0_steps)
    return options


def _load_catalog(path: str | None, model: Any) -> Any:
    if not path:
        return None
    from headmech.classify import HeadCatalog

    catalog = HeadCatalog.load(path)
    if (catalog.model.n_layers, catalog.model.n_heads) != (model.cfg.n_layers, model.cfg.n_heads):
        raise HeadmechError(f"{path} describes a model of another shape")
    return catalog


def _print_pruning(result: Any, catalog: Any) -> None:
    if catalog is not None and result.steps:
        from headmech.pruning.survival import enrichment, removal_order

        n_kept = [st["n_kept"] for st in result.steps]
        print("types by when pruning removed half their heads (heads kept then):")
        for row in removal_order(result.survival, n_kept):
            print(f"  {row['type']}: {row['half_removed_at_n_kept']}")
        half = min(result.steps, key=lambda st: abs(st["n_kept"] - n_kept[0] / 2))
        e = enrichment(half["heads_kept"], catalog)
        print(f"enrichment of catalogued heads among the {half['n_kept']} kept: {e}")
    for st in result.steps:
        lam = f"  (lambda {st['lambda']:g})" if "lambda" in st else ""
        print(f"  {st['n_kept']:4d} heads kept: {st['metric']:.4f}{lam}")
    if "comparison" in result.extra:
        c = result.extra["comparison"]
        print(
            f"mae / {result.task} (held out, lower is better): base {c['base']:.4f}, "
            f"MAE gates + {c['model_steps']} model steps {c['mae']:.4f}, fine-tuned alone {c['finetuned']:.4f}"
        )
    else:
        print(
            f"{result.method} / {result.task}: {result.removable_fraction(0.05):.0%} of heads "
            "removable at <= 5% metric loss"
        )


def cmd_prune(args: argparse.Namespace) -> int:
    """``headmech prune``."""
    from headmech.pruning import prune
    from headmech.registry import TASKS
    from headmech.tasks import get_task

    options = _prune_options(args)  # fail fast, before loading
    TASKS.entry(args.task)
    t0 = time.perf_counter()
    model = _load(args)
    task = get_task(args.task, model)
    catalog = _load_catalog(args.catalog, model)
    result = prune(
        model, args.method, task, catalog=catalog, probe_options=_probe_options(args),
        progress=True, **options,
    )  # fmt: skip
    path = result.save(args.out)
    _print_pruning(result, catalog)
    print(f"wrote {path} (total {time.perf_counter() - t0:.1f}s)")
    return 0


def _probe_options(args: argparse.Namespace) -> Any:
    """ProbeOptions from the run options; unset sizes keep the library defaults."""
    from headmech.probes import ProbeOptions

    sizes = {k: getattr(args, k, None) for k in ("n_sentences", "n_sequences", "half_len")}
    return ProbeOptions(
        seed=args.seed,
        batch_size=args.batch_size,
        **{k: v for k, v in sizes.items() if v is not None},
    )
