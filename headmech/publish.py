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
probe's scores, every type's validation, :mod:`headmech.resume`) are kept in
``catalog/<model>/.headmech-partial/publish/`` until its files are written, and
``make catalog CATALOG_ARGS=--resume`` (``--resume``) continues from them; ``--force``
starts over. ``--heatmaps`` redraws every ``heatmaps/`` from its ``catalog.json`` alone.

``--types a,b --update`` recomputes only those types' validations in the published
catalogs (:mod:`headmech.catalog_update`: the other types' entries keep their bytes,
the update is recorded in the provenance and ``run.json``) and regenerates the README;
``--types a,b --add`` adds types the published catalogs lack (a type registered since:
:func:`headmech.catalog_update.add_types`), with their heatmaps, and the README;
``--types a,b --rescore`` classifies and validates types the catalogs hold again (after
a change to their score), replacing their entries. ``--broad`` reads every type's labelled
and rejected heads on ordinary text (:mod:`headmech.broad`) into the catalogs' ``per_head``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headmech.compare import BEGIN, readme_block, replace_block
from headmech.errors import IncompleteRunError, InputError
from headmech.provenance import dumps

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.results import HeadCatalog, TypeResult

__all__ = [
    "CHECK",
    "FULL",
    "MODELS",
    "Size",
    "applicable_types",
    "build_catalog",
    "check_json",
    "main",
    "publish_model",
    "readme",
    "redraw_heatmaps",
]

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "minilm-l6", "toy-induction")
"""The bundled models published in ``catalog/``."""


@dataclass(frozen=True)
class Size:
    """Probe sizes and validation settings of one classification (CLI flag → value)."""

    n_sentences: int = 256  # prose sentences
    n_sequences: int = 32  # repeated random sequences
    context: tuple[int, ...] = (300, 700, 1100, 1500)  # needle haystack lengths
    validate: bool = True
    n_random: int = 5  # control sets per type
    n_boot: int = 200  # bootstrap resamples for score intervals (not a CLI flag)
    extra: dict[str, Any] = field(default_factory=dict)  # more ProbeOptions fields
    type_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per type: its arguments

    def probe_options(self) -> dict[str, Any]:
        """Keyword arguments for :func:`headmech.classify` (the CLI's defaults beside)."""
        from headmech.probes import ProbeOptions

        options = ProbeOptions(
            n_sentences=self.n_sentences,
            n_sequences=self.n_sequences,
            needle_lengths=self.context,
            **self.extra,
        )
        return {k: getattr(options, k) for k in options.__dataclass_fields__}

    def command(self, model: str) -> str:
        """The ``headmech classify`` command whose ``catalog.json`` this size reproduces."""
        flags = f"--n-sentences {self.n_sentences} --n-sequences {self.n_sequences} "
        flags += f"--context {','.join(map(str, self.context))}"
        if self.validate:
            flags += f" --validate --n-random {self.n_random}"
        return f"headmech classify {model} {flags}"


FULL: dict[str, Size] = {
    "smollm2-135m": Size(n_sentences=128, n_sequences=16),
    # half SmolLM2's prose: Gemma 3's forward, with its 262k-token unembedding and four norms
    # a block, costs 2-3x SmolLM2's per token on this CPU, and validation is most of the time
    "gemma3-270m": Size(n_sentences=64, n_sequences=16),
    # Qwen2.5-Coder-0.5B: 336 heads (24 x 14), a 151k-token unembedding and 4.9k-wide MLPs,
    # about 4x SmolLM2's forward: smaller probes and 3 control sets keep it under an hour
    "qwen2.5-coder-0.5b": Size(
        n_sentences=48, n_sequences=12, context=(300, 700, 1100), n_random=3
    ),
    "minilm-l6": Size(),
    "toy-induction": Size(),
}
"""The published sizes: the command line's defaults with validation; half the prose and
sequences for SmolLM2-135M (its run with validation: about an hour on 2 CPU cores), a quarter
of the prose and half the sequences for Gemma 3 270M, less again for Qwen2.5-Coder-0.5B."""

