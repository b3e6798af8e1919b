"""Figures a reader can trust: every head type's heatmap on one fixed scale, the threshold
marked on the colour bar, labelled and borderline heads told apart, signed scores centred."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from headmech.classification.results import HeadCatalog, TypeResult, score_ranges  # noqa: E402
from headmech.core.plot import SCALE, criterion, type_heatmap  # noqa: E402
from headmech.headtypes.registry import HeadIndex  # noqa: E402
from headmech.models import ModelInfo  # noqa: E402
from headmech.publish import main as publish_main  # noqa: E402


def weak_type(name: str = "rare_word") -> TypeResult:
    """A type no head reaches: best 0.2 under a threshold of 0.3 (MiniLM's rare words)."""
    score = torch.tensor([[0.05, 0.20, 0.10], [0.0, 0.15, 0.02]])
    return TypeResult(
        name, "Voita et al. 2019", 0.3, score, [], borderline=[HeadIndex(0, 1)],
        low=score - 0.1, high=score + 0.12,
    )  # fmt: skip


def signed_type() -> TypeResult:
    score = torch.tensor([[-0.25, 0.02, 0.4], [0.11, -0.05, 0.0]])
    return TypeResult("syntactic", "Voita et al. 2019", 0.1, score, [HeadIndex(1, 0)])


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def threshold_marks(ax):
    cbar = ax.collections[0].colorbar
    return [line for line in cbar.ax.get_lines() if line.get_gid() == "threshold"], cbar


def test_a_weak_type_is_drawn_on_the_fixed_scale(ax):
    type_heatmap(weak_type(), ax=ax)
    mesh = ax.collections[0]
    assert mesh.get_clim() == SCALE == (0.0, 1.0)  # not the panel's own 0-0.2
    assert mesh.norm(0.2) == pytest.approx(0.2)  # its best head a fifth up the scale
    marks, cbar = threshold_marks(ax)
    assert len(marks) == 1 and set(marks[0].get_ydata()) == {0.3}
    labels = {t.get_text(): t.get_position()[1] for t in cbar.ax.get_yticklabels()}
    assert labels["≥ 0.3"] == pytest.approx(0.3)


def test_labelled_heads_solid_and_borderline_dashed(ax):
    result = weak_type()
    result.heads = [HeadIndex(1, 2)]
    type_heatmap(result, ax=ax)
    patches = {p.get_gid(): p for p in ax.patches}
    assert patches["labelled"].get_linestyle() in {"-", "solid"}
    assert patches["borderline"].get_linestyle() in {"--", "dashed"}
    assert patches["borderline"].get_xy() == (1, 0)  # head 1 of layer 0: (x=head, y=layer)
    assert patches["labelled"].get_xy() == (2, 1)
    assert "not_labelled" not in patches


def test_heads_above_the_threshold_rejected_by_the_types_own_test_are_dotted(ax):
    """A head at or above the threshold that a further criterion rejects (an induction
    head that does not copy) is outlined too, dotted white, distinct from the labelled."""
    result = weak_type()
    result.heads = [HeadIndex(1, 2)]
    result.not_labelled = [{"head": "L0H3", "score": 0.35, "reason": "copying score -0.2 < 0"}]
    type_heatmap(result, ax=ax)
    patches = {p.get_gid(): p for p in ax.patches}
    assert patches["not_labelled"].get_linestyle() in {":", "dotted"}
    assert patches["not_labelled"].get_xy() == (3, 0)
    assert patches["labelled"].get_xy() == (2, 1)


def test_a_signed_score_diverges_from_zero(ax):
    type_heatmap(signed_type(), ax=ax, scale=(-1.0, 1.0))
    mesh = ax.collections[0]
    assert mesh.get_clim() == (-1.0, 1.0)
    white, red, blue = (mesh.cmap(mesh.norm(v)) for v in (0.0, 1.0, -1.0))
    assert min(white[:3]) > 0.9  # 0 is white
    assert red[0] > 2 * red[2] and blue[2] > 2 * blue[0]  # positive red, negative blue
    marks, _ = threshold_marks(ax)
    assert set(marks[0].get_ydata()) == {0.1}


def test_the_signed_types_are_the_differences():
    """Shares of attention and rates on (0, 1); differences on a range around 0."""
    from headmech.headtypes.registry import head_types

    ranges = score_ranges([*head_types(), "unregistered"])
    signed = {n for n, (lo, _) in ranges.items() if lo < 0}
    assert {"syntactic", "function_vector"} <= signed
    shares = ["induction", "previous_token", "attention_sink", "retrieval", "rare_word"]
    assert not signed & {*shares, "name_mover", "duplicate_token", "positional"}
    assert all(ranges[n] == SCALE for n in [*shares, "unregistered"])
    assert ranges["syntactic"] == (-1.0, 1.0)
    lo, hi = ranges["function_vector"]
    assert lo == -hi and 0.01 < hi < 1  # its threshold 0.01 inside, white at 0


def test_heatmaps_redraw_from_catalog_json_alone(tmp_path):
    """``python -m headmech.publish --heatmaps``: no model, the committed JSON only; every
    panel carries the criterion."""
    info = ModelInfo("minilm-l6", 2, 3, 3, 0, 0, False)
    catalog = HeadCatalog(info, {"rare_word": weak_type(), "syntactic": signed_type()})
    catalog.save(tmp_path / "minilm-l6" / "catalog.json")
    (tmp_path / "minilm-l6" / "heatmaps").mkdir()
    (tmp_path / "minilm-l6" / "heatmaps" / "gone.png").write_bytes(b"stale")
    assert publish_main(["--heatmaps", "--models", "minilm-l6", "--out", str(tmp_path)]) == 0
    drawn = sorted(p.name for p in (tmp_path / "minilm-l6" / "heatmaps").glob("*.png"))
    assert drawn == ["rare_word.png", "syntactic.png"]
    assert (tmp_path / "minilm-l6" / "heatmaps" / "rare_word.png").read_bytes()[:4] == b"\x89PNG"
    fig = catalog.heatmap()
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert "labelled: score ≥ 0.3" in titles[0] and "score ≥ threshold" in fig._suptitle.get_text()
    plt.close(fig)
    assert json.loads((tmp_path / "minilm-l6" / "catalog.json").read_text())["types"]


def test_scores_beyond_the_range_get_an_arrow(ax):
    result = signed_type()
    type_heatmap(result, ax=ax, scale=(-0.25, 0.25))  # 0.4 beyond the top of the range
    cbar = ax.collections[0].colorbar
    assert cbar.extend == "max" and ax.collections[0].get_clim() == (-0.25, 0.25)


def test_the_title_says_when_a_type_has_its_own_test():
    """A name mover needs a positive copy score too: a head above the threshold may stay
    unlabelled, and the title must not claim ``score ≥ t`` alone then."""
    result = signed_type()  # (0, 2) 0.4 and (1, 0) 0.11 reach 0.1; only (1, 0) labelled
    assert criterion(result) == "score ≥ 0.1 and the type's own test"
    result.heads = [HeadIndex(0, 2), HeadIndex(1, 0)]
    assert criterion(result) == "score ≥ 0.1"
