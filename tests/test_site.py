"""The head atlas (headmech.publish.site) in a real browser: Chromium driven by Playwright.

The site is built into a temporary folder from the committed catalogs and opened from the
file system, as a reader opens it. The browser is found by :func:`find_chromium`
($HEADMECH_CHROMIUM, then chromium / chromium-browser / google-chrome on PATH, then
Playwright's own download); with none these tests skip with one line saying how to install
one, unless HEADMECH_REQUIRE_BROWSER=1 (CI's ``.ci/run``), where they fail. The README's
screenshots are taken by docs/screenshots.py (``make site-screenshots``), each at the query
its caption describes; a test here checks that the pinned views show what the captions say.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from headmech.publish.attention_view import view_html
from headmech.publish.site import build_site

ROOT = Path(__file__).resolve().parent.parent
CATALOG = ROOT / "catalog"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
MODELS = sorted(p.parent.name for p in CATALOG.glob("*/catalog.json"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    summary = build_site(CATALOG, out)
    # every head has a page (758 of the five models; 15 kB on average, 28 kB at most), each
    # with the head on the ordinary texts and on its own type's probe (an IOI prompt, the
    # 99-token needle, ...; tokens shared in assets/texts.js), and every layer a layer
    # view (80, 19 kB each): 11.8 MB of pages and assets in all, so the limit is 14 MB
    # (tutorials apart). data/ holds the copies of the published files (catalog.json,
    # examples.json, run.json, the heatmap PNGs: 10.2 MB), counted on their own.
    # what each head writes (a shaded copy of each text, its promoted and suppressed
    # tokens, there and at the last token) adds about 6 kB a head page, the layer views'
    # second text 15 kB a layer: 17.9 MB, so the limit is 20 MB. data/ grows with each type
    # published (its scores, intervals and up to 99 control sets in catalog.json, a heatmap:
    # 40-60 kB a type and model): 14.5 MB with 21 types. Qwen2.5-Coder-1.5B's pages (336
    # heads, 28 layers) and files (catalog.json 1.4 MB, examples.json 4.1 MB, check.json,
    # 23 heatmaps) took the site to 27.8 MB and data/ to 21.9 MB with 23 types: the limits
    # are 32 MB and 25 MB
    assert summary.bytes < 32_000_000, f"the site is {summary.bytes / 1e6:.1f} MB"
    assert summary.data_bytes < 25_000_000, f"data/ is {summary.data_bytes / 1e6:.1f} MB"
    return out


def find_chromium(env: dict[str, str] | None = None) -> Path | None:
    """The browser to drive: $HEADMECH_CHROMIUM when set (a path that does not exist finds
    nothing, so ``HEADMECH_CHROMIUM=/nonexistent`` means "no browser"), else the first of
    :data:`BROWSERS` on PATH, else Playwright's own Chromium when it was downloaded."""
    env = os.environ if env is None else env
    if env.get("HEADMECH_CHROMIUM"):
        path = Path(env["HEADMECH_CHROMIUM"])
        return path if path.is_file() and os.access(path, os.X_OK) else None
    for name in BROWSERS:
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return Path(found)
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            own = Path(p.chromium.executable_path)
    except Exception:  # no playwright driver: no browser of its own either
        return None
    return own if own.is_file() else None


