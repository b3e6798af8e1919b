"""Attention examples (headmech.publish.examples), headmech.show and the site's builder, on the
toy induction model and the committed catalogs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import headmech
from headmech.core.errors import HeadIndexError, InputError
from headmech.core.head_index import HeadIndex
from headmech.publish.examples import own_types, record_examples, update_examples
from headmech.publish.site import build_site, main

CATALOG = Path(__file__).resolve().parent.parent / "catalog"
MODELS = sorted(p.parent.name for p in CATALOG.glob("*/catalog.json"))


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
    # every head of the model, on the ordinary text; the inactive type's probe (domains)
    # only for the heads whose own type it is
    assert set(new["heads"]) == {f"L{la}H{h}" for la in range(2) for h in range(4)}
    assert [t["probe"] for t in new["texts"]] == ["repeated_random", "domains"]
    assert all(rows[0] is not None for rows in new["heads"].values())
    assert update_examples(folder, toy) is False  # up to date: nothing to do
    catalog = json.loads((folder / "catalog.json").read_text())
    assert new["heads"]["L1H0"][1] is None  # an induction head: not on the domains probe
    catalog["types"]["inactive"]["heads"] = [[1, 0]]  # labelled inactive now: stale
    (folder / "catalog.json").write_text(json.dumps(catalog))
    assert update_examples(folder, toy) is True
    rows = json.loads((folder / "examples.json").read_text())["heads"]["L1H0"]
    assert rows[1] is not None and len(rows[1]) == len(new["texts"][1]["tokens"])


def test_own_types_label_then_threshold_then_closest():
    """A head's page shows it on the probe of the types that label it; else of those
    it reaches the threshold of; else of the one it comes closest to (score/threshold)."""
    grid = [[0.9, 0.3, 0.05], [0.1, 0.2, None]]
    catalog = {
        "types": {
            "a": {"heads": [[0, 0]], "threshold": 0.5, "score": grid},
            "b": {"heads": [], "threshold": 0.25, "score": grid},
            "c": {"heads": [], "threshold": 0.1, "score": [[0, 0, 0.09], [0.05, 0.05, None]]},
            "d": {"heads": [], "threshold": None, "score": None},
        }
    }
    assert own_types(catalog, (0, 0)) == ["a"]  # labelled (b and c reached, not labelled)
    assert own_types(catalog, (0, 1)) == ["b"]  # 0.3 >= 0.25 (not labelled: a criterion)
    assert own_types(catalog, (0, 2)) == ["c"]  # 0.09/0.1 beats 0.05/0.25 and 0.05/0.5
    assert own_types(catalog, (1, 0)) == ["c"]  # 0.05/0.1 = 0.5 > 0.1/0.25 = 0.4
    assert own_types(catalog, (1, 2)) == []  # no type scores it


@pytest.mark.parametrize("name", MODELS)
def test_every_head_page_leads_with_its_own_types_probe(name, tmp_path_factory):
    """Every head of every published model has its views, and the first is on its own
    type's probe where that probe was recorded: SmolLM2's name movers on an IOI prompt,
    its retrieval heads on the needle."""
    from headmech.headtypes import get_head_type
    from headmech.publish.site.pages import head_page, load_models

    (m,) = [m for m in load_models(CATALOG) if m.name == name]
    probes = [t["probe"] for t in m.examples["texts"]]
    n_layers, n_heads = m.shape
    assert set(m.examples["heads"]) == {
        f"L{la}H{h}" for la in range(n_layers) for h in range(n_heads)
    }
    own_probe_first = 0
    for head in m.examples["heads"]:
        page = head_page(m, head)
        assert len(page["views"]) >= 1, head
        own = {get_head_type(t).probe for t in own_types(m.catalog, _hx(head))}
        recorded = own & set(probes)
        if recorded - {"prose", "repeated_random"}:  # a probe of its own: shown first
            first = page["views"][0]
            assert any(f" on {p} (" in first for p in recorded), (head, recorded)
            own_probe_first += 1
    if name == "smollm2-135m":
        assert own_probe_first >= 20
        page = head_page(m, "L23H0")  # a name mover: first on an IOI prompt
        assert "L23H0 on ioi (" in page["views"][0] and "name_mover" in page["views"][0]


def _hx(name):
    layer, head = name[1:].split("H")
    return int(layer), int(head)


def test_show_escapes_tokens_and_refuses_bad_heads(toy):
    view = headmech.show(toy, "L1H0")
    assert 'class="hm-view"' in view.data and view._repr_html_() == view.data
    assert "<script>" in view.data  # the view's own script, inlined for a notebook
    # under each view, what the head writes, with its shades inlined (no site.css here)
    assert view.data.count('<div class="writes">') == view.data.count('class="hm-view"')
    assert "<style>.writes-strip" in view.data
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
    classified = capsys.readouterr().out
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
    # no page links what such a site does not have (the guides live in the repository)
    broken = set()
    for page in site.rglob("*.html"):
        for href in re.findall(r'href="([^"#?]+)', page.read_text()):
            if not re.match(r"^[a-z]+:", href) and not (page.parent / href).exists():
                broken.add(f"{page.relative_to(site)} -> {href}")
    assert not broken, sorted(broken)[:5]
    # the classify run ended saying how to get here
    assert f"python -m headmech.publish.site --catalog {out}" in classified


def test_tutorial_pages_get_the_atlas_navigation_and_their_size(tmp_path):
    """A rendered tutorial (tests/test_tutorials.py renders them into site/tutorials/) gets
    the atlas's navigation and says which probe size it ran at; rebuilding replaces the
    frame, never stacks it; a page without the size meta counts as reduced."""
    out = tmp_path / "site"
    (out / "tutorials").mkdir(parents=True)
    head = '<!DOCTYPE html><html><head>\n<meta name="headmech-tutorial-size" content="{}">'
    (out / "tutorials" / "01_a.html").write_text(
        head.format("small") + "</head><body class='jp'>\n<p>cell</p></body></html>"
    )
    (out / "tutorials" / "02_b.html").write_text(
        head.format("published") + "</head><body>\n<p>cell</p></body></html>"
    )
    (out / "tutorials" / "03_c.html").write_text("<html><body><p>old</p></body></html>")
    for _ in range(2):
        build_site(CATALOG / "toy-induction", out)
    small, published, old = (
        (out / "tutorials" / n).read_text() for n in ("01_a.html", "02_b.html", "03_c.html")
    )
    for page in (small, published, old):
        assert page.count('<nav aria-label="site" class="hm-atlas">') == 1
        assert '<a href="../index.html#tutorials">tutorials</a>' in page
        assert '<a href="../models/toy-induction.html">toy-induction</a>' in page
    assert "Run at the reduced tutorial size" in small and "Run at the reduced" in old
    assert "Run at the published probe sizes" in published and "reduced" not in published
    assert small.index("hm-atlas") > small.index("<body class='jp'>")  # inside the body
    index = (out / "index.html").read_text()
    assert 'id="tutorials"' in index and 'href="tutorials/01_a.html"' in index


def test_top_pairs_are_the_largest_weights_without_the_first_token():
    from headmech.publish.attention_view import top_pairs

    tokens = ["<s>", "a", "b", "a", "b"]
    rows = [[1.0], [0.9, 0.1], [0.5, 0.4, 0.1], [0.2, 0.1, 0.6, 0.1], [0.1, 0.05, 0.05, 0.7, 0.1]]
    assert top_pairs(tokens, rows, k=3) == [
        (4, "b", 3, "a", 0.7),
        (3, "a", 2, "b", 0.6),
        (2, "b", 1, "a", 0.4),
    ]
