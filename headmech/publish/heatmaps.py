"""The published heatmaps: one PNG per head type and model, drawn to be read at the width
the atlas shows them (every text at least 11 pixels high, nothing cut at the edges, layer
labels that do not overlap), from a catalog or from ``catalog.json`` alone."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headmech.classification.results import HeadCatalog, TypeResult

__all__ = ["heatmap_figure", "heatmap_png", "redraw_heatmaps", "write_heatmaps"]


HEATMAP_PX = 520
"""Width of a published heatmap in pixels: the atlas shows it at this width (its CSS
``max-width``), one image pixel a screen pixel, so a font size here is the size read."""
HEATMAP_DPI = 100
HEATMAP_FONTS = {"ticks": 9.0, "labels": 10.0, "caption": 8.5}
"""Font sizes (points) of a published heatmap: at :data:`HEATMAP_DPI`, 12.5, 13.9 and
11.8 pixels (every text at least 11 pixels high at 520 pixels)."""
_ROW_PX, _MAX_MAP_PX, _MIN_MAP_PX = 20, 600, 200  # a layer's row; the score grid's height


def _wrap(text: str, font_pt: float, width_px: float) -> str:
    """``text`` in lines that fit ``width_px`` (DejaVu Sans: about 0.6 em a character),
    broken after each ``;`` too."""
    import textwrap

    chars = max(20, int(width_px / (0.62 * font_pt * HEATMAP_DPI / 72)))
    parts = [p.strip() for p in text.split("; ")]
    lines = [textwrap.fill(p, chars) for p in parts]
    return ";\n".join(lines)


def heatmap_figure(name: str, r: TypeResult, model: str) -> Any:
    """The figure :func:`heatmap_png` saves: :data:`HEATMAP_PX` wide at
    :data:`HEATMAP_DPI`, laid out by matplotlib's constrained layout (title, colour bar and
    caption inside the figure), a layer's row :data:`_ROW_PX` high up to 30 layers (deeper
    models: a 600-pixel grid, every k-th layer labelled), fonts :data:`HEATMAP_FONTS`."""
    import math

    import matplotlib.pyplot as plt

    from headmech.classification.results import score_ranges
    from headmech.core.plot import CRITERION, criterion, type_heatmap

    n_layers, n_heads = r.score.shape
    fonts = HEATMAP_FONTS
    px = HEATMAP_DPI / 72  # pixels per point
    grid_h = min(_MAX_MAP_PX, max(_MIN_MAP_PX, _ROW_PX * n_layers))
    grid_w = HEATMAP_PX - 170  # the layer labels at left, the colour bar and its ticks at right
    # a label needs its line height (1.2 em, and a gap) per row; a head's, its width
    layer_step = math.ceil(1.3 * fonts["ticks"] * px / (grid_h / n_layers))
    label_w = len(str(n_heads - 1)) * 0.62 * fonts["ticks"] * px + 8
    head_step = math.ceil(label_w / (grid_w / n_heads))
    title = _wrap(f"{model}: {name} ({r.reference})", fonts["labels"], HEATMAP_PX - 20)
    title += f"\nlabelled: {criterion(r)}"
    caption = _wrap(CRITERION, fonts["caption"], HEATMAP_PX - 20)
    # around the grid: the title's lines, the head ticks and label, the caption's lines
    n_title, n_caption = title.count("\n") + 1, caption.count("\n") + 1
    text_px = 1.25 * px * (fonts["labels"] * (n_title + 2) + fonts["caption"] * n_caption)
    height = grid_h + text_px + 50
    fig, ax = plt.subplots(
        figsize=(HEATMAP_PX / HEATMAP_DPI, height / HEATMAP_DPI), dpi=HEATMAP_DPI,
        layout="constrained",
    )  # fmt: skip
    every = (layer_step, head_step)
    type_heatmap(r, ax=ax, title=title, scale=score_ranges([name])[name], every=every)
    ax.title.set_fontsize(fonts["labels"])
    for text in (ax.xaxis.label, ax.yaxis.label):
        text.set_fontsize(fonts["labels"])
    ax.tick_params(labelsize=fonts["ticks"])
    if ax.collections and (bar := ax.collections[0].colorbar) is not None:
        bar.ax.tick_params(labelsize=fonts["ticks"])
        bar.ax.yaxis.label.set_fontsize(fonts["labels"])
    fig.supxlabel(caption, fontsize=fonts["caption"])
    return fig


def heatmap_png(name: str, r: TypeResult, model: str, path: Path) -> None:
    """One type's score as a seaborn heatmap on the fixed scale (:func:`headmech.core.plot.type_heatmap`:
    the threshold marked on the colour bar, labelled heads solid, borderline heads dashed),
    drawn by :func:`heatmap_figure`."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(name, r, model)
    # no "Software" entry: the PNG's bytes do not change with matplotlib's version
    fig.savefig(path, dpi=HEATMAP_DPI, metadata={"Software": None})
    plt.close(fig)


def write_heatmaps(catalog: HeadCatalog, folder: Path) -> None:
    """``folder/<type>.png`` for every type of ``catalog``; stale PNGs are removed."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        if old.stem not in catalog.types:
            old.unlink()
    for name, r in catalog.types.items():
        heatmap_png(name, r, catalog.model.name, folder / f"{name}.png")


def redraw_heatmaps(root: Path, names: list[str]) -> None:
    """``--heatmaps``: each model's ``heatmaps/`` drawn again from its committed
    ``catalog.json`` (no model runs: after a change to the figures alone)."""
    from headmech.classification.results import HeadCatalog

    for name in names:
        write_heatmaps(HeadCatalog.load(root / name / "catalog.json"), root / name / "heatmaps")
        print(f"redrew {root / name / 'heatmaps'}", file=sys.stderr)