NO_BROWSER = (
    "no Chromium for the atlas's browser tests: install one (Debian/Ubuntu: apt-get install "
    "chromium; or: playwright install chromium) or point HEADMECH_CHROMIUM at it"
)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("HEADMECH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{NO_BROWSER} (HEADMECH_REQUIRE_BROWSER=1)", pytrace=False)
        pytest.skip(NO_BROWSER)
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=str(chromium), args=["--no-sandbox", "--allow-file-access-from-files"]
        )
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A page that records console errors and uncaught exceptions."""
    p = browser.new_page(viewport={"width": 1280, "height": 900})
    p.errors = []
    p.on("console", lambda m: p.errors.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: p.errors.append(str(e)))
    yield p
    p.close()


def _path(url: str) -> Path:
    return Path(unquote(urlsplit(url).path))


# a document's links (anchors, images, style sheets, scripts), its images that did not
# load, and its attention views that did not start
LINKS = """d => [[
  ...[...d.querySelectorAll('a[href]')].map(a => new URL(a.getAttribute('href'), d.baseURI).href),
  ...[...d.querySelectorAll('img')].map(i => i.src),
  ...[...d.querySelectorAll('link[href], script[src]')].map(e => e.href || e.src)],
  [...d.images].filter(i => !i.naturalWidth).map(i => i.src),
  d.querySelectorAll('.hm-view:not([data-ready])').length]"""
BATCH = 128  # head pages loaded at once, as hidden frames of one page (2x faster than goto)
FRAMED = ("/heads/", "/layers/")  # the pages loaded as frames: most pages, one template each


def _open(page, site: Path, urls: list[str]) -> list[tuple[str, list]]:
    """Load ``urls`` and return each one's :data:`LINKS`: pages one by one, head pages and
    layer views in batches of frames (the browser runs with --allow-file-access-from-files)."""
    heads = [u for u in urls if any(f in u for f in FRAMED)]
    out = []
    for url in (u for u in urls if not any(f in u for f in FRAMED)):
        page.goto(url)
        out.append((url, page.evaluate(f"() => ({LINKS})(document)")))
    for i in range(0, len(heads), BATCH):
        host = site / "frames.html"
        frames = heads[i : i + BATCH]
        host.write_text(
            "".join(f'<iframe style="display:none" src="{u}"></iframe>' for u in frames)
        )
        page.goto(host.as_uri())
        got = page.evaluate(
            f"() => [...document.querySelectorAll('iframe')].map(f => ({LINKS})(f.contentDocument))"
        )
        out += list(zip(frames, got, strict=True))
        host.unlink()
    return out


def test_every_link_resolves_and_no_page_logs_an_error(site, page):
    todo, seen, targets = [(site / "index.html").as_uri()], set(), []
    while todo:
        batch = sorted(set(todo) - seen)
        todo = []
        seen |= set(batch)
        for url, (links, broken, idle_views) in _open(page, site, batch):
            assert not page.errors, f"{url}: {page.errors}"
            assert not broken, f"{url}: images that do not load: {broken}"
            assert idle_views == 0, f"{url}: {idle_views} attention views did not start"
            for link in set(links):
                parts = urlsplit(link)
                if parts.scheme == "data":  # an embedded figure (a tutorial's), self-contained
                    continue
                assert parts.scheme == "file", f"{url} links outside the file system: {link[:80]}"
                assert _path(link).is_file(), f"{url}: broken link {link}"
                target = link.split("#")[0]
                if parts.fragment:
                    targets.append((link, target, parts.fragment))
                if target.endswith(".html") and _path(target).is_relative_to(site):
                    todo.append(target)
    pages = {p.as_uri() for p in site.rglob("*.html")}
    assert pages == seen, f"pages no link reaches: {sorted(pages - seen)[:5]}"
    assert len(seen) > 4 * len(MODELS)
    for link, target, fragment in set(targets):  # every #anchor names an element of its page
        assert fragment in _ids(target), f"broken anchor {link}"


def _ids(path_url: str) -> set[str]:
    import re

    return set(re.findall(r'id="([^"]+)"', _path(path_url).read_text()))


def test_model_pages_show_every_type_with_its_labelled_heads_and_verdict(site, page):
    for name in MODELS:
        catalog = json.loads((CATALOG / name / "catalog.json").read_text())
        page.goto((site / "models" / f"{name}.html").as_uri())
        for t, result in catalog["types"].items():
            section = page.locator(f"#type-{t}")
            assert section.count() == 1, f"{name}: no section for {t}"
            shown = set(section.locator("table.heads a").all_text_contents())
            assert shown == {f"L{la}H{h}" for la, h in result["heads"]}, (name, t)
            folded = section.locator("details.big:not([open]) table.heads").count()
            assert folded == (len(result["heads"]) > 12), (name, t)  # big tables start folded
            assert section.locator(".hmap .hmap-bar .hmap-grad").count() == 1  # a colour bar
            n_layers, n_heads = catalog["model"]["n_layers"], catalog["model"]["n_heads"]
            assert section.locator(".hmap .hmap-cell").count() == n_layers * n_heads
            if (CATALOG / name / "heatmaps" / f"{t}.png").exists():  # the PNG, from data/
                assert section.locator(f'a[href="../data/{name}/heatmaps/{t}.png"]').count() == 1
            v = result["details"].get("validation") or {}
            said = v.get("verdict")
            if said == "no heads":  # no effect shown for a type without heads
                assert "No labelled heads: nothing to validate" in section.inner_text()
            elif said is not None:  # the catalog's verdict, as catalog/README.md shows it
                assert section.locator("b.verdict").first.inner_text() == said, (name, t)
            for i, c in enumerate((v.get("secondary") or {}).values()):  # the other claims
                assert section.locator("b.verdict").nth(1 + i).inner_text() == c["verdict"]
            for e in result.get("not_labelled", []):  # every rejected head, with its reason
                assert f"{e['head']} " in section.locator("p.rejected").inner_text()
                assert e["reason"] in section.locator("p.rejected").inner_text()
        # the specific types first: the sections by labelled heads, types labelling none last
        order = page.locator("section.type").evaluate_all("s => s.map(x => x.id.slice(5))")
        n = {t: len(r["heads"]) for t, r in catalog["types"].items()}
        assert order == sorted(n, key=lambda t: (n[t] == 0, n[t], t)), name


def test_hovering_a_token_shows_the_weights_of_examples_json(site, page):
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    examples = json.loads((CATALOG / name / "examples.json").read_text())
    catalog = json.loads((CATALOG / name / "catalog.json").read_text())
    la, h = (
        catalog["types"]["induction"]["heads"][0]
        if "induction" in catalog["types"]
        else (catalog["types"][next(iter(catalog["types"]))]["heads"][0])
    )
    head = f"L{la}H{h}"
    page.goto((site / "heads" / name / f"{head}.html").as_uri())
    n_views = page.locator(".hm-view").count()
    recorded = [v for v, rows in enumerate(examples["heads"][head]) if rows is not None]
    assert n_views == len(recorded) >= 2  # the ordinary texts, and its own type's probe
    # nothing shown before a hover (checked on load: a hover keeps its row shown after the
    # pointer leaves, and the scrolling of the steps below can pass the pointer over a view)
    assert page.locator(".hm-w").count() == 0
    for v in recorded:
        text = examples["texts"][v]
        view = page.locator(f"#view-{v}")
        q = len(text["tokens"]) - 1  # the last query sees every token
        view.locator(".hm-tok").nth(q).hover()
        shown = [float(x) for x in view.locator(".hm-w").all_inner_texts()]
        want = examples["heads"][head][v][q]
        assert shown == pytest.approx(want, abs=5e-4), (head, v)
        view.locator(".hm-tok").nth(2).click()  # another query: its own row
        assert len(view.locator(".hm-w").all_inner_texts()) == len(examples["heads"][head][v][2])
    assert not page.errors


def test_token_text_is_escaped(page):
    """A token that looks like markup is shown as text, never run."""
    tokens = ["<script>window.bad=1</script>", "&amp;", '"q"']
    rows = [[1.0], [0.5, 0.5], [0.2, 0.3, 0.5]]
    page.set_content(view_html(tokens, rows, inline=True))
    assert page.evaluate("() => window.bad") is None
    assert page.locator(".hm-tok").all_inner_texts() == tokens
    page.locator(".hm-tok").nth(2).click()
    assert page.locator(".hm-w").all_inner_texts() == ["0.200", "0.300", "0.500"]
    assert not page.errors


def test_the_browser_is_found_by_env_then_path(tmp_path):
    """$HEADMECH_CHROMIUM wins (a missing file means no browser, never a fallback); else
    the first of chromium / chromium-browser / google-chrome on PATH, in that order."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("chromium-browser", "google-chrome"):
        exe = bin_dir / name
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    assert find_chromium({"PATH": str(bin_dir)}) == bin_dir / "chromium-browser"
    (bin_dir / "chromium-browser").unlink()
    assert find_chromium({"PATH": str(bin_dir)}) == bin_dir / "google-chrome"
    mine = tmp_path / "my-chrome"
    mine.write_text("#!/bin/sh\n")
    mine.chmod(0o755)
    env = {"PATH": str(bin_dir), "HEADMECH_CHROMIUM": str(mine)}
    assert find_chromium(env) == mine
    assert find_chromium({**env, "HEADMECH_CHROMIUM": str(tmp_path / "nonexistent")}) is None
    mine.chmod(0o644)  # not executable: not a browser
    assert find_chromium(env) is None


