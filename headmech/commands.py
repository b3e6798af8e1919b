"""The ``headmech`` subcommands: load, run, print a summary, save the result's own files.

Each command validates its arguments before loading the model (a bad name fails in a
second, not after a minute of loading) and writes its files through the result object's
``save`` (the same files a notebook user gets).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from headmech import report
from headmech import checks as V
from headmech.errors import IncompleteRunError, InputError

__all__ = ["cmd_circuit", "cmd_classify", "cmd_importance", "cmd_models", "cmd_prune", "cmd_types"]


RESULT_FILES: dict[str, tuple[str, ...]] = {
    "classify": ("catalog.json", "heatmap.png", "run.json"),
    "importance": ("importance.json", "importance.png", "run.json"),
    "prune": ("pruning.json", "pruning.png", "run.json"),
    "circuit": ("circuit.graphml", "circuit.json", "circuit.png", "run.json"),
    "discover": ("discovery.json", "discovery.png", "run.json"),  # + cluster_<id>.png
}


def _check_run(args: argparse.Namespace, command: str) -> None:
    """The checks every analysis command shares, cheapest first, before the model loads:
    sizes, seed, device, output folder, model name."""
    for name in ("n_sentences", "n_sequences", "batch_size"):
        V.count(getattr(args, name, None), "--" + name.replace("_", "-"))
    V.count(getattr(args, "half_len", None), "--half-len", minimum=2)
    V.seed(args.seed)
    if hasattr(args, "batch_size"):
        _probe_options(args)  # --context / --depths and the options' own checks
    V.device(args.device)
    V.out_dir(args.out, RESULT_FILES[command], args.force)
    V.model_name(args.model)


def _load(args: argparse.Namespace) -> Any:
    """The model of ``args.model`` on ``args.device`` in ``args.dtype`` (after every check
    has passed)."""
    from headmech import distributed
    from headmech.models import load_model

    # under torchrun: join the process group; only rank 0 prints and writes
    device = distributed.init_from_env(args.device)
    if not distributed.is_main():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (this process's own output)
    print(f"loading {args.model} ...", file=sys.stderr)
    args.started = time.perf_counter()
    where = {k: getattr(args, k, None) for k in ("device_map", "max_memory", "offload_folder")}
    model = load_model(args.model, device=device, dtype=getattr(args, "dtype", None), **where)
    args.loaded = time.perf_counter()
    return model


def _save(
    args: argparse.Namespace,
    command: str,
    result: Any,
    files: tuple[str, ...] = (),
    units: Any = None,
) -> Path:
    """Run ``result.save(folder)`` on a temporary folder next to ``--out`` and write the
    run record (``run.json``: seconds, tokens/s, peak memory); move the files into ``--out``
    only if it succeeds (see :func:`headmech.checks.staged_output`); ``files``: more
    files of an earlier result that ``--force`` removes; ``units``: the run's finished
    units (:mod:`headmech.resume`), removed once the result is in place."""
    import json

    from headmech import distributed
    from headmech.progress import run_record

    if not distributed.is_main():  # under torchrun rank 0 alone writes
        return Path(args.out)
    now = time.perf_counter()
    record = run_record(command, result, args.loaded - args.started, now - args.started)
    try:
        with V.staged_output(args.out, RESULT_FILES[command] + files, args.force) as tmp:
            result.save(tmp)
            (tmp / "run.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    except OSError as e:  # a full disk, a folder made read-only meanwhile: one line
        raise InputError(f"cannot write the results into {args.out}: {e.strerror or e}") from e
    if units is not None:
        units.clear()
    return Path(args.out)


def _staging(args: argparse.Namespace, command: str) -> Any:
    """The run's store of finished units in ``--out`` (:mod:`headmech.resume`), checked
    before the model loads: ``--resume`` needs a stopped run of the same arguments; an
    unfinished run is not started over without ``--force``."""
    from headmech.resume import for_command

    resume = bool(getattr(args, "resume", False))
    return for_command(args.out, command, args, resume=resume, force=args.force)


@contextlib.contextmanager
def _resumable(args: argparse.Namespace, units: Any) -> Iterator[None]:
    """A stopped run with finished units says, in its one line, how to continue it
    (Ctrl-C: :class:`IncompleteRunError`, exit status 130)."""
    from headmech.resume import resume_command

    def hint() -> str:
        argv = getattr(args, "argv", None)
        how = resume_command(argv) if argv else "the same command with --resume"
        return f"{units.count()} finished unit(s) kept in {units.folder}; continue with: {how}"

    try:
        yield
    except IncompleteRunError as e:
        if units is not None and units.count():
            e.args = (f"{e.args[0]}; {hint()}",)
        raise
    except KeyboardInterrupt as e:
        if units is None or not units.count():
            raise
        raise IncompleteRunError(f"interrupted; {hint()}", None) from e


def _save_partial(args: argparse.Namespace, e: IncompleteRunError, stem: str) -> None:
    """Write a stopped run's finished part as ``--out/<stem>.partial.json`` (the result's
    JSON, ``meta.incomplete`` saying why it stopped) and name the file in the error."""
    from headmech import distributed
    from headmech.provenance import dumps

    if not distributed.is_main():
        return
    out = Path(args.out)
    path = out / f"{stem}.partial.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(e.partial.to_json()))  # type: ignore[attr-defined]
    except OSError as err:
        e.args = (f"{e.args[0]}; could not write the finished part to {path}: {err}",)
        return
    e.args = (f"{e.args[0]}; the finished part is in {path}",)


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


def _fit_types(
    tokenizer: Any, names: list[str] | None, sentences: list[str] | None, causal: bool | None
) -> tuple[list[Any] | None, dict[str, str]]:
    """The head types to run and those skipped with a reason: types measured on English
    prose are refused (named by ``--types``) or skipped (the default: all types) when the
    tokenizer cannot read the prose, e.g. the toy model's ``t0``..``t255`` vocabulary."""
    from headmech.heads import resolve_types

    types = resolve_types(names)
    prose = [t.name for t in types if t.probe in V.PROSE_PROBES]
    problem = V.prose_problem(tokenizer, sentences) if prose else None
    if problem is None:
        return names, {}
    others = [t for t in resolve_types(None) if t.probe not in V.PROSE_PROBES]
    if names is not None:
        raise InputError(
            f"head type(s) {', '.join(prose)} are measured on English prose, but {problem}; "
            f"try --types {','.join(t.name for t in others)}"
        )
    kept = [t for t in others if not (t.causal_only and causal is False)]
    if not kept:
        raise InputError(f"no head type fits: {problem}")
    return kept, {name: f"measured on prose, but {problem}" for name in prose}


