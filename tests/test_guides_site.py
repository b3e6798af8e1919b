"""The guides of docs/ and the README as pages of the head atlas
(:mod:`headmech.publish.site.guides`): every guide has a page, every link between them
resolves on the site (anchors included), and a link to a repository file is named, not
linked, so that a copied site has no broken link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from headmech.publish.site.guides import guide_pages, render_guide, slug

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pages():
    return {g.name: g for g in guide_pages(ROOT / "docs", ROOT / "README.md")}


def test_every_guide_has_a_page(pages):
    want = {"index.html"} | {f"{p.stem}.html" for p in (ROOT / "docs").glob("*.md")}
    assert set(pages) == want
    assert pages["index.html"].title == "headmech"
    assert "<table>" in pages["kv-compression.html"].body  # tables rendered, not as text


def test_every_link_between_guides_resolves_with_its_anchor(pages):
    ids = {name: set(re.findall(r' id="([^"]+)"', g.body)) for name, g in pages.items()}
    checked = 0
    for name, g in pages.items():
        for href in re.findall(r'href="([^"]+)"', g.body):
            if re.match(r"^[a-z]+://", href):
                continue
            page, _, anchor = href.partition("#")
            page = page or name
            assert page in pages, f"{name} links {href}: no such page"
            assert not anchor or anchor in ids[page], f"{name} links {href}: no such anchor"
            checked += 1
    assert checked >= 20


def test_links_to_repository_files_are_named_not_linked():
    title, body = render_guide(
        "# T\n\nSee [the types](headmech/headtypes/README.md), [KV](docs/kv.md#a-b) and "
        "[here](#t) and [web](https://example.org).\n",
        {"kv.md", "README.md"},
    )
    assert title == "T"
    assert 'href="headmech' not in body and 'class="repo-path"' in body
    assert 'href="kv.html#a-b"' in body and 'href="#t"' in body
    assert 'href="https://example.org"' in body


def test_headings_get_githubs_anchors():
    assert slug("Packages, layer by layer") == "packages-layer-by-layer"
    assert slug("<code>headmech</code> and KV: 3x?") == "headmech-and-kv-3x"


def test_no_guide_renders_raw_markdown(pages):
    """Every Markdown table becomes a table and no row of pipes, heading marker or
    fenced-code marker survives as text (an unescaped ``|`` in a cell, say, turns the whole
    table into a paragraph of pipes)."""
    import html as html_lib

    for name, g in pages.items():
        text = re.sub(r"<pre.*?</pre>|<code>.*?</code>", "", g.body, flags=re.S)
        text = html_lib.unescape(re.sub(r"<[^>]+>", "", text))
        for line in text.splitlines():
            s = line.strip()
            assert not re.match(r"^\|.*\|$", s), f"{name}: a table row rendered as text: {s[:80]}"
            assert not re.match(r"^\|?\s*:?-{3,}", s), f"{name}: a table rule as text: {s[:80]}"
            assert not re.match(r"^#{1,6} ", s), f"{name}: a heading marker as text: {s[:80]}"
            assert not s.startswith("```"), f"{name}: a code fence as text: {s[:80]}"