# --- the atlas as a research tool (issue 46) ---------------------------------------------

LOCAL = r'(?:href|src)="([^"#?]*)[^"]*"'


def _local_links(html_file: Path) -> list[str]:
    import re

    return [
        u
        for u in re.findall(LOCAL, html_file.read_text())
        if u and not re.match(r"[a-z]+:", u)  # http:, mailto:, data: are not files here
    ]


def test_a_copy_of_the_folder_is_self_contained(site, tmp_path):
    """Copied anywhere, the site's every local href/src resolves inside the copy (no
    ../ out of it); the published files are there to download."""
    copy = tmp_path / "elsewhere" / "atlas"
    shutil.copytree(site, copy)
    for html_file in copy.rglob("*.html"):
        for link in _local_links(html_file):
            target = (html_file.parent / unquote(link)).resolve()
            assert target.is_relative_to(copy.resolve()), f"{html_file}: {link} leaves the site"
            assert target.exists(), f"{html_file}: broken {link}"
    for name in MODELS:
        for f in ("catalog.json", "examples.json"):
            assert (copy / "data" / name / f).read_bytes() == (CATALOG / name / f).read_bytes()
        pngs = sorted(p.name for p in (CATALOG / name / "heatmaps").glob("*.png"))
        assert sorted(p.name for p in (copy / "data" / name / "heatmaps").glob("*.png")) == pngs
        model_page = (copy / "models" / f"{name}.html").read_text()
        assert f'href="../data/{name}/catalog.json" download' in model_page


def test_every_head_has_a_page_with_every_type_and_its_verdict(site):
    import re

    for name in MODELS:
        catalog = json.loads((CATALOG / name / "catalog.json").read_text())
        n_layers, n_heads = catalog["model"]["n_layers"], catalog["model"]["n_heads"]
        pages = {p.stem for p in (site / "heads" / name).glob("*.html")}
        assert pages == {f"L{la}H{h}" for la in range(n_layers) for h in range(n_heads)}, name
        for t, result in catalog["types"].items():
            for e in result.get("not_labelled", []):  # the reason, on the head's own page
                text = (site / "heads" / name / f"{e['head']}.html").read_text()
                row = re.search(rf">{t}</a></td>.*?</tr>", text, re.S)[0]
                assert "not labelled" in row and _html_text(e["reason"]) in row, (name, t)
            for la, h in result["heads"]:
                text = (site / "heads" / name / f"L{la}H{h}.html").read_text()
                row = re.search(rf">{t}</a></td>.*?</tr>", text, re.S)[0]
                assert "labelled" in row and "below" not in row
        # a head no type labels: a row per type, each "below the threshold" or a reason
        text = (site / "heads" / name / f"L{n_layers - 1}H{n_heads - 1}.html").read_text()
        for t in catalog["types"]:
            assert f">{t}</a></td>" in text
    copying = "details" in json.dumps(catalog)  # induction's own copying effect is shown
    if "smollm2-135m" in MODELS and copying:
        text = (site / "heads" / "smollm2-135m" / "L17H5.html").read_text()
        assert "copying_effect: 0.032 [-0.009, 0.069]" in text


def _html_text(s: str) -> str:
    from markupsafe import escape  # as jinja2 escapes

    return str(escape(s))