def _check_classify(
    args: argparse.Namespace, command: str
) -> tuple[list[str] | None, list[str] | None]:
    """``headmech classify`` (and ``circuit``) input checks before loading: the run options,
    ``--types``, ``--n-random``, ``--corpus``; returns the type names and the sentences."""
    _check_run(args, command)
    names = V.head_type_names(args.types) if args.types is not None else None
    if getattr(args, "n_random", None) is not None:
        V.count(args.n_random, "--n-random")
        if args.n_random > V.MAX_N_RANDOM:
            raise InputError(
                f"--n-random must be at most {V.MAX_N_RANDOM} (each control set is one more "
                f"ablated run of the task), got {args.n_random}"
            )
        if not args.validate:
            V.warn("--n-random is ignored without --validate")
    corpus = getattr(args, "corpus", None)
    sentences = V.corpus_file(corpus) if corpus is not None else None
    if hasattr(args, "n_sentences"):
        V.probe_options(_probe_options(args))
    source = _model_source(args.model)
    if source is not None and source.tokenizer is not None:  # e.g. a toy not trained yet
        _fit_types(source.tokenizer(), names, sentences, None)
    return names, sentences


def _model_source(name: str) -> Any:
    """The registered :class:`headmech.models.ModelSource` of ``name``, or None."""
    from headmech.registry import MODELS

    return MODELS.get(name) if name in MODELS else None


