"""The documentation's code runs: every Python block of README.md, in order, in one
namespace (and docs/contributing-head-types.md's, in tests/test_packaging.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import headmech

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    """The fenced ```python blocks of a Markdown file."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_every_markdown_python_block_is_collected():
    """A block this suite runs nowhere would be a block that can rot."""
    tested = {"README.md", "docs/contributing-head-types.md"}
    for md in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("headmech/**/*.md")]:
        rel = str(md.relative_to(ROOT))
        if python_blocks(md):
            assert rel in tested, f"{rel} has Python blocks that no test runs"


@pytest.mark.slow
def test_readme_python_runs(minilm, monkeypatch, tmp_path):
    """The README's blocks, as a reader would paste them (the bundled model is the
    session's, to load it once)."""
    monkeypatch.chdir(tmp_path)
    real = headmech.load_model
    monkeypatch.setattr(
        headmech,
        "load_model",
        lambda name, **kw: minilm if name == "minilm-l6" else real(name, **kw),
    )
    ns: dict = {}
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 3
    for i, code in enumerate(blocks):
        exec(compile(code, f"README block {i}", "exec"), ns)
    # what the comments in the blocks promise
    assert (tmp_path / "out" / "catalog.json").exists() and (
        tmp_path / "out" / "heatmap.png"
    ).exists()
    assert headmech.HeadIndex(0, 2) in ns["catalog"].heads("previous_token")
    assert tuple(ns["stats"].mean("first.mass").shape) == (6, 12)
    assert tuple(ns["means"].shape) == (6, 12, 32) and ns["per_head"].shape == (12,)
    assert float(ns["per_head"].max()) > ns["clean"]