def test_type_pages_render_rst_and_say_what_the_threshold_means(site):
    for page in (site / "types").glob("*.html"):
        text = page.read_text()
        main = text.split("<main>")[1].split("</main>")[0]
        assert "``" not in main and ":func:`" not in main and ":class:`" not in main, page.name
        assert "see the docstring" not in main and "Args:" not in main, page.name
        assert "when its score on the probe" in main, page.name
    assert "<code>induction_head</code>" in (site / "types" / "induction.html").read_text()
    # each model's probe sizes beside its row, flagged: the catalogs differ in size
    text = (site / "types" / "induction.html").read_text()
    assert "<th>probe sizes</th>" in text
    assert "<small>⚠ 128 sentences, 16 sequences, haystacks 300-1500, &lt;= 99 control sets" in text
    assert "⚠ The models were published at different probe sizes" in text


def _head_of(name: str, t: str) -> str:
    catalog = json.loads((CATALOG / name / "catalog.json").read_text())
    la, h = catalog["types"][t]["heads"][0]
    return f"L{la}H{h}"


def test_a_clicked_heatmap_cell_reaches_its_head_page(site, page):
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    t = (
        "induction"
        if "induction" in json.loads((CATALOG / name / "catalog.json").read_text())["types"]
        else "attention_sink"
    )
    head = _head_of(name, t)
    for url in (site / "models" / f"{name}.html", site / "types" / f"{t}.html"):
        page.goto(url.as_uri())
        cell = page.locator(f'.hmap[data-model="{name}"][data-type="{t}"] a[data-head="{head}"]')
        assert "labelled" in cell.get_attribute("aria-label")
        cell.click()
        page.wait_for_load_state()
        assert _path(page.url) == site / "heads" / name / f"{head}.html"
        assert page.locator("h1").inner_text().startswith(head)
    assert not page.errors


def test_search_finds_heads_by_model_type_and_name(site, page):
    page.goto((site / "index.html").as_uri())
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    catalog = json.loads((CATALOG / name / "catalog.json").read_text())
    t = "induction" if "induction" in catalog["types"] else next(iter(catalog["types"]))
    page.fill("#search", f"{name} {t}")
    got = page.locator("#results tbody tr td:nth-child(2)").all_inner_texts()
    assert sorted(got) == sorted(f"L{la}H{h}" for la, h in catalog["types"][t]["heads"])
    page.fill("#search", "L1H0")  # a head by name: that head of every model
    models = page.locator("#results tbody tr td:first-child").all_inner_texts()
    assert sorted(models) == MODELS
    page.locator("#results a", has_text="L1H0").first.click()
    page.wait_for_load_state()
    assert page.locator("h1").inner_text().startswith("L1H0")
    assert not page.errors


def test_tables_sort_and_filter(site, page):
    name = MODELS[0]
    page.goto((site / "models" / f"{name}.html").as_uri())
    table = page.locator("#heads-table")
    assert not table.is_visible()  # folded: the page opens with the types
    page.locator("#all-heads + details > summary").click()
    n = table.locator("tbody tr").count()
    table.locator("th", has_text="layer").click()
    table.locator("th", has_text="layer").click()  # descending: the last layer first
    layers = [int(x) for x in table.locator("tbody tr td:nth-child(2)").all_inner_texts()]
    assert layers == sorted(layers, reverse=True) and len(layers) == n
    page.fill("#filter-heads", "L0H0")
    assert table.locator("tbody tr:not([hidden])").count() == 1
    assert not page.errors


def test_compare_view_shows_two_heads_on_every_type(site, page):
    a, b = MODELS[0], MODELS[-1]
    page.goto((site / "compare.html").as_uri() + f"?a={a}/L0H1&b={b}/L1H0")
    rows = page.locator("#compare-table tbody tr")
    types = set(json.loads((CATALOG / a / "catalog.json").read_text())["types"]) | set(
        json.loads((CATALOG / b / "catalog.json").read_text())["types"]
    )
    assert sorted(rows.locator("td:first-child").all_inner_texts()) == sorted(types)
    ta = next(iter(sorted(json.loads((CATALOG / a / "catalog.json").read_text())["types"])))
    score = json.loads((CATALOG / a / "catalog.json").read_text())["types"][ta]["score"][0][1]
    row = rows.filter(has=page.locator("td:first-child", has_text=ta)).first
    assert row.locator("td").nth(1).inner_text().startswith(f"{score:.3f}")
    assert page.locator("#compare-table thead a").all_inner_texts() == [f"{a} L0H1", f"{b} L1H0"]
    assert not page.errors


def test_compare_view_shows_both_heads_patterns_on_the_same_text(site, page):
    """Two heads of SmolLM2: each one's view of the same ordinary text, side by side, the
    last token pinned in both, with that row's weights from examples.json."""
    name = "smollm2-135m"
    ex = json.loads((CATALOG / name / "examples.json").read_text())
    i = next(k for k, t in enumerate(ex["texts"]) if t["probe"] == "prose")
    q = len(ex["texts"][i]["tokens"]) - 1
    page.goto((site / "compare.html").as_uri() + f"?a={name}/L18H6&b={name}/L3H0")
    frames = page.locator("iframe.compare-view")
    assert frames.count() == 2
    for side, head in (("a", "L18H6"), ("b", "L3H0")):
        view = page.frame_locator(f'iframe[data-side="{side}"]').locator(f"#view-{i}")
        assert view.get_attribute("data-pinned") == str(q)
        shown = [float(x) for x in view.locator(".hm-w").all_inner_texts()]
        assert shown == pytest.approx(ex["heads"][head][i][q], abs=5e-4)
    assert not page.errors


