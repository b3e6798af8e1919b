"""The head atlas (headmech.publish.site) in a real browser: Chromium driven by Playwright.

The site is built into a temporary folder from the committed catalogs and opened from the
file system, as a reader opens it. The browser is found by :func:`find_chromium`
($HEADMECH_CHROMIUM, then chromium / chromium-browser / google-chrome on PATH, then
Playwright's own download); with none these tests skip with one line saying how to install
one, unless HEADMECH_REQUIRE_BROWSER=1 (CI's ``.ci/run``), where they fail. Screenshots of the index and of one head's page go to the test's
temporary folder, or to $HEADMECH_SCREENSHOTS (``make site-screenshots``: docs/screenshots).
"""

from __future__ import annotations

import json
import os
import shutil
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
    # about 12 kB a head page: a model that labels most heads as sinks (SmolLM2, Qwen2.5)
    # adds about 3 MB; five models' catalogs stay under 8 MB (tutorials apart)
    assert summary.bytes < 8_000_000, f"the site is {summary.bytes / 1e6:.1f} MB"
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
  ...[...d.querySelectorAll('a[href]')].map(a => a.href),
  ...[...d.querySelectorAll('img')].map(i => i.src),
  ...[...d.querySelectorAll('link[href], script[src]')].map(e => e.href || e.src)],
  [...d.images].filter(i => !i.naturalWidth).map(i => i.src),
  d.querySelectorAll('.hm-view:not([data-ready])').length]"""
BATCH = 128  # head pages loaded at once, as hidden frames of one page (2x faster than goto)


def _open(page, site: Path, urls: list[str]) -> list[tuple[str, list]]:
    """Load ``urls`` and return each one's :data:`LINKS`: pages one by one, head pages in
    batches of frames (the browser runs with --allow-file-access-from-files)."""
    heads = [u for u in urls if "/heads/" in u]
    out = []
    for url in (u for u in urls if "/heads/" not in u):
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
                assert parts.scheme == "file", f"{url} links outside the file system: {link}"
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
            shown = set(section.locator("table.heads a").all_inner_texts())
            assert shown == {f"L{la}H{h}" for la, h in result["heads"]}, (name, t)
            if (CATALOG / name / "heatmaps" / f"{t}.png").exists():
                assert section.locator("img.heatmap").count() == 1
            v = result["details"].get("validation") or {}
            said = v.get("verdict")
            if said == "no heads":  # no effect shown for a type without heads
                assert "No labelled heads: nothing to validate" in section.inner_text()
            elif said is not None:  # the catalog's verdict, as catalog/README.md shows it
                assert section.locator("b.verdict").first.inner_text() == said, (name, t)
            k = (v.get("k_composition") or {}).get("verdict")
            if k is not None:  # previous-token heads' K-composition, as the README has it
                assert section.locator("b.verdict").nth(1).inner_text() == k, (name, t)
            for e in result.get("not_labelled", []):  # every rejected head, with its reason
                assert f"{e['head']} " in section.locator("p.rejected").inner_text()
                assert e["reason"] in section.locator("p.rejected").inner_text()


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
    assert n_views == len(examples["texts"])
    for v, text in enumerate(examples["texts"]):
        view = page.locator(f"#view-{v}")
        q = len(text["tokens"]) - 1  # the last query sees every token
        assert view.locator(".hm-w").count() == 0  # nothing shown before a hover
        view.locator(".hm-tok").nth(q).hover()
        shown = [float(x) for x in view.locator(".hm-w").all_inner_texts()]
        want = examples["heads"][head][v][q]
        assert shown == pytest.approx(want, abs=5e-4), (head, v)
        view.locator(".hm-tok").nth(2).click()  # another query: its own row
        assert len(view.locator(".hm-w").all_inner_texts()) == len(examples["heads"][head][v][2])
    assert not page.errors
    out = Path(os.environ.get("HEADMECH_SCREENSHOTS") or site / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    last = len(examples["texts"]) - 1  # the repeated tokens: an induction head's stripe
    page.locator(f"#view-{last} .hm-tok").nth(len(examples["texts"][last]["tokens"]) - 1).hover()
    page.screenshot(path=str(out / "head.png"))
    page.goto((site / "index.html").as_uri())
    page.screenshot(path=str(out / "index.png"))
    assert (out / "head.png").stat().st_size > 10_000 and (
        out / "index.png"
    ).stat().st_size > 10_000


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
