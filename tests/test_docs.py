"""The documentation's code runs: every Python block of README.md, then docs/python.md's, in
order, in one namespace (and docs/contributing-head-types.md's, in tests/test_contributing.py).
README.md is a front page of at most :data:`MAX_README_LINES` lines; the guides it links
exist, every relative link and anchor in it and in the guides resolves, and what it says
about `make` and the head types is the Makefile's and the registry's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib

import headmech
from headmech.headtypes.registry import head_types

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 250
# the Python blocks this module runs, in order, in one namespace
EXECUTED = ["README.md", "docs/python.md"]


def python_blocks(path: Path) -> list[str]:
    """The fenced ```python blocks of a Markdown file."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def pages() -> list[Path]:
    """README.md and the guides under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (their ``#`` lines are no headings)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _links(text: str) -> list[str]:
    """The targets of the Markdown links and images outside code blocks."""
    return re.findall(r"\]\(([^)\s]+)\)", _prose(text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", _prose(path.read_text()), re.M)}


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of ``text``."""
    assert f"\n## {heading}\n" in text, f"no section {heading!r}"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_every_markdown_python_block_is_collected():
    """A block this suite runs nowhere would be a block that can rot."""
    tested = {*EXECUTED, "docs/contributing-head-types.md"}
    for md in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("headmech/**/*.md")]:
        rel = str(md.relative_to(ROOT))
        if python_blocks(md):
            assert rel in tested, f"{rel} has Python blocks that no test runs"


@pytest.mark.slow
def test_readme_python_runs(minilm, monkeypatch, tmp_path):
    """The README's blocks, then docs/python.md's, as a reader would paste them (the
    bundled model is the session's, to load it once)."""
    monkeypatch.chdir(tmp_path)
    real = headmech.load_model
    monkeypatch.setattr(
        headmech,
        "load_model",
        lambda name, **kw: minilm if name == "minilm-l6" else real(name, **kw),
    )
    ns: dict = {}
    blocks = [(md, code) for md in EXECUTED for code in python_blocks(ROOT / md)]
    assert len(python_blocks(ROOT / "README.md")) >= 1 and len(blocks) >= 4
    for i, (md, code) in enumerate(blocks):
        exec(compile(code, f"{md} block {i}", "exec"), ns)
    # what the comments in the blocks promise
    assert (tmp_path / "out" / "catalog.json").exists() and (
        tmp_path / "out" / "heatmap.png"
    ).exists()
    assert headmech.HeadIndex(0, 2) in ns["catalog"].heads("previous_token")
    assert tuple(ns["stats"].mean("first.mass").shape) == (6, 12)
    assert tuple(ns["means"].shape) == (6, 12, 32) and ns["per_head"].shape == (12,)
    assert float(ns["per_head"].max()) > ns["clean"]


def test_readme_is_a_front_page():
    """At most MAX_README_LINES lines; everything else lives in the guides it links."""
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move a section into docs/"


def test_readme_links_every_guide_and_each_exists():
    readme = (ROOT / "README.md").read_text()
    linked = {t.split("#")[0] for t in _links(readme) if t.startswith("docs/")}
    guides = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert {g for g in linked if g.endswith(".md")} <= guides, "README links a missing guide"
    assert guides <= linked, f"guides the README does not link: {sorted(guides - linked)}"


def test_relative_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists, and an
    anchor into a Markdown file names one of its headings."""
    bad = []
    for page in pages():
        for target in _links(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, frag = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_link_checks_can_fail(tmp_path):
    """The checks above see a missing file and a missing heading."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](page.md#title) [b](gone.md) [c](#nowhere)\n```\n# x\n```\n")
    assert _links(page.read_text()) == ["page.md#title", "gone.md", "#nowhere"]
    assert anchors(page) == {"title"}
    assert anchor("Scaling up: dtypes, many processes") == "scaling-up-dtypes-many-processes"


def _recipes(makefile: str) -> dict[str, tuple[str, str]]:
    """target -> (its prerequisites, its recipe lines joined)."""
    out = {}
    for m in re.finditer(r"^([\w-]+):([^\n=]*)\n((?:\t[^\n]*\n)*)", makefile, re.M):
        out[m.group(1)] = (m.group(2).strip(), m.group(3))
    return out


def test_make_commands_are_the_makefiles():
    """Every `make X` the README and the guides name is a target, and the README says
    what `make demo`, `make test` and `make test-fast` do as the Makefile does it."""
    makefile = (ROOT / "Makefile").read_text()
    recipes = _recipes(makefile)
    for page in pages():
        for target in re.findall(r"(?:^|`)make ([\w-]+)", page.read_text(), re.M):
            assert target in recipes, f"{page.relative_to(ROOT)}: `make {target}` is no target"
    readme = (ROOT / "README.md").read_text()
    flat = " ".join(readme.split())
    demo_out = re.search(r"^DEMO_OUT \?= (\S+)", makefile, re.M).group(1)
    demo = recipes["demo"][1].strip().replace("$(VENV)/bin/", "").replace("$(DEMO_OUT)", demo_out)
    line = next(x for x in readme.splitlines() if x.startswith("make demo "))
    assert recipes["demo"][0] == "setup" and line.endswith(f"sets up .venv, then: {demo}")
    line = next(x for x in readme.splitlines() if x.startswith("make test "))
    assert recipes["test"][0] == "setup" and "-j2 lint docs" in recipes["test"][1]
    assert (
        '-m "not tutorial"' in recipes["test"][1] and "-m tutorial" in recipes["test-tutorials"][1]
    )
    assert "sets up .venv, lints (ruff, mypy, import-linter), builds the API docs" in line
    for tool in ("ruff check", "mypy", "lint-imports"):
        assert tool in recipes["lint"][1]
    assert '-m "not slow"' in recipes["test-fast"][1]
    assert "`make test-fast` runs only the tests not marked `slow`" in flat
    assert "These two are the whole set-up." in flat


def test_readme_lists_every_head_type():
    """The README's head-type table has one row per type the package registers
    (headmech/headtypes/), citing what `headmech types` prints (``HeadType.reference``)."""
    section = _section((ROOT / "README.md").read_text(), "Head types")
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", section, re.M))
    types = {
        n: c for n, c in head_types().items() if c.__module__.startswith("headmech.headtypes.")
    }
    assert len(types) >= 17 and set(rows) == set(types), set(rows) ^ set(types)
    for name, cls in types.items():
        assert rows[name] == cls.reference, f"{name}: README cites {rows[name]!r}"


def test_readme_says_which_library_does_what():
    """Every runtime dependency has a row in the README's library table."""
    section = _section((ROOT / "README.md").read_text(), "Which library does what")
    table = re.sub(r"[\s_-]", "", section.lower())
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0]
        assert re.sub(r"[\s_-]", "", name.lower()) in table, f"{name} missing from the table"


def test_architecture_page_is_generated_from_the_contracts():
    """docs/architecture.md's packages and layers are what docs/build_architecture.py makes
    of pyproject.toml's contracts and the modules' docstrings: a moved, added or renamed
    module, or a changed first sentence, makes it stale."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import build_architecture
    finally:
        sys.path.remove(str(ROOT / "docs"))
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert build_architecture.updated(text) == text, (
        "docs/architecture.md is stale: run python docs/build_architecture.py"
    )
    for package in ("core", "stream", "models", "headtypes", "classification", "cli"):
        assert f"`headmech/{package}/`" in text