def test_the_token_view_pins_on_click_and_works_by_keyboard(site, page):
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    examples = json.loads((CATALOG / name / "examples.json").read_text())
    head = next(iter(examples["heads"]))
    page.goto((site / "heads" / name / f"{head}.html").as_uri())
    view = page.locator("#view-0")
    toks = view.locator(".hm-tok")
    assert toks.nth(3).get_attribute("tabindex") == "0"
    assert toks.nth(3).get_attribute("role") == "button"
    assert toks.nth(3).get_attribute("aria-label").startswith("token 3: ")
    assert toks.nth(3).get_attribute("title") == toks.nth(3).get_attribute("aria-label")
    toks.nth(3).click()  # pinned: hovering another token keeps query 3
    toks.nth(5).hover()
    assert view.get_attribute("data-query") == "3"
    assert toks.nth(3).get_attribute("aria-pressed") == "true"
    weights = [float(x) for x in view.locator(".hm-w").all_inner_texts()]
    assert weights == pytest.approx(examples["heads"][head][0][3], abs=5e-4)
    size = view.locator(".hm-w").first.evaluate("e => parseFloat(getComputedStyle(e).fontSize)")
    assert size >= 11  # readable labels, one under each token, never running together
    boxes = [view.locator(".hm-w").nth(k).bounding_box() for k in range(4)]
    for x, y in zip(boxes, boxes[1:], strict=False):
        assert x["x"] + x["width"] <= y["x"] or x["y"] != y["y"]
    toks.nth(3).click()  # unpinned
    toks.nth(6).focus()  # the keyboard: focus previews, Enter pins
    assert view.get_attribute("data-query") == "6"
    page.keyboard.press("ArrowRight")
    page.keyboard.press("Enter")
    assert view.get_attribute("data-pinned") == "7"
    from playwright.sync_api import expect

    view.locator(".hm-matrix summary").click()  # the full query x key pattern
    canvas = view.locator(".hm-matrix canvas")
    expect(canvas).to_have_attribute("data-drawn", "1")
    # hover a cell: its weight; zoom: the pattern grows (the page scrolls inside the view)
    rows = examples["heads"][head][0]
    n = len(rows)
    box = canvas.bounding_box()
    q, k = n - 1, 2
    page.mouse.move(
        box["x"] + (k + 0.5) * box["width"] / n, box["y"] + (q + 0.5) * box["height"] / n
    )
    said = view.locator(".hm-cell").inner_text()
    assert said.startswith(f"query {q} ") and f" key {k} " in said
    assert float(said.rsplit(": ", 1)[1]) == pytest.approx(rows[q][k], abs=5e-4)
    view.locator(".hm-zoom input").fill("3")
    assert canvas.bounding_box()["width"] == pytest.approx(3 * box["width"], rel=0.02)
    assert not page.errors


def test_the_token_view_reads_a_token_as_a_key(site, page):
    """The switch reads a selected token as a key: each query's weight on it (a column of
    the pattern), for causal queries from the token on."""
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    examples = json.loads((CATALOG / name / "examples.json").read_text())
    head = next(iter(examples["heads"]))
    page.goto((site / "heads" / name / f"{head}.html").as_uri())
    view = page.locator("#view-0")
    rows = examples["heads"][head][0]
    flip = view.locator("button.hm-flip")
    assert flip.get_attribute("aria-pressed") == "false"
    flip.click()
    assert flip.get_attribute("aria-pressed") == "true" and "key ← queries" in flip.inner_text()
    k = 2
    view.locator(".hm-tok").nth(k).click()
    assert view.get_attribute("data-reading") == "key"
    shown = [float(x) for x in view.locator(".hm-w").all_inner_texts()]
    column = [row[k] for row in rows if len(row) > k]  # queries k.. (causal)
    assert shown == pytest.approx(column, abs=5e-4)
    best = max(range(len(rows)), key=lambda q: rows[q][k] if len(rows[q]) > k else -1)
    assert f"most attention from query {best} " in view.locator(".hm-status").inner_text()
    flip.click()  # back to the query's row
    assert [float(x) for x in view.locator(".hm-w").all_inner_texts()] == pytest.approx(
        rows[k], abs=5e-4
    )
    assert not page.errors


def test_pages_fit_a_390_px_phone_without_horizontal_scroll(site, browser):
    p = browser.new_page(viewport={"width": 390, "height": 844})
    name = MODELS[-1] if "smollm2-135m" not in MODELS else "smollm2-135m"
    catalog = json.loads((CATALOG / name / "catalog.json").read_text())
    rejected = [e["head"] for t in catalog["types"].values() for e in t.get("not_labelled", [])]
    long = rejected[0] if rejected else "L1H0"  # a head with a long reason not to label it
    for url in (
        "index.html",
        f"models/{name}.html",
        "types/induction.html" if (site / "types" / "induction.html").exists() else "index.html",
        f"heads/{name}/{long}.html",
        f"layers/{name}/L1.html",
        f"compare.html?a={name}/{long}&b={name}/L1H1",
    ):
        path, _, query = url.partition("?")
        p.goto((site / path).as_uri() + (f"?{query}" if query else ""))
        width = p.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{url}: the page scrolls sideways ({width} px)"
    p.close()