def cmd_classify(args: argparse.Namespace) -> int:
    """``headmech classify``."""
    from headmech.classify import classify
    from headmech.models import model_info
    from headmech.resume import bind_weights

    names, sentences = _check_classify(args, "classify")  # fail fast, before loading
    units = _staging(args, "classify")
    t0 = time.perf_counter()
    model = _load(args)
    bind_weights(units, model)  # --resume: the same weights
    t1 = time.perf_counter()
    types, skipped = _fit_types(model.tokenizer, names, sentences, model_info(model).causal)
    options = dict(vars(_probe_options(args)), corpus=args.corpus)
    n_random = 5 if args.n_random is None else args.n_random
    with _resumable(args, units):
        try:
            catalog = classify(
                model, types, validate=args.validate, n_random=n_random, progress=True,
                units=units, **options,
            )  # fmt: skip
        except IncompleteRunError as e:  # keep the finished types, then fail in one line
            _save_partial(args, e, "catalog")
            raise
        t2 = time.perf_counter()
        out = _save(args, "classify", catalog, units=units)
    (out / "catalog.partial.json").unlink(missing_ok=True)  # a stopped run's, now whole
    print(catalog.table())
    report.evidence(catalog)
    for name, reason in {**skipped, **catalog.meta.get("skipped", {})}.items():
        print(f"skipped {name}: {reason}")
    files = " and ".join(str(out / f) for f in RESULT_FILES["classify"] if (out / f).exists())
    print(f"\nwrote {files} (load {t1 - t0:.1f}s, classify {t2 - t1:.1f}s)")
    return 0


