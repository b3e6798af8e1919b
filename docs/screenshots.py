"""The README's screenshots of the head atlas, each taken at the query its caption describes.

``make site-screenshots`` runs this (``python docs/screenshots.py SITE OUT``): it opens each
page of :data:`SHOTS` at an address that pins the query (``#view-1=30``: the atlas keeps a
pinned query in the address) and saves the screenshot. Each caption states what the pinned
view shows, with the weights read from ``catalog/<model>/examples.json`` (:func:`caption`);
tests/test_site.py checks that the README carries exactly these captions and that the
browser shows those weights at those tokens, so a screenshot cannot claim what it does not
show.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CATALOG = ROOT / "catalog"


@dataclass(frozen=True)
class Shot:
    """One screenshot: its file, the page (a model's head, or a site page) and, for a head,
    the text (probe) whose view is pinned and the query pinned (-1: the last token)."""

    file: str
    page: str  # "index.html", "layers/<model>/L17.html" or "heads/<model>/L18H6.html"
    probe: str | None = None
    query: int = -1
    kind: str = ""  # what the caption reads off the pinned row: "induction", "ioi"


SHOTS = (
    Shot("index.png", "index.html"),
    Shot("head.png", "heads/smollm2-135m/L18H6.html", "repeated_random", -1, "induction"),
    Shot("head-own-probe.png", "heads/smollm2-135m/L23H0.html", "ioi", -1, "ioi"),
    Shot("layer.png", "layers/smollm2-135m/L18.html"),
)


def _text(shot: Shot) -> tuple[int, dict[str, Any], list[float], int]:
    """``(text index, text, the pinned row's weights, the query)`` of a head shot."""
    model, head = shot.page.split("/")[1], Path(shot.page).stem
    ex = json.loads((CATALOG / model / "examples.json").read_text())
    i = next(k for k, t in enumerate(ex["texts"]) if t["probe"] == shot.probe)
    t = ex["texts"][i]
    q = shot.query if shot.query >= 0 else len(t["tokens"]) + shot.query
    return i, t, ex["heads"][head][i][q], q


def address(shot: Shot) -> str:
    """The page's address within the site, pinning the shot's query where it has one."""
    if shot.probe is None:
        return shot.page
    i, _, _, q = _text(shot)
    return f"{shot.page}#view-{i}={q}"


def claim(shot: Shot) -> dict[str, Any]:
    """What the pinned row shows: per token the caption names (position -> weight), and
    the position the caption says gets the most (None: the caption says it does not)."""
    _, t, row, q = _text(shot)
    ids = t["ids"]
    if shot.kind == "induction":  # the token after the query token's earlier copy
        target = max(k for k in range(q) if ids[k] == ids[q]) + 1
        return {"named": {target: row[target]}, "top": target}
    if shot.kind == "ioi":  # the indirect object (named once), the subject (twice)
        names = [k for k, tok in enumerate(t["tokens"]) if tok.strip()[:1].isupper() and k > 2]
        io = next(k for k in names if t["tokens"].count(t["tokens"][k]) == 1)
        s = next(k for k in names if t["tokens"].count(t["tokens"][k]) == 2)
        top = max(range(len(row)), key=row.__getitem__)
        named = {io: row[io], s: row[s], top: row[top]}
        return {"named": named, "top": io if top == io else None, "io": io, "s": s, "max": top}
    raise ValueError(shot.kind)


def caption(shot: Shot) -> str:
    """The README's alt text for the shot: what its pinned view shows, in numbers."""
    if shot.file == "index.png":
        return "The atlas's index: models x head types"
    if shot.file == "layer.png":
        return "Every head of one layer on one text, each with the types that label it"
    model, head = shot.page.split("/")[1], Path(shot.page).stem
    _, t, row, q = _text(shot)
    c = claim(shot)
    tok = t["tokens"]
    if shot.kind == "induction":
        (k, w), = c["named"].items()
        return (
            f"An induction head of {model} ({head}) on repeated random tokens, the last token "
            f"pinned: {w:.2f} of its attention on the token after that token's earlier copy "
            f"({tok[k].strip()!r})"
        )
    io, s, top = c["io"], c["s"], c["max"]
    most = "its largest weight" if top == io else f"more ({row[top]:.2f}) on {tok[top].strip()!r}"
    return (
        f"A name mover of {model} ({head}) on its own probe, an IOI prompt, the last token "
        f"pinned: {row[io]:.2f} of its attention on the indirect object {tok[io].strip()!r}, "
        f"{row[s]:.2f} on the subject's first mention, {most}"
    )


def take(site: Path, out: Path) -> list[Path]:
    """Every shot of :data:`SHOTS` from the built site ``site`` into ``out``."""
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(ROOT / "tests"))
    from test_site import find_chromium  # the same browser the atlas's tests drive

    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("no Chromium: install one or set HEADMECH_CHROMIUM")
    out.mkdir(parents=True, exist_ok=True)
    done = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(chromium), args=["--no-sandbox", "--allow-file-access-from-files"]
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for shot in SHOTS:
            page.goto((site / address(shot).split("#")[0]).as_uri() + _fragment(shot))
            page.wait_for_load_state()
            full = shot.file == "layer.png"
            page.screenshot(path=str(out / shot.file), full_page=full)
            done.append(out / shot.file)
        browser.close()
    return done


def _fragment(shot: Shot) -> str:
    a = address(shot)
    return a[a.index("#") :] if "#" in a else ""


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else CATALOG / "site").resolve()
    out = Path(sys.argv[2] if len(sys.argv) > 2 else ROOT / "docs" / "screenshots")
    for path in take(site, out):
        print(path)
    for shot in SHOTS:
        print(f"![{caption(shot)}](docs/screenshots/{shot.file})")