CHECK = Size(
    n_sentences=16,
    n_sequences=4,
    context=(120,),
    validate=False,
    n_boot=20,
    extra={"half_len": 16},
    type_options={"copy_suppression": {"n_tokens": 100}},
)
"""The small size of ``check.json``, regenerated by the tests: seconds a type, but for the
vocabulary-wide OV circuits (copy suppression over 100 word tokens, not 500: 140 s → 35 s
for Gemma 3's 262k-token vocabulary on one thread)."""


def _probe_problem(model: TransformerBridge, probe: str) -> str | None:
    """Why ``probe`` cannot be built for ``model`` at the check size, or None."""
    from headmech.errors import HeadmechError
    from headmech.probes import ProbeOptions, build_probe

    try:
        build_probe(probe, model, ProbeOptions(**CHECK.probe_options()))
    except HeadmechError as e:
        return f"its probe '{probe}' does not fit the model: {e}"
    return None


def applicable_types(model: TransformerBridge) -> tuple[list[str] | None, dict[str, str]]:
    """The head types to classify on ``model``, as ``headmech classify`` picks them.

    On a model whose tokenizer reads no English (the toy model), the types measured on
    prose are left out, and so is any type whose probe cannot be built for the model.

    Returns:
        ``(types, skipped)``: ``types`` is None (every registered type that fits the
        model's shape: :func:`headmech.classify`'s default) when the tokenizer reads
        English, else the names of the types kept; ``skipped`` maps every registered type
        left out to the reason.
    """
    from headmech.checks import PROSE_PROBES, prose_problem
    from headmech.heads import resolve_types
    from headmech.models import model_info

    info = model_info(model)
    problem = prose_problem(model.tokenizer)
    probes: dict[str, str | None] = {}
    kept: list[str] = []
    skipped: dict[str, str] = {}
    for t in resolve_types(None):
        reason = t.check_model(info)
        if reason is None and problem is not None and t.probe in PROSE_PROBES:
            reason = f"measured on prose, but {problem}"
        elif reason is None and problem is not None:
            if t.probe not in probes:
                probes[t.probe] = _probe_problem(model, t.probe)
            reason = probes[t.probe]
        if reason is None:
            kept.append(t.name)
        else:
            skipped[t.name] = reason
    return (None if problem is None else kept), skipped


def expected_types(model: TransformerBridge) -> list[str]:
    """The names of the types a published catalog of ``model`` must hold, sorted."""
    from headmech.heads import head_types

    _, skipped = applicable_types(model)
    return sorted(n for n in head_types() if n not in skipped)


def build_catalog(
    model: TransformerBridge,
    size: Size,
    *,
    progress: bool = False,
    only: Collection[str] | None = None,
) -> HeadCatalog:
    """Classify every applicable type at ``size``, or those of them named in ``only``
    (every sampler is seeded from the probe options, not the global generators: the same
    bytes every run)."""
    from headmech.classify import classify
    from headmech.heads import resolve_types
    from headmech.models import model_info

    names, skipped = applicable_types(model)
    if only is not None:
        names = [t.name for t in resolve_types(None) if t.name in only and t.name not in skipped]
    types: list[Any] | None = names
    info = model_info(model)
    runnable = [t for t in resolve_types(names) if t.check_model(info) is None]
    if any(t.name in size.type_options for t in runnable):  # those types with their options
        types = [type(t)(**size.type_options.get(t.name, {})) for t in runnable]
    return classify(
        model,
        types,
        validate=size.validate,
        n_random=size.n_random,
        n_boot=size.n_boot,
        progress=progress,
        **size.probe_options(),
    )


