"""The ``headmech`` subcommands: load, run, print a summary, save the result's own files.

Each command validates its arguments before loading the model (a bad name fails in a
second, not after a minute of loading) and writes its files through the result object's
``save`` (the same files a notebook user gets). What the commands share is in
:mod:`headmech.cli.base`; ``kv-plan`` and ``discover`` have modules of their own
(:mod:`headmech.cli.kv`, :mod:`headmech.cli.discover`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from headmech.cli import report
from headmech.cli.base import (
    RESULT_FILES,
    catalog_file,
    check_run,
    fit_before_load,
    load_model_of,
    resumable,
    save_partial,
    save_result,
    staging,
)
from headmech.cli.kv import cmd_kv_plan
from headmech.core import checks as V
from headmech.core.errors import IncompleteRunError, InputError

__all__ = [
    "cmd_circuit",
    "cmd_classify",
    "cmd_importance",
    "cmd_kv_plan",
    "cmd_models",
    "cmd_prune",
    "cmd_serve",
    "cmd_types",
]


def cmd_models(args: argparse.Namespace) -> int:
    """``headmech models`` (the bundled models' statuses without importing torch)."""
    from headmech.core.registry import MODELS
    from headmech.models.files import cache_dir
    from headmech.models.packages import BUNDLED_MODELS, status

    def quick(name: str) -> str | None:  # the loaders' status() imports torch (seconds)
        if name in BUNDLED_MODELS:
            return status(name)
        if name == "toy-induction":  # shipped, copied to the cache (the load checks the recipe)
            cached = any((cache_dir() / "toys").glob(f"{name}-*/config.json"))
            return "cached" if cached else "copied from the package on first use"
        return None

    rows = [
        {"name": n, "description": m["summary"], "status": quick(n)}
        for n, m in MODELS.metadata().items()
    ]
    if any(r["status"] is None for r in rows):  # plug-ins: their own status functions
        from headmech.models import list_models

        rows = list_models()
    w = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name'].ljust(w)}  {r['description']}  [{r['status']}]")
    return 0


def cmd_types(args: argparse.Namespace) -> int:
    """``headmech types`` (from the committed index where it holds: no import of torch)."""
    from headmech.core.registry import HEAD_TYPES

    types = HEAD_TYPES.metadata()
    w = max((len(n) for n in types), default=4)
    for name, m in types.items():
        extra = " (decoders only)" if m["causal_only"] else ""
        print(
            f"{name.ljust(w)}  {m['reference']}: {m['summary']}{extra}  "
            f"[threshold {m['threshold']:g}, probe {m['probe']}, task {m['task']}]"
        )
        if args.verbose and m["citation"]:
            print(f"{''.ljust(w)}  {m['citation']}")
    return 0


def cmd_classify(args: argparse.Namespace) -> int:
    """``headmech classify``: spec (every setting checked once) -> load -> run -> save."""
    from headmech.classification.spec import ClassifySpec

    check_run(args, "classify", sizes=False)  # fail fast, before loading (and torch)
    spec = ClassifySpec.from_args(args)
    fit_before_load(spec, args.model)
    from headmech.models import model_info
    from headmech.runs.resume import bind_weights

    units = staging(args, "classify", spec)
    t0 = time.perf_counter()
    loaded = load_model_of(args)
    bind_weights(units, loaded.model)  # --resume: the same weights
    t1 = time.perf_counter()
    fitted, skipped = spec.fit(loaded.model.tokenizer, model_info(loaded.model).causal)
    with resumable(args, units):
        try:
            catalog = fitted.run(loaded.model, units=units, progress=True)
        except IncompleteRunError as e:  # keep the finished types, then fail in one line
            save_partial(args, e, "catalog")
            raise
        t2 = time.perf_counter()
        out = save_result(args, "classify", catalog, loaded, units=units)
    (out / "catalog.partial.json").unlink(missing_ok=True)  # a stopped run's, now whole
    print(catalog.table())
    report.evidence(catalog)
    for line in report.skipped_lines({**skipped, **catalog.meta.get("skipped", {})}):
        print(line)
    files = " and ".join(str(out / f) for f in RESULT_FILES["classify"] if (out / f).exists())
    print(f"\nwrote {files} (load {t1 - t0:.1f}s, classify {t2 - t1:.1f}s)")
    print(
        f"next: python -m headmech.publish.site --catalog {out}   "
        f"(a browsable atlas of these heads: {out / 'site' / 'index.html'})"
    )
    return 0


def _task(model: Any, name: str) -> Any:
    """The task for the loaded model; refused if it is measured on prose the model's
    tokenizer cannot read (the toy model), naming the tasks that fit."""
    from headmech.core.registry import TASKS
    from headmech.tasks import get_task

    task = get_task(name, model)  # a causal-only task on an encoder: one-line error
    problem = V.prose_problem(model.tokenizer) if task.probe in V.PROSE_PROBES else None
    if problem is not None:
        fits = [n for n in TASKS.names() if TASKS.get(n)(model).probe not in V.PROSE_PROBES]
        raise InputError(
            f"task '{name}' is measured on English prose, but {problem}; "
            f"try --task {' or '.join(fits)}"
        )
    return task


def cmd_importance(args: argparse.Namespace) -> int:
    """``headmech importance``: spec (every setting checked once) -> load -> run -> save."""
    from headmech.core.registry import METHODS

    check_run(args, "importance", sizes=False)  # fail fast, before loading
    V.lookup(METHODS, args.method)  # from the registry's index: a typo fails before torch loads
    from headmech.attribution.spec import ImportanceSpec

    spec = ImportanceSpec.from_args(args)
    from headmech.runs.resume import bind_weights

    units = staging(args, "importance", spec)
    t0 = time.perf_counter()
    loaded = load_model_of(args)
    model = loaded.model
    bind_weights(units, model)  # --resume: the same weights
    _task(model, spec.task)
    with resumable(args, units):
        result = spec.run(model, progress=True, units=units)
        out = save_result(args, "importance", result, loaded, units=units)
    top = ", ".join(f"L{la}H{h}" for la, h in result.top(5))
    print(f"{result.method} / {result.task}: clean {result.metric_clean}  top heads: {top}")
    print(
        f"wrote {out / 'importance.json'} and {out / 'importance.png'} ({result.seconds:.1f}s, "
        f"{result.forward_equivalents:.1f} forward-pass equivalents; total {time.perf_counter() - t0:.1f}s)"
    )
    print(f"next: open {out / 'importance.png'}   (every head's score, layer by head)")
    return 0


def cmd_circuit(args: argparse.Namespace) -> int:
    """``headmech circuit``: spec (every setting checked once) -> load -> classify or read
    the catalog -> graph -> save."""
    check_run(args, "circuit", sizes=False)  # fail fast, before loading
    from headmech.circuits.spec import CircuitSpec

    spec = CircuitSpec.from_args(args)
    if spec.classify is not None:
        fit_before_load(spec.classify, args.model)
    from headmech.circuits import circuit_of
    from headmech.models import model_info

    given = catalog_file(args.catalog, args.model) if args.catalog is not None else None
    if given is not None and args.types is not None:
        names = [t.strip() for t in args.types.split(",")]
        if missing := [n for n in names if n not in given.types]:
            raise InputError(
                f"--types {','.join(missing)}: not in the --catalog (it has: "
                f"{', '.join(given.types) or 'no types'})"
            )
        given.types = {n: given.types[n] for n in names}
    loaded = load_model_of(args)
    model = loaded.model
    if given is not None:
        _check_catalog(given, model, args.force)
        catalog = given
    else:
        fitted, _ = spec.classify.fit(model.tokenizer, model_info(model).causal)
        catalog = fitted.run(model, progress=True)
    result = circuit_of(model, catalog, spec)
    out = save_result(args, "circuit", result, loaded)
    G = result.graph
    print(f"{G.number_of_nodes()} heads, {G.number_of_edges()} edges (score / random baseline):")
    for u, v, d in result.edges()[:40]:
        tu, tv = G.nodes[u]["types"] or "-", G.nodes[v]["types"] or "-"
        print(f"  {u} ({tu}) -{d['kind']}-> {v} ({tv})  {d['score']:.3f}  x{d['ratio']:.1f}")
    print("\nwrote " + ", ".join(str(out / f) for f in RESULT_FILES["circuit"]))
    print(f"next: open {out / 'circuit.png'}   (circuit.graphml opens in networkx or Gephi)")
    return 0


def _check_catalog(catalog: Any, model: Any, force: bool) -> None:
    """Refuse a ``--catalog`` of another shape (or, where the catalog records them, other
    weights unless ``--force``) than the loaded model."""
    if catalog is None:
        return
    if hasattr(catalog, "check_model"):
        catalog.check_model(model, force=force)
    elif (catalog.model.n_layers, catalog.model.n_heads) != (
        model.cfg.n_layers,
        model.cfg.n_heads,
    ):
        raise InputError(
            f"--catalog describes a model of {catalog.model.n_layers}x{catalog.model.n_heads} "
            f"heads, this one has {model.cfg.n_layers}x{model.cfg.n_heads}"
        )


def cmd_prune(args: argparse.Namespace) -> int:
    """``headmech prune``: spec (every setting checked once) -> load -> run -> save."""
    from headmech.core.registry import PRUNING_METHODS

    check_run(args, "prune", sizes=False)  # fail fast, before loading
    V.lookup(
        PRUNING_METHODS, args.method
    )  # from the registry's index: a typo fails before torch loads
    from headmech.pruning.spec import PruneSpec

    spec = PruneSpec.from_args(args)
    from headmech.runs.resume import bind_weights

    catalog = catalog_file(args.catalog, args.model) if args.catalog is not None else None
    units = staging(args, "prune", spec)
    t0 = time.perf_counter()
    loaded = load_model_of(args)
    model = loaded.model
    bind_weights(units, model)  # --resume: the same weights
    spec = dataclasses.replace(spec, task=_task(model, spec.task))
    _check_catalog(catalog, model, args.force)
    with resumable(args, units):
        result = spec.run(model, catalog=catalog, progress=True, units=units)
        out = save_result(args, "prune", result, loaded, units=units)
    report.pruning(result, catalog)
    print(f"wrote {out / 'pruning.json'} (total {time.perf_counter() - t0:.1f}s)")
    print(f"next: open {out / 'pruning.png'}   (the metric as heads are removed)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """``headmech serve``: the page in the foreground until Ctrl-C."""
    from headmech.cli.base import model_name

    model_name(args.model)  # a mistyped name: one line, before anything loads
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be between 0 and 65535, got {args.port}")
    from headmech.models import load_model
    from headmech.models.packages import first_load
    from headmech.publish.serve import start

    print(first_load(args.model) or f"loading {args.model} ...", file=sys.stderr)
    server = start(load_model(args.model), args.model, args.host, args.port)
    print(f"serving {args.model} at {server.url} (Ctrl-C to stop)", flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.stop()
    return 0