def test_dark_mode_and_fonts(site, browser):
    p = browser.new_page(color_scheme="dark")
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    p.goto((site / "heads" / name / "L1H0.html").as_uri())
    bg = p.evaluate("getComputedStyle(document.body).backgroundColor")
    assert bg != "rgb(255, 255, 255)"
    fonts = p.evaluate("getComputedStyle(document.querySelector('.hm-view')).fontFamily")
    assert "Noto Sans CJK SC" in fonts and "Noto Sans Devanagari" in fonts
    p.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_accessibility(site, browser, scheme):
    """axe-core (axe-playwright-python, a dev dependency) finds no moderate, serious or
    critical violation (contrast included, with a token's weights shown) on the index, a
    model, a type, a head, a layer and the compare page, in light and dark mode; every
    token, heatmap cell and form field has an accessible name, and every token is a
    focusable button."""
    page = browser.new_page(color_scheme=scheme)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    head = next(iter(json.loads((CATALOG / name / "examples.json").read_text())["heads"]))
    urls = [
        "index.html",
        f"models/{name}.html",
        "types/induction.html",
        f"heads/{name}/{head}.html",
        f"layers/{name}/L{head[1:].split('H')[0]}.html",
        f"compare.html?a={name}/L1H0&b={name}/L1H1",
    ]
    from axe_playwright_python.sync_playwright import Axe

    for url in urls:
        path, _, query = url.partition("?")
        if not (site / path).exists():
            continue
        page.goto((site / path).as_uri() + (f"?{query}" if query else ""))
        if page.locator(".hm-view").count():  # the weights shown: their contrast counts
            page.locator("#view-0 .hm-tok").last.click()
        unnamed = page.evaluate(
            """() => [...document.querySelectorAll('.hm-tok, .hmap-cell, input, select')]
            .filter(e => !(e.getAttribute('aria-label') || (e.id &&
              document.querySelector('label[for="' + e.id + '"]')))).length"""
        )
        assert unnamed == 0, f"{url}: {unnamed} controls without an accessible name"
        assert page.locator(".hm-tok:not([role=button]), .hm-tok:not([tabindex='0'])").count() == 0
        result = Axe().run(page)
        bad = [
            (v["id"], len(v["nodes"]), v["nodes"][0]["html"][:80])
            for v in result.response["violations"]
            if v["impact"] in ("moderate", "serious", "critical")
        ]
        assert not bad, f"{url} ({scheme}): {bad}"
    assert not errors
    page.close()


def test_the_layer_view_shows_every_head_of_a_layer_on_one_text(site, page):
    name = "smollm2-135m" if "smollm2-135m" in MODELS else MODELS[-1]
    examples = json.loads((CATALOG / name / "examples.json").read_text())
    catalog = json.loads((CATALOG / name / "catalog.json").read_text())
    n_layers = catalog["model"]["n_layers"]
    assert len(list((site / "layers" / name).glob("L*.html"))) == n_layers
    labelled = catalog["types"].get("induction", {}).get("heads") or [[0, 0]]
    head = "L{}H{}".format(*labelled[0])  # a layer with an induction head
    layer = int(head[1:].split("H")[0])
    page.goto((site / "layers" / name / f"L{layer}.html").as_uri())
    q = len(examples["texts"][0]["tokens"]) - 2
    page.locator(".hm-lquery .hm-ltok").nth(q).click()
    assert page.locator("#layer-view").get_attribute("data-pinned") == str(q)
    row = page.locator(".hm-lrow", has=page.locator(f'a.hm-lname:text-is("{head}")'))
    shown = [
        float(x)
        for x in row.locator(".hm-ltok").evaluate_all(
            f"es => es.slice(0, {q + 1}).map(e => e.dataset.w)"
        )
    ]
    assert shown == pytest.approx(examples["heads"][head][0][q], abs=5e-4)
    every = {f"L{layer}H{h}" for h in range(catalog["model"]["n_heads"])}
    assert {h for h in examples["heads"] if h.startswith(f"L{layer}H")} == every
    assert set(page.locator("a.hm-lname").all_inner_texts()) == every
    # each head with the types that label it
    assert "induction" in row.locator(".hm-llab").inner_text()
    # the ordinary texts, every head recorded on them, one at a time
    whole = [
        i
        for i in range(len(examples["texts"]))
        if all(examples["heads"][h][i] is not None for h in every)
    ]
    pick = page.locator("select.hm-text")
    assert pick.locator("option").count() == len(whole) >= 2
    pick.select_option("1")
    i = whole[1]
    assert page.locator("#layer-view").get_attribute("data-text") == "1"
    tokens = page.locator(".hm-lquery .hm-ltok")
    assert tokens.count() == len(examples["texts"][i]["tokens"])
    q = tokens.count() - 1
    tokens.nth(q).click()
    shown = row.locator(".hm-ltok").evaluate_all(
        f"es => es.slice(0, {q + 1}).map(e => e.dataset.w)"
    )
    assert [float(x) for x in shown] == pytest.approx(examples["heads"][head][i][q], abs=5e-4)
    pick.select_option("0")
    assert not page.errors


