"""The head atlas: a static website of the published catalogs (``catalog/site/``).

``python -m headmech.publish.site`` (``make site``; ``make catalog`` runs it at its end) builds,
from the files of ``catalog/<model>/`` only, plain HTML pages that open from the file
system, offline (no server, no CDN; one small script of our own for the attention views):

* ``index.html``: models x head types, each cell the number of labelled heads, and how to
  cite a catalog;
* ``models/<model>.html``: every type's heatmap, labelled heads with scores and 95%
  intervals, borderline heads, the validation effect against the controls, provenance;
* ``types/<type>.html``: the type's definition, citation and threshold, and its heads in
  every model side by side (share, depth);
* ``heads/<model>/<head>.html``: a labelled head's scores on every type, its attention on
  real probe text (hover or click a token), its most attended tokens, its ablation effect.

``--examples`` first records the attention examples (``catalog/<model>/examples.json``,
:func:`headmech.publish.examples.update_examples`) where they are missing or stale: that step
loads each model, seconds each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headmech.core.errors import HeadmechError
from headmech.publish.attention_view import VIEW_CSS, VIEW_JS
from headmech.publish.site.pages import (
    Model,
    head_page,
    load_models,
    model_types,
    provenance,
    type_info,
    verdict_counts,
)

__all__ = ["SiteSummary", "build_site", "main"]

HERE = Path(__file__).resolve().parent


@dataclass
class SiteSummary:
    """What :func:`build_site` wrote."""

    out: Path
    pages: int
    bytes: int


def _environment() -> Any:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = lambda x, d=3: "–" if x is None else f"{x:.{d}f}"
    return env


def _cite(m: Model) -> str:
    p = provenance(m)
    git = p["git"] or {}
    commit = git.get("commit", "") if isinstance(git, dict) else str(git)
    return (
        f"@misc{{headmech_{m.name.replace('-', '_')},\n"
        f"  title = {{headmech head catalog of {m.name}}},\n"
        f"  note = {{headmech {p['headmech']}; weights sha256 {p['weights']}; "
        f"made by: {p['command']}{'; commit ' + commit if commit else ''}}},\n"
        f"  howpublished = {{catalog/{m.name}/catalog.json}}\n}}"
    )


def _write(path: Path, text: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return 1


def _type_rows(models: list[Model], name: str) -> list[dict[str, Any]]:
    """Per model, the type's row of the atlas (None where the model has no such type)."""
    rows = []
    for m in models:
        if name not in m.types:
            skipped = provenance(m)["skipped"].get(name, "not classified")
            rows.append({"model": m.name, "skipped": skipped})
            continue
        (t,) = [t for t in model_types(m, m.folder) if t["name"] == name]
        rows.append({"model": m.name, "skipped": None, **t})
    return rows


def build_site(catalog_dir: str | os.PathLike, out: str | os.PathLike) -> SiteSummary:
    """Write the site for every ``catalog_dir/<model>/catalog.json`` into ``out`` (the
    pages are replaced; ``out/tutorials/`` is kept and linked)."""
    catalog_dir, out = Path(catalog_dir).resolve(), Path(out).resolve()
    models = load_models(catalog_dir)
    env = _environment()
    for sub in ("models", "types", "heads", "assets"):
        shutil.rmtree(out / sub, ignore_errors=True)
    css = (HERE / "static" / "site.css").read_text() + VIEW_CSS
    _write(out / "assets" / "site.css", css)
    _write(out / "assets" / "view.js", VIEW_JS)
    pages = 0
    types = sorted({t for m in models for t in m.types})
    tutorials = sorted(p.name for p in (out / "tutorials").glob("*.html"))
    common = {"models": models, "types": types}
    pages += _write(
        out / "index.html",
        env.get_template("index.html").render(
            root=".",
            tutorials=tutorials,
            cites={m.name: _cite(m) for m in models},
            verdicts=verdict_counts(models),
            **common,
        ),
    )
    for m in models:
        page_dir = out / "models"
        pages += _write(
            page_dir / f"{m.name}.html",
            env.get_template("model.html").render(
                root="..", m=m, rows=model_types(m, page_dir), prov=provenance(m), **common
            ),
        )
        for head in m.heads:
            pages += _write(
                out / "heads" / m.name / f"{head}.html",
                env.get_template("head.html").render(
                    root="../..", m=m, h=head_page(m, head), **common
                ),
            )
    for name in types:
        pages += _write(
            out / "types" / f"{name}.html",
            env.get_template("type.html").render(
                root="..", info=type_info(name), rows=_type_rows(models, name), **common
            ),
        )
    size = sum(
        p.stat().st_size for p in out.rglob("*") if p.is_file() and "tutorials" not in p.parts
    )
    return SiteSummary(out, pages, size)


def main(argv: list[str] | None = None) -> int:
    """``python -m headmech.publish.site [--catalog DIR] [--out DIR] [--examples]``."""
    parser = argparse.ArgumentParser(
        prog="python -m headmech.publish.site", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--catalog", default="catalog", help="folder of the published catalogs")
    parser.add_argument("--out", default=None, help="where to write the site (CATALOG/site)")
    parser.add_argument(
        "--examples", action="store_true", help="first record missing or stale attention examples"
    )
    args = parser.parse_args(argv)
    try:
        if args.examples:
            from headmech.publish.examples import update_examples

            for folder in sorted(Path(args.catalog).glob("*/catalog.json")):
                wrote = update_examples(folder.parent)
                print(f"{folder.parent.name}: examples {'recorded' if wrote else 'up to date'}")
        summary = build_site(args.catalog, args.out or Path(args.catalog) / "site")
    except HeadmechError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"site: {summary.pages} pages, {summary.bytes / 1e6:.2f} MB (tutorials apart) in "
        f"{summary.out}; open {summary.out / 'index.html'}"
    )
    return 0
