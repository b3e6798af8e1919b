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
* ``heads/<model>/<head>.html``: every head (labelled or not): its score and the verdict on
  every type, its attention on its own type's probe and on ordinary text (hover a token,
  click to pin it), its most attended tokens, its ablation effect;
* ``layers/<model>/L<n>.html``: every head of a layer on one recorded text (pick a query);
* ``compare.html``: two heads side by side (``?a=<model>/L3H4&b=<model>/L5H1``); the index
  searches heads by model, head and type; heatmaps are clickable (a cell: the head's page);
* ``tutorials/*.html`` (rendered by the tests): framed with the atlas's navigation and the
  probe size they ran at;
* ``data/<model>/``: copies of ``catalog.json``, ``examples.json``, ``run.json`` and
  ``heatmaps/*.png``, so the folder is self-contained (copy it anywhere; downloads link here);
  ``assets/atlas.js``: the scores and verdicts the search, compare view and heatmaps read.

``--examples`` first records the attention examples (``catalog/<model>/examples.json``,
:func:`headmech.publish.examples.update_examples`) where they are missing or stale: that step
loads each model, seconds each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headmech.core.errors import HeadmechError
from headmech.publish.attention_view import INK_JS, VIEW_CSS, VIEW_JS
from headmech.publish.site.pages import (
    Model,
    head_page,
    load_models,
    model_types,
    provenance,
    verdict_counts,
)
from headmech.publish.site.site_data import atlas_index, layer_page
from headmech.publish.site.tutorials import (
    RENDERED,
    TUTORIAL_SIZE,
    TUTORIAL_SOURCE,
    committed_tutorials,
    frame_tutorials,
    notebook_digest,
)
from headmech.publish.site.type_info import type_info

__all__ = [
    "RENDERED",
    "TUTORIAL_SIZE",
    "TUTORIAL_SOURCE",
    "SiteSummary",
    "build_site",
    "main",
    "notebook_digest",
]

HERE = Path(__file__).resolve().parent


@dataclass
class SiteSummary:
    """What :func:`build_site` wrote."""

    out: Path
    pages: int
    bytes: int  # the pages and assets (tutorials and data/ apart)
    data_bytes: int = 0  # data/: the copied catalogs, examples and heatmap PNGs


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
    """A BibTeX entry of one published catalog: its year (when it was published or last
    updated, as its files record it), the headmech version, and a URN naming the model and
    the commit (else the weights) it was made at."""
    p = provenance(m)
    git = (m.catalog.get("provenance", {}).get("versions", {}) or {}).get("headmech_git") or p[
        "git"
    ]
    commit = git.get("commit", "") if isinstance(git, dict) else str(git or "")
    key = commit[:12] or p["weights"][:16]
    return (
        f"@misc{{headmech_{re.sub(r'[^A-Za-z0-9]', '_', m.name)},\n"
        f"  author = {{{{headmech contributors}}}},\n"
        f"  title = {{headmech head catalog of {m.name}}},\n"
        f"  year = {{{_year(m)}}},\n"
        f"  version = {{{p['headmech']}}},\n"
        f"  url = {{urn:headmech:catalog:{m.name}:{key}}},\n"
        f"  note = {{headmech {p['headmech']}; weights sha256 {p['weights']}; "
        f"made by: {p['command']}{'; commit ' + commit if commit else ''}}},\n"
        f"  howpublished = {{catalog/{m.name}/catalog.json}}\n}}"
    )


def _year(m: Model) -> str:
    """The year of the newest date the catalog's files record (its publication, its
    updates); the current year where they record none."""
    import time

    prov = m.catalog.get("provenance", {})
    records = [m.run, *m.run.get("updates", [])]
    for key in ("validation_updates", "type_additions", "broad_updates"):
        records += list(prov.get(key) or [])
    dates = [str(r["date"]) for r in records if isinstance(r, dict) and r.get("date")]
    return max(dates)[:4] if dates else time.strftime("%Y", time.gmtime())


def _write(path: Path, text: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return 1


def _type_rows(models: list[Model], name: str) -> list[dict[str, Any]]:
    """Per model, the type's row of the atlas (None where the model has no such type), with
    the probe sizes it was published at (``size``; ``size_differs``: not every model's)."""
    from headmech.publish.compare import probe_size

    sizes = {m.name: probe_size(m.catalog) for m in models}
    differs = len({s for s in sizes.values() if s is not None}) > 1
    rows = []
    for m in models:
        if name not in m.types:
            skipped = provenance(m)["skipped"].get(name, "not classified")
            rows.append({"model": m.name, "skipped": skipped})
            continue
        (t,) = [t for t in model_types(m, m.folder) if t["name"] == name]
        size = sizes[m.name]
        text = size.text() if size is not None else "not recorded"
        rows.append({"model": m.name, "skipped": None, "size": text, "size_differs": differs, **t})
    return rows


def _write_assets(out: Path, models: list[Model]) -> None:
    """The shared style and scripts, the atlas's index and texts, and the published files
    copied into ``data/`` so that the folder stands alone."""
    css = (HERE / "static" / "site.css").read_text() + VIEW_CSS
    _write(out / "assets" / "site.css", css)
    _write(out / "assets" / "view.js", VIEW_JS)
    _write(out / "assets" / "site.js", INK_JS + (HERE / "static" / "site.js").read_text())
    index = json.dumps(atlas_index(models), separators=(",", ":")).replace("</", "<\\/")
    _write(out / "assets" / "atlas.js", f"window.HEADMECH_ATLAS = {index};\n")
    texts = {
        f"{m.name}/{i}": t["tokens"]
        for m in models
        for i, t in enumerate((m.examples or {}).get("texts", []))
    }
    texts_js = json.dumps(texts, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")
    _write(out / "assets" / "texts.js", f"window.HEADMECH_TEXTS = {texts_js};\n")
    for m in models:  # the published files, so that the folder stands alone
        data = out / "data" / m.name
        data.mkdir(parents=True, exist_ok=True)
        for name in ("catalog.json", "examples.json", "run.json"):
            if (m.folder / name).is_file():
                shutil.copy2(m.folder / name, data / name)
        if (m.folder / "heatmaps").is_dir():
            (data / "heatmaps").mkdir()
            for png in sorted((m.folder / "heatmaps").glob("*.png")):
                shutil.copy2(png, data / "heatmaps" / png.name)


def _write_model(env: Any, out: Path, m: Model, common: dict[str, Any]) -> int:
    """One model's pages: the model page, a page per head and per layer."""
    pages = 0
    head_template = env.get_template("head.html")
    page_dir = out / "models"
    heads = [head_page(m, head) for head in m.heads]
    all_heads = [
        {
            "name": h["name"],
            "layer": h["layer"],
            "labelled": [s["type"] for s in h["scores"] if s["labelled"]],
            "above": [s["type"] for s in h["scores"] if s["verdict"] in ("rejected", "above")],
        }
        for h in heads
    ]
    pages += _write(
        page_dir / f"{m.name}.html",
        env.get_template("model.html").render(
            root="..",
            m=m,
            rows=model_types(m, page_dir),
            prov=provenance(m),
            all_heads=all_heads,
            has_examples=(m.folder / "examples.json").is_file(),
            has_run=(m.folder / "run.json").is_file(),
            **common,
        ),
    )
    for h in heads:
        pages += _write(
            out / "heads" / m.name / f"{h['name']}.html",
            head_template.render(root="../..", m=m, h=h, **common),
        )
    for layer in range(m.shape[0]):
        pages += _write(
            out / "layers" / m.name / f"L{layer}.html",
            env.get_template("layer.html").render(
                root="../..", m=m, lp=layer_page(m, layer), **common
            ),
        )
    return pages


def _has_guides(repo: Path) -> bool:
    """Whether ``repo`` is a headmech repository (its docs/ and README become guides)."""
    return (repo / "docs" / "architecture.md").is_file() and (repo / "README.md").is_file()


def _write_guides(env: Any, repo: Path, out: Path, common: dict[str, Any]) -> int:
    """The README and the guides of ``docs/`` as ``out/guides/`` pages, where the catalogs
    are the headmech repository's (a ``classify --out`` folder has none)."""
    from headmech.publish.site.guides import guide_pages

    docs, readme = repo / "docs", repo / "README.md"
    if not _has_guides(repo):
        return 0
    guides = guide_pages(docs, readme)
    for image in {i for g in guides for i in g.images if i.is_file()}:  # their figures, beside
        (out / "guides" / "img").mkdir(parents=True, exist_ok=True)
        shutil.copy2(image, out / "guides" / "img" / image.name)
    template = env.get_template("guide.html")
    return sum(
        _write(out / "guides" / g.name, template.render(root="..", g=g, guides=guides, **common))
        for g in guides
    )


def _scale(catalog_dir: Path) -> dict[str, Any] | None:
    """The cross-scale table of the one family published at two sizes
    (:func:`headmech.publish.scale.cross_scale_rows`), where both are published."""
    from headmech.publish.compare import probe_sizes
    from headmech.publish.scale import SCALE_FAMILY, cross_scale_rows

    small, large = SCALE_FAMILY
    if not all((catalog_dir / m / "catalog.json").is_file() for m in SCALE_FAMILY):
        return None
    sizes = probe_sizes(catalog_dir, list(SCALE_FAMILY))
    return {
        "small": small, "large": large, "rows": cross_scale_rows(catalog_dir, small, large),
        "sizes": {m: sizes[m].text() for m in SCALE_FAMILY},
        "same_size": sizes[small] == sizes[large],
    }  # fmt: skip


def _definitions(catalog_dir: Path) -> dict[str, Any]:
    """model -> the rows and options of its published agreement matrix of retrieval-head
    definitions (:mod:`headmech.publish.agreement`), where one is published."""
    from headmech.publish.agreement import matrix_rows, published_matrices

    return {
        m: {"rows": matrix_rows(x), "options": x.options, "names": list(x.scores)}
        for m, x in published_matrices(catalog_dir).items()
    }


def build_site(catalog_dir: str | os.PathLike, out: str | os.PathLike) -> SiteSummary:
    """Write the site for every ``catalog_dir/<model>/catalog.json`` into ``out`` (the
    pages are replaced; ``out/tutorials/`` is kept and linked); where ``catalog_dir`` is a
    ``headmech classify --out`` folder (``catalog_dir/catalog.json``), for that one model."""
    catalog_dir, out = Path(catalog_dir).resolve(), Path(out).resolve()
    models = load_models(catalog_dir)
    env = _environment()
    for sub in ("models", "types", "heads", "layers", "assets", "data", "guides"):
        shutil.rmtree(out / sub, ignore_errors=True)
    _write_assets(out, models)
    pages = 0
    types = sorted({t for m in models for t in m.types})
    committed_tutorials(catalog_dir.parent / RENDERED, out / "tutorials")
    tutorials = sorted(p.name for p in (out / "tutorials").glob("*.html"))
    # a classify --out folder has no guides: its pages do not link them
    common = {"models": models, "types": types, "guides_here": _has_guides(catalog_dir.parent)}
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
    pages += _write(
        out / "compare.html",
        env.get_template("compare.html").render(
            root=".", scale=_scale(catalog_dir), definitions=_definitions(catalog_dir), **common
        ),
    )
    for m in models:
        pages += _write_model(env, out, m, common)
    for name in types:
        pages += _write(
            out / "types" / f"{name}.html",
            env.get_template("type.html").render(
                root="..", info=type_info(name), rows=_type_rows(models, name), **common
            ),
        )
    pages += _write_guides(env, catalog_dir.parent, out, common)
    frame_tutorials(env, out, common)
    files = [
        p for p in out.rglob("*") if p.is_file() and "tutorials" not in p.relative_to(out).parts
    ]
    data_bytes = sum(p.stat().st_size for p in files if p.relative_to(out).parts[0] == "data")
    size = sum(p.stat().st_size for p in files) - data_bytes
    return SiteSummary(out, pages, size, data_bytes)


def main(argv: list[str] | None = None) -> int:
    """``python -m headmech.publish.site [--catalog DIR] [--out DIR] [--examples]``."""
    parser = argparse.ArgumentParser(
        prog="python -m headmech.publish.site", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--catalog",
        default="catalog",
        help="folder of the published catalogs (<model>/catalog.json), or one "
        "`headmech classify --out` folder (default: catalog)",
    )
    parser.add_argument("--out", default=None, help="where to write the site (CATALOG/site)")
    parser.add_argument(
        "--examples", action="store_true", help="first record missing or stale attention examples"
    )
    args = parser.parse_args(argv)
    try:
        if args.examples:
            from headmech.publish.examples import update_examples

            root = Path(args.catalog)
            found = [root / "catalog.json"] if (root / "catalog.json").is_file() else []
            for folder in found or sorted(root.glob("*/catalog.json")):
                wrote = update_examples(folder.parent)
                print(f"{folder.parent.name}: examples {'recorded' if wrote else 'up to date'}")
        summary = build_site(args.catalog, args.out or Path(args.catalog) / "site")
    except HeadmechError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"site: {summary.pages} pages, {summary.bytes / 1e6:.2f} MB (tutorials apart; "
        f"+ {summary.data_bytes / 1e6:.2f} MB of copied catalogs, examples and heatmaps) in "
        f"{summary.out}; open {summary.out / 'index.html'}"
    )
    return 0