def test_token_ids_show_on_hover_where_recorded(site, page):
    """examples.json records each text's token ids (files made before lack them: the
    token's position and text only); a token's title and ARIA label name its id."""
    for name in MODELS:
        examples = json.loads((CATALOG / name / "examples.json").read_text())
        if "ids" not in examples["texts"][0] or not examples["heads"]:
            continue
        head = next(iter(examples["heads"]))
        page.goto((site / "heads" / name / f"{head}.html").as_uri())
        tok = page.locator("#view-0 .hm-tok").nth(1)
        assert tok.get_attribute("title").endswith(f", id {examples['texts'][0]['ids'][1]}")
        assert tok.get_attribute("aria-label") == tok.get_attribute("title")
        break
    else:
        pytest.skip("no examples.json records token ids")


def test_a_copied_folder_opens_in_the_browser_without_broken_links(site, page, tmp_path):
    """The copy, opened from elsewhere: every link and image of its index, model, type,
    compare and layer pages (the heatmaps' cells included, made by the script) resolves
    inside the copy, and no page logs an error."""
    copy = tmp_path / "moved" / "atlas"
    shutil.copytree(site, copy)
    urls = [(copy / "index.html").as_uri(), (copy / "compare.html").as_uri()]
    urls += [p.as_uri() for p in sorted((copy / "models").glob("*.html"))]
    urls += [p.as_uri() for p in sorted((copy / "types").glob("*.html"))[:3]]
    urls += [p.as_uri() for p in sorted((copy / "layers").rglob("L0.html"))]
    cells = 0
    for url, (links, broken, _idle) in _open(page, copy, urls):
        assert not page.errors, f"{url}: {page.errors}"
        assert not broken, f"{url}: images that do not load: {broken}"
        for link in set(links):
            target = _path(link)
            assert target.is_relative_to(copy), f"{url}: {link} leaves the copy"
            assert target.is_file(), f"{url}: broken link {link}"
        cells += sum("/heads/" in link for link in links)
    assert cells > 1000  # the heatmaps' cells link to head pages


def test_the_guides_are_pages_of_the_atlas(site):
    """The README and every guide of docs/ are pages under guides/, reached from every
    page's navigation (the crawl above checks their links and anchors)."""
    want = {"index.html"} | {f"{p.stem}.html" for p in (ROOT / "docs").glob("*.md")}
    assert {p.name for p in (site / "guides").glob("*.html")} == want
    assert 'href="./guides/index.html"' in (site / "index.html").read_text()
    kv = (site / "guides" / "kv-compression.html").read_text()
    assert "<table>" in kv and "headmech head atlas" in kv


def test_head_pages_show_what_the_head_writes(site):
    """Under each view of a decoder's head: the text shaded by the head's direct effect on
    each next token (the values of examples.json's ``writes`` on hover), and where that is
    largest, the tokens its write raises and lowers; an encoder's pages say why not."""
    from html import escape  # as writes_view.py escapes

    ex = json.loads((CATALOG / "smollm2-135m" / "examples.json").read_text())
    head = "L18H6"
    text = (site / "heads" / "smollm2-135m" / f"{head}.html").read_text()
    shown = [(t, w) for t, w in zip(ex["texts"], ex["writes"][head], strict=True) if w is not None]
    assert shown and text.count('<div class="writes">') == len(shown)
    for t, w in shown:
        at = w["at"]
        assert f"(position {at}; next token" in text
        e = w["effects"][at]
        assert e is not None and abs(e) == max(abs(x) for x in w["effects"] if x is not None)
        tok, value = w["promoted"][0]
        assert f'<code class="tok">{escape(tok)}</code> {value:+.3g}' in text
        first = w["effects"][0]
        assert first is None or f'title="{first:+.3g}">{escape(t["tokens"][0])}</i>' in text
        if w["at"] != len(t["tokens"]) - 1:  # the last token's write, where an answer is read
            up = w["end"][0][0]
            assert f'its write raises <code class="tok">{escape(up[0])}</code> {up[1]:+.3g}' in text
    # on its own probe (induction's: the repeated tokens), the strongest query -> key pair:
    # the last token on the token after its earlier copy
    rr = next(k for k, t in enumerate(ex["texts"]) if t["probe"] == "repeated_random")
    row = ex["heads"][head][rr][-1]
    k = max(range(1, len(row)), key=row.__getitem__)
    assert f"@{len(row) - 1} → " in text and f"@{k} {row[k]:.3f}" in text
    minilm = (site / "heads" / "minilm-l6" / "L0H0.html").read_text()
    assert "What it writes is not shown for this model" in minilm and "causal" in minilm