def check_json(model: TransformerBridge, only: Collection[str] | None = None) -> str:
    """The text of ``check.json``: the catalog at :data:`CHECK` size (of the types in
    ``only``: the part of the file those types write)."""
    return dumps(build_catalog(model, CHECK, only=only).to_json())


def _heatmap(name: str, r: TypeResult, model: str, path: Path) -> None:
    """One type's score as a seaborn heatmap on the fixed scale (:func:`headmech.plot.type_heatmap`:
    the threshold marked on the colour bar, labelled heads solid, borderline heads dashed)."""
    import matplotlib.pyplot as plt

    from headmech.plot import CRITERION, criterion, type_heatmap
    from headmech.results import score_ranges

    n_layers, n_heads = r.score.shape
    fig, ax = plt.subplots(figsize=(3.2 + 0.4 * n_heads, 2.0 + 0.22 * n_layers))
    title = f"{model}: {name} ({r.reference})\nlabelled: {criterion(r)}"
    type_heatmap(r, ax=ax, title=title, scale=score_ranges([name])[name])
    ax.title.set_fontsize(9)
    fig.text(0.5, 0.01, CRITERION.replace("; ", ";\n"), ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    # no "Software" entry: the PNG's bytes do not change with matplotlib's version
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def write_heatmaps(catalog: HeadCatalog, folder: Path) -> None:
    """``folder/<type>.png`` for every type of ``catalog``; stale PNGs are removed."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        if old.stem not in catalog.types:
            old.unlink()
    for name, r in catalog.types.items():
        _heatmap(name, r, catalog.model.name, folder / f"{name}.png")


def redraw_heatmaps(root: Path, names: list[str]) -> None:
    """``--heatmaps``: each model's ``heatmaps/`` drawn again from its committed
    ``catalog.json`` (no model runs: after a change to the figures alone)."""
    from headmech.results import HeadCatalog

    for name in names:
        write_heatmaps(HeadCatalog.load(root / name / "catalog.json"), root / name / "heatmaps")
        print(f"redrew {root / name / 'heatmaps'}", file=sys.stderr)


def _store(name: str, out: Path, *, resume: bool, force: bool) -> Any:
    """The staging store of one model's publication (checked like a command's, before the
    model loads: an unfinished run is continued with ``resume`` or dropped with ``force``)."""
    from headmech.resume import STAGING, Units, for_command

    if resume and Units(out / STAGING / "publish").read_manifest() is None:
        resume, force = False, True  # this model's run finished (or never started): afresh
    sizes = argparse.Namespace(model=name, catalog_size=repr(FULL[name]), check_size=repr(CHECK))
    return for_command(out, "publish", sizes, resume=resume, force=force)


def publish_model(
    name: str, root: Path, *, progress: bool = True, resume: bool = False, force: bool = True
) -> dict[str, Any]:
    """Classify one bundled model at :data:`FULL` and :data:`CHECK` size and write
    ``root/<name>/``. Returns the run record (also written as ``run.json``).

    Finished units are kept in ``root/<name>/.headmech-partial/publish/`` as they finish;
    ``resume`` continues from them (the same sizes, versions and weights: one line if not),
    else ``force`` drops them (without it, finding some is an error)."""
    import torch

    from headmech.models import load_model
    from headmech.resume import bind_weights, recording, scope

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
            check = check_json(model)
    t3, c3 = time.perf_counter(), time.process_time()
    (out / "catalog.json").write_text(dumps(catalog.to_json()))
    (out / "check.json").write_text(check)
    write_heatmaps(catalog, out / "heatmaps")
    _, skipped = applicable_types(model)
    record = {
        "model": name,
        "command": FULL[name].command(name),
        "check_command": CHECK.command(name)
        + " (score intervals from 20 resamples, copy suppression over 100 word tokens)",
        "skipped": skipped,
        "seconds": {
            "load": round(t1 - t0, 1),
            "classify": round(t2 - t1, 1),
            "check": round(t3 - t2, 1),
        },
        "cpu_seconds": round(c3 - c0, 1),  # all threads: above the wall time when idle
        "threads": torch.get_num_threads(),
    }
    (out / "run.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    (out / "catalog.partial.json").unlink(missing_ok=True)
    if store is not None:
        store.clear()
    return record


def readme(root: Path) -> str:
    """``catalog/README.md`` from the published folders under ``root``
    (:func:`headmech.catalog_readme.readme` of :data:`MODELS`)."""
    from headmech.catalog_readme import readme as markdown

    return markdown(root, MODELS)


def _update(names: list[str], types: list[str], out: Path) -> int:
    """``--types ... --update``: each model's validations of ``types`` recomputed
    (:func:`headmech.catalog_update.update_validations`), then the README."""
    from headmech.catalog_update import update_validations

    for name in names:
        size = FULL[name]
        command = f"python -m headmech.publish --models {name} --types {','.join(types)} --update"
        try:
            record = update_validations(
                name,
                out,
                types,
                probe_options=size.probe_options(),
                n_random=size.n_random,
                type_options=size.type_options,
                command=command,
            )
        except InputError as e:
            print(f"python -m headmech.publish: {e}", file=sys.stderr)
            return 1
        print(f"{name}: updated {', '.join(types)} {record['seconds']}", file=sys.stderr)
    _readmes(out)
    return 0


def _add(names: list[str], types: list[str], out: Path, rescore: bool = False) -> int:
    """``--types ... --add``: ``types`` added to each model's published catalog
    (:func:`headmech.catalog_update.add_types`), their heatmaps drawn, then the README;
    ``--rescore``: the same for types the catalog holds, their old entries replaced."""
    from headmech.catalog_update import add_types
    from headmech.models import load_model

    for name in names:
        verb = "--rescore" if rescore else "--add"
        command = f"python -m headmech.publish --models {name} --types {','.join(types)} {verb}"
        try:
            model = load_model(name)
            kept, skipped = applicable_types(model)
            record, full = add_types(
                model, out / name, types, skipped=skipped, named=kept is not None,
                size=FULL[name], check=CHECK, command=command, replace=rescore,
            )  # fmt: skip
        except InputError as e:
            print(f"python -m headmech.publish: {e}", file=sys.stderr)
            return 1
        for t, r in (full.types if full is not None else {}).items():
            _heatmap(t, r, name, out / name / "heatmaps" / f"{t}.png")
        done = "rescored" if rescore else "added"
        print(f"{name}: {done} {record[done]}, skipped {record['skipped']}", file=sys.stderr)
    _readmes(out)
    return 0


def _broad(names: list[str], out: Path) -> int:
    """``--broad``: each model's heads read on ordinary text
    (:func:`headmech.catalog_update.add_broad`), then the README."""
    from headmech.catalog_update import add_broad

    for name in names:
        try:
            record = add_broad(name, out, f"python -m headmech.publish --models {name} --broad")
        except InputError as e:
            print(f"python -m headmech.publish: {e}", file=sys.stderr)
            return 1
        print(f"{name}: broad behaviour in {record['wall_seconds']} s", file=sys.stderr)
    _readmes(out)
    return 0


def _readmes(out: Path) -> None:
    """``out/README.md``, and the cross-model table in the project's README beside it."""
    (out / "README.md").write_text(readme(out))
    print(f"wrote {out}/README.md", file=sys.stderr)
    front = out.resolve().parent / "README.md"  # the project's README, beside catalog/
    if front.is_file() and BEGIN in (text := front.read_text()):
        front.write_text(replace_block(text, readme_block(out)))
        print(f"updated the cross-model table in {front}", file=sys.stderr)


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
        return _update(names, types, args.out)
    if args.broad:
        return _broad(names, args.out)
    if args.add or args.rescore:
        return _add(names, types, args.out, rescore=args.rescore)
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
    _readmes(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
