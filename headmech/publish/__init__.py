"""Published catalogs of the bundled models: the repository's ``catalog/`` folder.

For each bundled model, ``make catalog`` (``python -m headmech.publish``) classifies the
heads for every registered head type that fits the model, with validation, and writes
``catalog/<model>/``: ``catalog.json`` (the bytes ``headmech classify MODEL --validate``
writes at the same sizes; each type's ``details.validation`` holds the labelled-vs-control
ablation effects), ``heatmaps/<type>.png`` (the type's per-head score, labelled heads
outlined), ``check.json`` (the same classification at a small size, without validation,
that the test suite regenerates and compares: labels exactly, numbers to 1e-4) and ``run.json`` (the command,
the types skipped and why, seconds). ``catalog/README.md`` tabulates every model's labelled
heads and validation effects, built from those files.

An hour of work is not lost to a crash or Ctrl-C: each model's finished units (every
probe's scores, every type's validation, :mod:`headmech.runs.resume`) are kept in
``catalog/<model>/.headmech-partial/publish/`` until its files are written, and
``make catalog CATALOG_ARGS=--resume`` (``--resume``) continues from them; ``--force``
starts over. ``--heatmaps`` redraws every ``heatmaps/`` from its ``catalog.json`` alone.

``--types a,b --update`` recomputes only those types' validations in the published
catalogs (:mod:`headmech.publish.update`: the other types' entries keep their bytes,
the update is recorded in the provenance and ``run.json``) and regenerates the README;
``--types a,b --add`` adds types the published catalogs lack (a type registered since:
:func:`headmech.publish.addition.add_types`), with their heatmaps, and the README;
``--types a,b --rescore`` classifies and validates types the catalogs hold again (after
a change to their score), replacing their entries. ``--broad`` reads every type's labelled
and rejected heads on ordinary text (:mod:`headmech.classification.broad`) into the catalogs' ``per_head``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from headmech.core.errors import IncompleteRunError, InputError
from headmech.publish.build import (
    CHECK,
    FULL,
    MODELS,
    Size,
    applicable_types,
    build_catalog,
    check_json,
    expected_types,
    readme,
)
from headmech.publish.heatmaps import redraw_heatmaps, write_heatmaps
from headmech.runs.provenance import dumps

__all__ = [
    "CHECK",
    "FULL",
    "MODELS",
    "Size",
    "applicable_types",
    "build_catalog",
    "check_json",
    "expected_types",
    "main",
    "publish_model",
    "readme",
]


def _store(name: str, out: Path, *, resume: bool, force: bool) -> Any:
    """The staging store of one model's publication (checked like a command's, before the
    model loads: an unfinished run is continued with ``resume`` or dropped with ``force``)."""
    from headmech.runs.resume import STAGING, Units, for_command

    if resume and Units(out / STAGING / "publish").read_manifest() is None:
        resume, force = False, True  # this model's run finished (or never started): afresh
    sizes = {"catalog_size": repr(FULL[name]), "check_size": repr(CHECK), "model": name}
    return for_command(out, "publish", sizes, resume=resume, force=force)


def publish_model(
    name: str, root: Path, *, progress: bool = True, resume: bool = False, force: bool = True
) -> dict[str, Any]:
    """Classify one bundled model at :data:`FULL` and :data:`CHECK` size and write
    ``root/<name>/``. Returns the run record (also written as ``run.json``).

    Finished units are kept in ``root/<name>/.headmech-partial/publish/`` as they finish;
    ``resume`` continues from them (the same sizes, versions and weights: one line if not),
    else ``force`` drops them (without it, finding some is an error)."""
    from headmech.models import load_model
    from headmech.runs.resume import bind_weights, recording, scope

    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    store = _store(name, out, resume=resume, force=force)
    t0, c0 = time.perf_counter(), time.process_time()
    model = load_model(name)
    bind_weights(store, model)
    t1 = time.perf_counter()
    with recording(store):
        try:
            with scope("catalog"):
                catalog = build_catalog(model, FULL[name], progress=progress)
        except IncompleteRunError as e:  # an hour of work: keep the finished types
            (out / "catalog.partial.json").write_text(dumps(e.partial.to_json()))  # type: ignore[attr-defined]
            raise
        t2 = time.perf_counter()
        with scope("check"):
            check = check_json(model, size=CHECK)
    t3, c3 = time.perf_counter(), time.process_time()
    (out / "catalog.json").write_text(dumps(catalog.to_json()))
    (out / "check.json").write_text(check)
    write_heatmaps(catalog, out / "heatmaps")
    seconds = {"load": t1 - t0, "classify": t2 - t1, "check": t3 - t2, "cpu": c3 - c0}
    record = _run_record(name, model, catalog, seconds)
    (out / "run.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    (out / "catalog.partial.json").unlink(missing_ok=True)
    if store is not None:
        store.clear()
    return record


def _run_record(name: str, model: Any, catalog: Any, seconds: dict[str, float]) -> dict[str, Any]:
    """``run.json``: the commands, the types skipped and why, and what the run cost."""
    import torch

    _, skipped = applicable_types(model)
    return {
        "model": name,
        "command": FULL[name].command(name),
        # per-type arguments the command line does not set (1.5B: fewer function-vector prompts)
        **({"type_options": FULL[name].type_options} if FULL[name].type_options else {}),
        "check_command": CHECK.command(name)
        + " (score intervals from 20 resamples, copy suppression over 100 word tokens)",
        "skipped": skipped,
        "seconds": {k: round(seconds[k], 1) for k in ("load", "classify", "check")},
        "validation_seconds": catalog.meta.get("validation_seconds", {}),
        # the process's peak resident memory after each type's validation (MB, the peak so far)
        "validation_peak_mb": catalog.meta.get("validation_peak_mb", {}),
        "cpu_seconds": round(seconds["cpu"], 1),  # all threads: above the wall time when idle
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # when it finished (UTC)
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m headmech.publish", description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--out", default="catalog", type=Path, help="the catalog folder")
    again = parser.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue the stopped runs from their finished units"
    )
    again.add_argument(
        "--force", action="store_true", help="start over, dropping a stopped run's finished units"
    )
    parser.add_argument(
        "--heatmaps", action="store_true", help="only redraw heatmaps/ from each catalog.json"
    )
    parser.add_argument(
        "--types", default="", help="comma-separated types (--update, --add, --rescore)"
    )
    change = parser.add_mutually_exclusive_group()
    change.add_argument(
        "--update",
        action="store_true",
        help="recompute only --types' validations in the published catalogs",
    )
    change.add_argument(
        "--add", action="store_true", help="add --types, which the published catalogs lack"
    )
    change.add_argument(
        "--broad",
        action="store_true",
        help="read every type's heads on ordinary text (per_head broad_share) into the catalogs",
    )
    change.add_argument(
        "--rescore",
        action="store_true",
        help="classify and validate --types again (a changed score), replacing their entries",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m headmech.publish [--models a,b] [--out catalog]``."""
    from headmech.publish import maintain

    parser = _parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        parser.error(f"unknown model(s) {', '.join(unknown)}; have {', '.join(MODELS)}")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if (args.update or args.add or args.rescore) != bool(types):
        parser.error("--update, --add and --rescore need --types, and --types needs one of them")
    if args.update:
        return maintain.update(names, types, args.out)
    if args.broad:
        return maintain.broad(names, args.out)
    if args.add or args.rescore:
        return maintain.add(names, types, args.out, rescore=args.rescore)
    if args.heatmaps:
        redraw_heatmaps(args.out, names)
        return 0
    try:
        for name in names:  # every model's staging area is checked before any work
            _store(name, args.out / name, resume=args.resume, force=args.force)
    except InputError as e:
        parser.error(str(e).replace("--resume", "--resume (make catalog CATALOG_ARGS=--resume)", 1))
    for name in names:
        print(f"== {name}", file=sys.stderr)
        try:
            record = publish_model(name, args.out, resume=args.resume, force=args.force)
        except (KeyboardInterrupt, IncompleteRunError) as e:
            cause = e.__cause__ if isinstance(e, IncompleteRunError) else e
            print(
                f"python -m headmech.publish: {name} stopped ({e or 'interrupted'}); its finished "
                f"units are kept in {args.out / name / '.headmech-partial'}: continue with "
                f"make catalog CATALOG_MODELS={name} CATALOG_ARGS=--resume",
                file=sys.stderr,
            )
            return 130 if isinstance(cause, KeyboardInterrupt) else 1
        print(f"{name}: {record['seconds']}", file=sys.stderr)
    maintain.readmes(args.out)
    return 0
