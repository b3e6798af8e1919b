"""Attention examples (headmech.publish.examples), headmech.show and the site's builder, on the
toy induction model and the committed catalogs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import headmech
from headmech.core.errors import HeadIndexError, InputError
from headmech.core.head_index import HeadIndex
from headmech.publish.examples import record_examples, update_examples
from headmech.publish.site import build_site, main

CATALOG = Path(__file__).resolve().parent.parent / "catalog"


@pytest.fixture(scope="module")
def toy():
    return headmech.load_model("toy-induction")


def test_recorded_rows_are_the_hook_pattern(toy):
    heads = [HeadIndex(1, 0), HeadIndex(0, 3)]
    data = record_examples(toy, heads)
    assert [t["probe"] for t in data["texts"]] == ["repeated_random"]  # no English: no prose
    assert all(len(t["ids"]) == len(t["tokens"]) for t in data["texts"])  # shown on hover
    ids = toy.tokenizer.convert_tokens_to_ids(data["texts"][0]["tokens"])
    _, cache = toy.run_with_cache(torch.tensor([ids]))
    for h in heads:
        rows = data["heads"][str(h)][0]
        want = cache[f"blocks.{h.layer}.attn.hook_pattern"][0, h.head]
        assert [len(r) for r in rows] == list(range(1, len(ids) + 1))  # causal rows
        for q, row in enumerate(rows):
            assert row == pytest.approx(want[q, : q + 1].tolist(), abs=6e-4)
            assert sum(row) == pytest.approx(1.0, abs=0.02)


def test_induction_head_example_shows_the_stripe(toy):
    """On the repeated half, the toy's induction head L1H0 attends most to the token after
    the earlier copy (position q - half + 1)."""
    data = record_examples(toy, [HeadIndex(1, 0)])
    rows = data["heads"]["L1H0"][0]
    half = (len(rows) - 1) // 2
    hits = [
        max(range(q + 1), key=rows[q].__getitem__) == q - half + 1
        for q in range(half + 1, len(rows))
    ]
    assert sum(hits) / len(hits) > 0.8


def test_update_examples_reproduces_the_committed_file_and_skips_when_current(toy, tmp_path):
    folder = tmp_path / "toy-induction"
    shutil.copytree(CATALOG / "toy-induction", folder)
    (folder / "examples.json").unlink()
    assert update_examples(folder, toy) is True
    new = json.loads((folder / "examples.json").read_text())
    committed = json.loads((CATALOG / "toy-induction" / "examples.json").read_text())
    assert new == committed
    assert update_examples(folder, toy) is False  # up to date: nothing to do
    catalog = json.loads((folder / "catalog.json").read_text())
    catalog["types"]["duplicate_token"]["heads"] = [[0, 1]]  # another labelled head: stale
    (folder / "catalog.json").write_text(json.dumps(catalog))
    assert update_examples(folder, toy) is True
    assert "L0H1" in json.loads((folder / "examples.json").read_text())["heads"]


def test_show_escapes_tokens_and_refuses_bad_heads(toy):
    view = headmech.show(toy, "L1H0")
    assert 'class="hm-view"' in view.data and view._repr_html_() == view.data
    assert "<script>" in view.data  # the view's own script, inlined for a notebook
    assert headmech.show(toy, HeadIndex(1, 0)).data == headmech.show(toy, (1, 0)).data == view.data
    with pytest.raises(InputError, match="show: 'head 3' does not name a head: write it as L"):
        headmech.show(toy, "head 3")
    with pytest.raises(HeadIndexError, match="outside the model"):
        headmech.show(toy, (5, 0))
    with pytest.raises(InputError, match="non-empty"):
        headmech.show(toy, (1, 0), "  ")


def test_site_without_catalogs_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(InputError, match="no published catalog"):
        build_site(tmp_path, tmp_path / "site")
    assert main(["--catalog", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no published catalog") and err.count("\n") == 1


def test_site_builds_from_a_classify_output_folder(tmp_path, capsys):
    """``python -m headmech.publish.site --catalog DIR`` takes the folder ``headmech classify
    --out DIR`` writes (catalog.json directly inside) as well as the published layout
    (catalog/<model>/catalog.json), and builds the atlas of that one model."""
    from headmech.cli import main as cli

    out = tmp_path / "classified"
    argv = ["classify", "toy-induction", "--types", "induction", "--n-sequences", "4"]
    assert cli([*argv, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["--catalog", str(out)]) == 0
    said = capsys.readouterr().out
    site = out / "site"
    assert said.startswith("site: ") and str(site / "index.html") in said
    assert (site / "models" / "toy-induction.html").is_file()
    assert "toy-induction" in (site / "index.html").read_text()
    labelled = json.loads((out / "catalog.json").read_text())["types"]["induction"]["heads"]
    assert labelled and all(
        (site / "heads" / "toy-induction" / f"L{a}H{b}.html").is_file() for a, b in labelled
    )
    assert (site / "types" / "induction.html").is_file()