def test_the_model_page_scatters_every_head_along_two_chosen_metrics(site, page):
    """A point per head with a score on both axes, placed by its values (a higher score
    higher up), coloured by its verdict on the y axis's type; the axes switch; a point
    reaches its head's page."""
    name = "smollm2-135m"
    catalog = json.loads((CATALOG / name / "catalog.json").read_text())
    n_layers, n_heads = catalog["model"]["n_layers"], catalog["model"]["n_heads"]
    page.goto((site / "models" / f"{name}.html").as_uri())
    plot = page.locator(".scatter svg")
    assert plot.locator("circle").count() == n_layers * n_heads  # depth x a full score grid
    page.select_option('.scatter select[data-axis="y"]', "induction")
    page.select_option('.scatter select[data-axis="x"]', "previous_token")
    score = catalog["types"]["induction"]["score"]
    have = [(la, h) for la in range(n_layers) for h in range(n_heads)]
    both = [x for x in have if score[x[0]][x[1]] is not None]
    prev = catalog["types"]["previous_token"]["score"]
    both = [x for x in both if prev[x[0]][x[1]] is not None]
    assert plot.locator("circle").count() == len(both)
    la, h = catalog["types"]["induction"]["heads"][0]
    point = plot.locator(f'a[data-head="L{la}H{h}"] circle')
    assert point.get_attribute("class") == "pt v1"  # labelled: red
    assert "induction" in point.locator("title").text_content()
    low = min(both, key=lambda x: score[x[0]][x[1]])
    cy = float(point.get_attribute("cy"))
    assert cy < float(plot.locator(f'a[data-head="L{low[0]}H{low[1]}"] circle').get_attribute("cy"))
    plot.locator(f'a[data-head="L{la}H{h}"]').click()
    page.wait_for_load_state()
    assert _path(page.url) == site / "heads" / name / f"L{la}H{h}.html"
    assert not page.errors


def test_each_catalog_has_a_bibtex_entry_with_year_version_and_identifier(site):
    """The index's "How to cite": one @misc per model with its year (from the files'
    dates), the headmech version and a URN naming the model and the commit it was made at
    (the weights' hash where no commit was recorded)."""
    import re
    from html import unescape

    text = unescape((site / "index.html").read_text())
    for name in MODELS:
        entry = re.search(
            r"@misc\{headmech_" + re.sub(r"[^A-Za-z0-9]", "_", name) + r",\n(.*?)\n\}", text, re.S
        )
        assert entry, name
        fields = dict(re.findall(r"^  (\w+) = \{(.*)\},?$", entry[1], re.M))
        assert re.fullmatch(r"20\d\d", fields["year"]) and fields["version"]
        prov = json.loads((CATALOG / name / "catalog.json").read_text())["provenance"]
        git = prov["versions"]["headmech_git"]
        if git is None:  # run from a copy outside git (the 1.5B's hours-long publish): the weights
            key = prov["model"]["weights_sha256"][:16]
            assert (
                fields["url"] == f"urn:headmech:catalog:{name}:{key}"
                and "commit" not in fields["note"]
            )
            continue
        assert fields["url"] == f"urn:headmech:catalog:{name}:{git['commit'][:12]}"
        assert f"commit {git['commit']}" in fields["note"]


def test_addresses_keep_the_search_and_the_pinned_query(site, page):
    """A search or a pinned query is in the page's address; opening that address shows
    the same results, or the same view with that query pinned."""
    name = "smollm2-135m"
    page.goto((site / "index.html").as_uri())
    page.fill("#search", f"{name} induction")
    assert page.evaluate("location.hash") == "#q=" + f"{name} induction".replace(" ", "%20")
    got = sorted(page.locator("#results tbody tr td:nth-child(2)").all_inner_texts())
    shared = page.evaluate("location.href")  # (page.url lags a replaceState)
    page.goto("about:blank")
    page.goto(shared)
    assert page.locator("#search").input_value() == f"{name} induction"
    assert sorted(page.locator("#results tbody tr td:nth-child(2)").all_inner_texts()) == got
    head = "L18H6"
    page.goto((site / "heads" / name / f"{head}.html").as_uri())
    page.locator("#view-0 .hm-tok").nth(4).click()
    address = page.evaluate("location.href")
    assert address.endswith("#view-0=4")
    page.goto("about:blank")
    page.goto(address)
    assert page.locator("#view-0").get_attribute("data-pinned") == "4"
    assert page.locator("#view-0 .hm-tok").nth(4).get_attribute("aria-pressed") == "true"
    page.locator("#view-0 .hm-tok").nth(4).click()  # unpinned: the address forgets it
    assert "#view-0" not in page.evaluate("location.href")
    assert not page.errors


def _screenshots():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "docs" / "screenshots.py"
    spec = importlib.util.spec_from_file_location("screenshots", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["screenshots"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_readme_screenshots_show_what_their_captions_say(site, page):
    """Each README screenshot (docs/screenshots.py) carries the caption its pinned view
    earns: opened at the shot's address, the view has that query pinned and shows the
    weights the caption states on the tokens it names; the induction head's largest weight
    is on the token after the earlier copy; where the caption says another token gets more,
    it does."""
    shots = _screenshots()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for shot in shots.SHOTS:
        assert f"![{shots.caption(shot)}](docs/screenshots/{shot.file})" in readme, shot.file
        if shot.probe is None:
            continue
        address = shots.address(shot)
        page.goto((site / address.split("#")[0]).as_uri() + "#" + address.split("#")[1])
        view_id, q = address.split("#")[1].split("=")
        view = page.locator(f"#{view_id}")
        assert view.get_attribute("data-pinned") == q
        shown = [float(x) for x in view.locator(".hm-w").all_inner_texts()]
        c = shots.claim(shot)
        for k, w in c["named"].items():
            assert shown[k] == pytest.approx(w, abs=5e-4), (shot.file, k)
        top = max(range(len(shown)), key=shown.__getitem__)
        if c["top"] is not None:
            assert top == c["top"], shot.file
        else:  # the caption says another token gets more than the one it is about
            assert top == c["max"] and top != c["io"], shot.file
    assert not page.errors
