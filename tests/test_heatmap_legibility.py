"""The published heatmaps (``catalog/<model>/heatmaps/<type>.png``) read at the atlas's
width: nothing cut at the figure's edges, every text at least 11 pixels high when the image
is shown 520 pixels wide, no two labels on top of each other (30 layers included).

Measured with matplotlib's own renderer: each text's window extent after a draw."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from PIL import Image  # noqa: E402

from headmech.classification.results import TypeResult  # noqa: E402
from headmech.core.head_index import HeadIndex  # noqa: E402
from headmech.publish.heatmaps import heatmap_figure, heatmap_png  # noqa: E402

SHOWN_PX = 520  # the atlas's img.heatmap max-width
MIN_TEXT_PX = 11


def grid_type(name: str, n_layers: int, n_heads: int, threshold: float) -> TypeResult:
    """A type on an ``n_layers x n_heads`` grid with labelled, borderline and rejected heads."""
    g = torch.Generator().manual_seed(n_layers * 100 + n_heads)
    score = torch.rand(n_layers, n_heads, generator=g) * 0.6
    score[-1, 1] = 0.95
    score[0, 0] = threshold + 0.02
    result = TypeResult(
        name, "Voita, Talbot, Moiseev et al. 2019", threshold, score, [HeadIndex(n_layers - 1, 1)],
        borderline=[HeadIndex(0, 2)], low=score - 0.1, high=score + 0.1,
    )  # fmt: skip
    result.not_labelled = [{"head": "L0H0", "score": float(score[0, 0]), "reason": "own test"}]
    return result


GRIDS = [  # SmolLM2's grid, Gemma 3's, the toy's; a signed scale on one
    ("negative_name_mover", 30, 9, 0.4),
    ("syntactic", 18, 4, 0.1),
    ("induction", 2, 4, 0.4),
]


def _texts(fig):
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _across(t: Text, box) -> float:
    """The text's height across its lines, per line (a label turned 90°: its width)."""
    size = box.width if round(t.get_rotation()) % 180 == 90 else box.height
    return size / (t.get_text().count("\n") + 1)


@pytest.fixture(params=GRIDS, ids=lambda g: f"{g[1]}x{g[2]}")
def drawn(request):
    name, n_layers, n_heads, threshold = request.param
    fig = heatmap_figure(name, grid_type(name, n_layers, n_heads, threshold), "qwen2.5-coder-0.5b")
    fig.canvas.draw()
    yield fig, fig.canvas.get_renderer(), n_layers
    plt.close(fig)


def test_no_text_is_cut_at_the_figure_edges(drawn):
    fig, renderer, _ = drawn
    for t in _texts(fig):
        box = t.get_window_extent(renderer)
        inside = box.x0 >= -0.5 and box.y0 >= -0.5
        inside &= box.x1 <= fig.bbox.width + 0.5 and box.y1 <= fig.bbox.height + 0.5
        assert inside, f"{t.get_text()[:40]!r} at {box.bounds} leaves the {fig.bbox.bounds} figure"


def test_every_text_is_at_least_11_pixels_at_520_wide(drawn):
    fig, renderer, _ = drawn
    scale = SHOWN_PX / fig.bbox.width
    texts = _texts(fig)
    assert {"head", "layer", "score", "0", "1"} <= {t.get_text() for t in texts}
    for t in texts:
        font_px = t.get_fontsize() * fig.dpi / 72 * scale
        assert font_px >= MIN_TEXT_PX, f"{t.get_text()[:40]!r}: {font_px:.1f} px"
        line_px = _across(t, t.get_window_extent(renderer)) * scale
        assert line_px >= MIN_TEXT_PX, f"{t.get_text()[:40]!r}: {line_px:.1f} px a line"


def test_no_two_texts_overlap(drawn):
    """Layer labels on 30 layers, the colour bar's ticks beside the threshold's ``≥ t``,
    the caption under the head axis: none on another."""
    fig, renderer, n_layers = drawn
    ax = fig.axes[0]
    layers = [t for t in ax.get_yticklabels() if t.get_visible() and t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in layers]
    assert len(layers) >= min(n_layers, 10)  # labelled, if not each layer
    for a, b in zip(boxes, boxes[1:], strict=False):
        assert not a.overlaps(b), "two layer labels overlap"
    texts = _texts(fig)
    for i, a in enumerate(texts):
        for b in texts[i + 1 :]:
            assert not a.get_window_extent(renderer).overlaps(b.get_window_extent(renderer)), (
                f"{a.get_text()[:30]!r} overlaps {b.get_text()[:30]!r}"
            )


def test_the_png_is_the_figure_as_measured(tmp_path):
    """Saved at the size measured above (no tight bounding box that would rescale it)."""
    name, n_layers, n_heads, threshold = GRIDS[0]
    path = tmp_path / "t.png"
    heatmap_png(name, grid_type(name, n_layers, n_heads, threshold), "smollm2-135m", path)
    fig = heatmap_figure(name, grid_type(name, n_layers, n_heads, threshold), "smollm2-135m")
    width, height = fig.bbox.width, fig.bbox.height
    plt.close(fig)
    saved = Image.open(path).size
    assert saved[0] == round(width) == SHOWN_PX and abs(saved[1] - height) < 1


@pytest.mark.parametrize(("n_types", "n_layers", "n_heads"), [(6, 6, 12), (17, 30, 9), (2, 2, 4)])
def test_the_command_lines_catalog_heatmap_cuts_no_text(n_types, n_layers, n_heads):
    """``headmech classify``'s heatmap.png (every type in one figure, the labelling rule as
    its caption): no text leaves the figure and the caption overlaps no panel's title."""
    from types import SimpleNamespace

    from headmech.core.plot import catalog_heatmap

    names = ["syntactic", "induction", "positional", "rare_word", "previous_token", "retrieval"]
    types = {
        f"{names[i % len(names)]}{i // len(names) or ''}": grid_type(
            names[i % len(names)], n_layers, n_heads, 0.4
        )
        for i in range(n_types)
    }
    catalog = SimpleNamespace(
        types=types, model=SimpleNamespace(name="minilm-l6", n_layers=n_layers, n_heads=n_heads)
    )
    fig = catalog_heatmap(catalog)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for t in _texts(fig):
        box = t.get_window_extent(renderer)
        inside = box.x0 >= -0.5 and box.y0 >= -0.5
        inside &= box.x1 <= fig.bbox.width + 0.5 and box.y1 <= fig.bbox.height + 0.5
        assert inside, f"{t.get_text()[:40]!r} at {box.bounds} leaves the {fig.bbox.bounds} figure"
    caption = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        title = ax.title.get_window_extent(renderer)
        assert not (ax.title.get_text() and caption.overlaps(title)), ax.title.get_text()
    plt.close(fig)