def _method_options(registry: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs, typed by the method's options dataclass and checked,
    plus ``seed`` where the method takes one."""
    from dataclasses import fields

    from headmech.registry import parse_options

    entry = V.lookup(registry, name)
    options = V.method_options(parse_options(entry, args.option or []))
    if entry.options is not None and "seed" in {f.name for f in fields(entry.options)}:
        options.setdefault("seed", args.seed)
    return options


def _task(model: Any, name: str) -> Any:
    """The task for the loaded model; refused if it is measured on prose the model's
    tokenizer cannot read (the toy model), naming the tasks that fit."""
    from headmech.registry import TASKS
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


def _check_method(args: argparse.Namespace, registry: Any, command: str) -> dict[str, Any]:
    """``importance`` / ``prune`` checks before loading: run options, method, options, task."""
    from headmech.registry import TASKS

    _check_run(args, command)
    options = _method_options(registry, args.method, args)
    if args.task is None:
        from headmech.registry import MODELS

        args.task = MODELS.get(args.model).default_task if args.model in MODELS else "lm"
    V.lookup(TASKS, args.task)
    V.probe_options(_probe_options(args))
    return options


def cmd_importance(args: argparse.Namespace) -> int:
    """``headmech importance``."""
    from headmech.attribution import importance
    from headmech.registry import METHODS
    from headmech.resume import bind_weights

    options = _check_method(args, METHODS, "importance")  # fail fast, before loading
    units = _staging(args, "importance")
    t0 = time.perf_counter()
    model = _load(args)
    bind_weights(units, model)  # --resume: the same weights
    _task(model, args.task)
    if options.get("baseline") is not None and options["baseline"] >= int(model.cfg.d_vocab):
        raise InputError(f"option 'baseline' is a token id below {model.cfg.d_vocab}")
    with _resumable(args, units):
        result = importance(
            model, args.method, args.task, probe_options=_probe_options(args), progress=True,
            units=units, **options,
        )  # fmt: skip
        out = _save(args, "importance", result, units=units)
    top = ", ".join(f"L{la}H{h}" for la, h in result.top(5))
    print(f"{result.method} / {result.task}: clean {result.metric_clean}  top heads: {top}")
    print(
        f"wrote {out / 'importance.json'} and {out / 'importance.png'} ({result.seconds:.1f}s, "
        f"{result.forward_equivalents:.1f} forward-pass equivalents; total {time.perf_counter() - t0:.1f}s)"
    )
    return 0


def cmd_circuit(args: argparse.Namespace) -> int:
    """``headmech circuit``."""
    from headmech.circuits import circuit
    from headmech.classify import classify
    from headmech.models import model_info

    kinds = V.kinds(args.kinds)
    V.count(args.top_k, "--top-k")
    names, _ = _check_classify(args, "circuit")  # fail fast, before loading
    model = _load(args)
    types, _ = _fit_types(model.tokenizer, names, None, model_info(model).causal)
    catalog = classify(model, types, progress=True, seed=args.seed)
    result = circuit(model, catalog, kinds=kinds, top_k=args.top_k)  # type: ignore[arg-type]
    out = _save(args, "circuit", result)
    G = result.graph
    print(f"{G.number_of_nodes()} heads, {G.number_of_edges()} edges (score / random baseline):")
    for u, v, d in result.edges()[:40]:
        tu, tv = G.nodes[u]["types"] or "-", G.nodes[v]["types"] or "-"
        print(f"  {u} ({tu}) -{d['kind']}-> {v} ({tv})  {d['score']:.3f}  x{d['ratio']:.1f}")
    print("\nwrote " + ", ".join(str(out / f) for f in RESULT_FILES["circuit"]))
    return 0


_METHOD_FLAGS = {"michel": ("fraction", "steps"), "l0": ("lams", "l0_steps")}


def _prune_options(args: argparse.Namespace) -> dict[str, Any]:
    """The pruning method's options: ``-o`` pairs, then the method's own flags (checked;
    a flag of another method warns that it is ignored)."""
    from headmech.registry import PRUNING_METHODS

    options = _check_method(args, PRUNING_METHODS, "prune")
    for method, flags in _METHOD_FLAGS.items():
        given = [f for f in flags if getattr(args, f) is not None]
        if given and args.method != method:
            flag = ", ".join("--" + f.replace("_", "-") for f in given)
            V.warn(f"{flag}: only for --method {method}, ignored by --method {args.method}")
    if args.method == "michel":
        fraction = 0.1 if args.fraction is None else args.fraction
        options.setdefault("fraction", V.fraction(fraction, "--fraction"))
        options.setdefault("steps", V.count(args.steps, "--steps"))
    elif args.method == "l0":
        lams = "0.01,0.1,1,3,10" if args.lams is None else args.lams
        options.setdefault("lams", V.lams(lams))
        steps = 100 if args.l0_steps is None else args.l0_steps
        options.setdefault("steps", V.count(steps, "--l0-steps"))
    return options


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
    """``headmech prune``."""
    from headmech.pruning import prune
    from headmech.resume import bind_weights

    options = _prune_options(args)  # fail fast, before loading
    catalog = V.catalog_file(args.catalog, args.model) if args.catalog is not None else None
    units = _staging(args, "prune")
    t0 = time.perf_counter()
    model = _load(args)
    bind_weights(units, model)  # --resume: the same weights
    task = _task(model, args.task)
    _check_catalog(catalog, model, args.force)
    with _resumable(args, units):
        result = prune(
            model, args.method, task, catalog=catalog, probe_options=_probe_options(args),
            progress=True, units=units, **options,
        )  # fmt: skip
        out = _save(args, "prune", result, units=units)
    report.pruning(result, catalog)
    print(f"wrote {out / 'pruning.json'} (total {time.perf_counter() - t0:.1f}s)")
    return 0


def _probe_options(args: argparse.Namespace) -> Any:
    """ProbeOptions from the run options; unset sizes keep the library defaults."""
    from headmech.probes import ProbeOptions

    sizes = {k: getattr(args, k, None) for k in ("n_sentences", "n_sequences", "half_len")}
    if getattr(args, "context", None) is not None:
        sizes["needle_lengths"] = V.number_list(args.context, "--context", int, low=1)
    if getattr(args, "depths", None) is not None:
        sizes["needle_depths"] = V.number_list(args.depths, "--depths", float, low=0, high=1)
    return ProbeOptions(
        seed=args.seed,
        batch_size=args.batch_size,
        **{k: v for k, v in sizes.items() if v is not None},
    )


# --- kv-plan (headmech.kv) -------------------------------------------------------------

__all__ += ["cmd_kv_plan"]


def _kv_plan_target(path: str, force: bool) -> Path:
    """``kv-plan --out``: a ``.json`` file, or a folder that gets ``plan.json``."""
    if not path.strip():
        raise InputError("--out is empty")
    p = Path(path)
    target = p if p.suffix == ".json" else p / "plan.json"
    if target.is_dir():
        raise InputError(f"--out {target} is a folder, not a file")
    if target.exists() and not force:
        raise InputError(f"--out {target} already exists; use --force to overwrite")
    V.out_dir(str(target.parent), (), True)  # creatable and writable
    return target


def _parse_heads(text: str) -> list[Any]:
    """``--heads L18H6,L20H6`` (or ``18:6,20:6``) as head indices."""
    import re

    from headmech.heads import HeadIndex

    out = []
    for item in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"L(\d+)H(\d+)|(\d+):(\d+)", item, re.I)
        if m is None:
            raise InputError(f"--heads {text!r}: expected heads like L18H6 or 18:6, got {item!r}")
        a, b = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        out.append(HeadIndex(int(a), int(b)))
    return out


def _check_kv_plan(args: argparse.Namespace) -> tuple[Path, Any, Any]:
    """``kv-plan`` checks before loading: sizes, budget, the plan's source, ``--out``."""
    V.count(args.sinks, "--sinks", minimum=0)
    V.count(args.window, "--window")
    V.seed(args.seed)
    if args.budget is not None:
        V.fraction(args.budget, "--budget")
        if args.context is None or args.catalog is None:
            raise InputError("--budget needs --catalog and --context (the length it counts at)")
    V.count(args.context, "--context")
    if (args.catalog is None) == (args.heads is None):
        raise InputError("give exactly one of --catalog DIR and --heads L18H6,...")
    heads = _parse_heads(args.heads) if args.heads is not None else None
    types = V.head_type_names(args.types)
    catalog = V.catalog_file(args.catalog, args.model) if args.catalog is not None else None
    target = _kv_plan_target(args.out, args.force)
    V.device(args.device)
    V.model_name(args.model)
    return target, heads or catalog, types


def cmd_kv_plan(args: argparse.Namespace) -> int:
    """``headmech kv-plan``."""
    import uuid

    import torch

    from headmech.kv import KVPlan

    target, source, types = _check_kv_plan(args)  # fail fast, before loading
    model = _load(args)
    size = {"sinks": args.sinks, "window": args.window}
    if isinstance(source, list):
        plan = KVPlan.from_heads(model, source, **size, source={"kind": "heads"})
    else:
        plan = KVPlan.from_catalog(
            source, model, types, **size, budget=args.budget, context=args.context,
            fill=args.fill, force=args.force,
        )  # fmt: skip
        plan.source["catalog"] = str(args.catalog)
    if args.random:
        plan = plan.random_matched(torch.Generator().manual_seed(args.seed), draw=args.seed)
    tmp = target.with_name(f"{V.TMP_PREFIX}{uuid.uuid4().hex[:8]}-{target.name}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        plan.save(tmp)
        os.replace(tmp, target)
    except OSError as e:
        raise InputError(f"cannot write {target}: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    layers = sorted({la for la, _ in plan.full_heads()})
    print(f"{plan}; full KV heads in layers {', '.join(map(str, layers)) or 'none'}")
    fractions = ", ".join(f"{c:,}: {plan.kv_fraction(c):.1%}" for c in (2048, 4096, 8192))
    print(f"KV cache kept at {fractions} tokens\nwrote {target}")
    return 0
