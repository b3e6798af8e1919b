"""Changes to the published catalogs short of publishing them again: ``--update``,
``--add``, ``--rescore`` and ``--broad`` of ``python -m headmech.publish``, each model in
turn (:mod:`headmech.publish.update` does the work), then ``catalog/README.md`` and the
project README's cross-model table written again."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from headmech.core.errors import InputError
from headmech.publish import build as publish
from headmech.publish.compare import BEGIN, readme_block, replace_block
from headmech.publish.heatmaps import heatmap_png

__all__ = ["add", "broad", "readmes", "update"]


def _each_model(names: list[str], out: Path, step: Callable[[str], str]) -> int:
    """``step(name)`` for each model (printing what it says it did), then the READMEs;
    a one-line error and exit status 1 at the first model whose step refuses."""
    for name in names:
        try:
            print(f"{name}: {step(name)}", file=sys.stderr)
        except InputError as e:
            print(f"python -m headmech.publish: {e}", file=sys.stderr)
            return 1
    readmes(out)
    return 0


def update(names: list[str], types: list[str], out: Path) -> int:
    """``--types ... --update``: each model's validations of ``types`` recomputed
    (:func:`headmech.publish.update.update_validations`), then the README."""
    from headmech.publish.update import update_validations

    def step(name: str) -> str:
        size = publish.FULL[name]
        record = update_validations(
            name, out, types, probe_options=size.probe_options(), n_random=size.n_random,
            control_tokens=size.control_tokens,
            type_options=size.type_options, alone=size.alone, command=_command(name, types, "--update"),
        )  # fmt: skip
        return f"updated {', '.join(types)} {record['seconds']}"

    return _each_model(names, out, step)


def add(names: list[str], types: list[str], out: Path, rescore: bool = False) -> int:
    """``--types ... --add``: ``types`` added to each model's published catalog
    (:func:`headmech.publish.addition.add_types`), their heatmaps drawn, then the README;
    ``--rescore``: the same for types the catalog holds, their old entries replaced."""
    from headmech.models import load_model
    from headmech.publish.addition import add_types

    def step(name: str) -> str:
        model = load_model(name)
        kept, skipped = publish.applicable_types(model)
        command = _command(name, types, "--rescore" if rescore else "--add")
        record, full = add_types(
            model, out / name, types, skipped=skipped, named=kept is not None,
            size=publish.FULL[name], check=publish.CHECK, command=command, replace=rescore,
        )  # fmt: skip
        for t, r in full.items():
            heatmap_png(t, r, name, out / name / "heatmaps" / f"{t}.png")
        done = "rescored" if rescore else "added"
        return f"{done} {record[done]}, skipped {record['skipped']}"

    return _each_model(names, out, step)


def broad(names: list[str], out: Path) -> int:
    """``--broad``: each model's heads read on ordinary text
    (:func:`headmech.publish.update.add_broad`), then the README."""
    from headmech.publish.update import add_broad

    def step(name: str) -> str:
        record = add_broad(name, out, f"python -m headmech.publish --models {name} --broad")
        return f"broad behaviour in {record['wall_seconds']} s"

    return _each_model(names, out, step)


def _command(name: str, types: list[str], verb: str) -> str:
    return f"python -m headmech.publish --models {name} --types {','.join(types)} {verb}"


def readmes(out: Path) -> None:
    """``out/README.md``, the cross-model table in the project's README beside it, and in
    its docs/findings.md the published agreement matrices and the cross-scale table (once
    both sizes of the family are published)."""
    from headmech.publish import agreement, scale

    (out / "README.md").write_text(publish.readme(out))
    print(f"wrote {out}/README.md", file=sys.stderr)
    front = out.resolve().parent / "README.md"  # the project's README, beside catalog/
    if front.is_file() and BEGIN in (text := front.read_text()):
        front.write_text(replace_block(text, readme_block(out)))
        print(f"updated the cross-model table in {front}", file=sys.stderr)
    findings = out.resolve().parent / "docs" / "findings.md"
    blocks = [
        ("agreement matrices", agreement.DEFS_BEGIN, agreement.findings_block(out),
         agreement.replace_defs_block),
        ("cross-scale table", scale.SCALE_BEGIN, scale.findings_block(out),
         scale.replace_scale_block),
    ]  # fmt: skip
    for what, begin, block, replace in blocks:
        if block is not None and findings.is_file() and begin in (text := findings.read_text()):
            findings.write_text(replace(text, block))
            print(f"updated the {what} in {findings}", file=sys.stderr)
