"""Seaborn figures of per-head results.

Every function returns its figure; with a ``path`` it saves the figure there and closes
it. The results draw themselves with these functions (``HeadCatalog.plot``, ...), so this
module imports none of them: a catalog or a pruning result is passed in as it is. No backend is chosen here: matplotlib picks a non-interactive one on a machine
without a display, notebooks keep their inline backend, and the command line selects
Agg when it starts.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import seaborn as sns
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "SCALE",
    "catalog_heatmap",
    "criterion",
    "finish",
    "head_heatmap",
    "pattern_heatmap",
    "pruning_curve",
    "score_heatmap",
    "type_heatmap",
]


def finish(fig: Figure, path: str | os.PathLike | None, *, layout: bool = True) -> Figure:
    """Lay the figure out; with a ``path``, save it there (110 dpi) and close it."""
    if layout:
        fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def head_heatmap(
    score: Tensor, ax: Any = None, title: str = "", heads: Any = (), **kwargs: Any
) -> Any:
    """A layer x head heatmap of a ``[n_layers, n_heads]`` score on ``ax`` (default: the
    current axes); ``heads`` (``(layer, head)`` pairs, e.g. the labelled ones) are outlined
    in red. Returns the axes."""
    ax = ax if ax is not None else plt.gca()
    data = score.detach().float().cpu().numpy()
    kwargs.setdefault("cmap", "viridis")
    kwargs.setdefault("cbar", True)
    sns.heatmap(data, ax=ax, square=False, xticklabels=True, yticklabels=True, **kwargs)
    for layer, head in heads:
        ax.add_patch(plt.Rectangle((head, layer), 1, 1, fill=False, edgecolor="red", lw=1.5))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    return ax


SCALE = (0.0, 1.0)
"""The default colour scale of a head type's score (:func:`type_heatmap`): the same for
every panel and model, so a colour means the same score everywhere."""


def _outline(ax: Any, heads: Any, **style: Any) -> None:
    for layer, head in heads:
        ax.add_patch(plt.Rectangle((head, layer), 1, 1, fill=False, **style))


def _layer_head(name: str) -> tuple[int, int]:
    """``"L5H1"`` → ``(5, 1)`` (this module sits below :mod:`headmech.core.head_index`)."""
    layer, head = str(name).upper().lstrip("L").split("H")
    return int(layer), int(head)


def _mark_threshold(cbar: Any, threshold: float, lo: float, hi: float) -> None:
    """A black line across the colour bar at ``threshold``, its tick labelled ``≥ t``."""
    cbar.ax.axhline(threshold, color="black", lw=2, gid="threshold")
    near = 0.08 * (hi - lo)  # ticks closer than this to the mark would overlap its label
    ticks = [t for t in (lo, (lo + hi) / 2, hi) if abs(t - threshold) > near]
    ticks = sorted([*ticks, threshold])
    cbar.set_ticks(ticks, labels=[f"≥ {t:g}" if t == threshold else f"{t:g}" for t in ticks])


@contextmanager
def _without_seaborns_draw() -> Iterator[None]:
    """seaborn's heatmap draws the whole figure after each panel, only to rotate tick labels
    that overlap (``seaborn.matrix._draw_figure``); :func:`type_heatmap` sets the rotation
    itself, so that draw is pure cost, and it grows with the figure: the 17 panels of a
    catalog figure took 12 s, nearly all of it 17 draws of the panels before. Skipped
    here (where seaborn names the function otherwise, nothing is skipped)."""
    import seaborn.matrix as matrix

    draw = getattr(matrix, "_draw_figure", None)
    if draw is None:
        yield
        return
    matrix._draw_figure = lambda fig: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        matrix._draw_figure = draw  # type: ignore[attr-defined]


def type_heatmap(
    result: Any,
    ax: Any = None,
    title: str = "",
    *,
    scale: tuple[float, float] = SCALE,
    cbar: bool = True,
    every: tuple[int, int] = (1, 1),
) -> Any:
    """A head type's layer x head score on a fixed scale, as a reader can compare panels.

    ``result`` is a :class:`~headmech.classification.results.TypeResult` (or anything with ``score``,
    ``threshold``, ``heads`` and ``borderline``). The colours run over ``scale`` (the
    type's ``HeadType.score_range``: ``viridis`` over 0-1; ``RdBu_r``, white at 0, when the
    range spans both signs), never over the panel's own range: a best score of 0.2 under a
    threshold of 0.3 stays dark. Scores beyond the range get an arrow on the colour bar.
    The threshold is a line on the colour bar (its tick ``≥ t``: the criterion); labelled
    heads (score ≥ threshold) are outlined solid red, borderline heads (their 95% interval
    contains the threshold) dashed orange, heads at or above the threshold that a further
    criterion rejects (``result.not_labelled``) dotted white. ``every``: label every k-th
    ``(layer, head)`` (every row and column is drawn; on a short panel of many layers every
    label would overlap its neighbours); the layer labels read horizontally. Returns the
    axes (its colour bar: ``ax.collections[0].colorbar``).
    """
    ax = ax if ax is not None else plt.gca()
    lo, hi = scale
    signed = lo < 0 < hi  # symmetric: RdBu_r is white at 0 as it is; else seaborn recentres it
    data = result.score.detach().float().cpu().numpy()
    finite = data[~(data != data)]
    over, under = bool((finite > hi).any()), bool((finite < lo).any())
    extend = {(True, True): "both", (True, False): "max", (False, True): "min"}
    kws = {"label": "score", "extend": extend.get((over, under), "neither")}
    cmap = "RdBu_r" if signed else "viridis"
    with _without_seaborns_draw():
        sns.heatmap(
            data, ax=ax, vmin=lo, vmax=hi, center=0.0 if signed and lo != -hi else None,
            cmap=cmap, cbar=cbar, cbar_kws=kws, xticklabels=max(1, every[1]),
            yticklabels=max(1, every[0]),
        )  # fmt: skip
    # seaborn stands the layer labels on end, where "10" and "11" touch on 30 layers
    ax.tick_params(axis="both", labelrotation=0)
    if cbar:
        _mark_threshold(ax.collections[0].colorbar, float(result.threshold), lo, hi)
    _outline(ax, result.heads, edgecolor="red", lw=1.8, gid="labelled")
    _outline(ax, result.borderline, edgecolor="orange", lw=1.5, ls="--", gid="borderline")
    rejected = [_layer_head(e["head"]) for e in getattr(result, "not_labelled", [])]
    _outline(ax, rejected, edgecolor="white", lw=1.5, ls=":", gid="not_labelled")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    return ax


CRITERION = (
    "labelled (solid red): score ≥ threshold (the mark on the colour bar), and the type's "
    "own test where it has one; borderline (dashed orange): 95% interval contains the threshold; "
    "not labelled (dotted white): score ≥ threshold, rejected by the type's own test"
)
"""The caption every catalog figure carries."""


def criterion(result: Any) -> str:
    """How ``result``'s heads were labelled, for a title: ``score ≥ t``, and a note when the
    labelled heads are not exactly those (a type with a further test, such as the name
    mover's copy score, leaves some heads above the threshold unlabelled)."""
    score = result.score.detach().float().cpu()
    above = {(int(a), int(b)) for a, b in (score >= result.threshold).nonzero().tolist()}
    rule = f"score ≥ {result.threshold:g}"
    same = above == {(int(h[0]), int(h[1])) for h in result.heads}
    return rule if same else f"{rule} and the type's own test"


MAX_TOKEN_TICKS = 32
"""Token labels per axis of :func:`pattern_heatmap` at most (longer prompts: every k-th)."""


def pattern_heatmap(
    pattern: Tensor, tokens: Sequence[str], ax: Any = None, title: str = "", **kwargs: Any
) -> Any:
    """One head's attention pattern ``[query_pos, key_pos]`` on ``ax`` (default: the current
    axes), the tokens on both axes (every one up to :data:`MAX_TOKEN_TICKS`, else every
    k-th), weights from 0 to 1. Returns the axes.

    Drawn with matplotlib's ``imshow``, not seaborn's heatmap: seaborn draws the whole
    figure on every call to rotate overlapping labels, which made a figure of 9 patterns
    take 13 s."""
    ax = ax if ax is not None else plt.gca()
    cmap = kwargs.pop("cmap", "viridis")
    cbar = kwargs.pop("cbar", False)
    data = pattern.detach().float().cpu().numpy()
    image = ax.imshow(data, cmap=cmap, vmin=0, vmax=1, interpolation="nearest", **kwargs)
    if cbar:
        ax.figure.colorbar(image, ax=ax)
    labels = list(tokens)
    step = max(1, math.ceil(len(labels) / MAX_TOKEN_TICKS))
    where = list(range(0, len(labels), step))
    ax.set_xticks(where, labels[::step], rotation=90)
    ax.set_yticks(where, labels[::step])
    ax.tick_params(labelsize=6)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title, fontsize=9)
    return ax


def catalog_heatmap(
    catalog: Any,
    path: str | os.PathLike | None = None,
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> Figure:
    """One :func:`type_heatmap` per head type of a :class:`~headmech.classification.results.HeadCatalog`,
    each on its range in ``ranges`` (type name → ``(low, high)``; default :data:`SCALE`)."""
    n = len(catalog.types)
    cols = min(3, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    h_layers, h_heads = catalog.model.n_layers, catalog.model.n_heads
    width = int((2.4 + 0.35 * h_heads) * 72 / 7.5)  # characters across a panel (12 pt)
    titles = {
        name: textwrap.fill(f"{name} ({r.reference})", width)
        + "\n"
        + textwrap.fill(f"labelled: {criterion(r)}", width)
        for name, r in catalog.types.items()
    }
    title_lines = max((t.count("\n") + 1 for t in titles.values()), default=2)
    fig, axes = plt.subplots(
        rows,
        cols,
        # per row: the grid, its tick labels and axis label, and the panel's title lines
        figsize=(
            cols * (2.4 + 0.35 * h_heads),
            rows * (1.3 + 0.22 * title_lines + 0.22 * h_layers),
        ),
        squeeze=False,
    )
    for ax, (name, r) in zip(axes.flat, catalog.types.items(), strict=False):
        type_heatmap(r, ax=ax, title=titles[name], scale=(ranges or {}).get(name, SCALE))
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    # the caption in lines that fit the figure (10 pt DejaVu Sans: about 6 pt a character)
    chars = max(30, int(fig.get_figwidth() * 72 / 6.2))
    caption = "\n".join(textwrap.fill(p, chars) for p in CRITERION.split("; "))
    title = f"{catalog.model.name}: head scores by type, fixed scale"
    above = (caption.count("\n") + 2) * 10 * 1.3 / 72 + 0.15  # inches the caption takes
    fig.set_figheight(fig.get_figheight() + above)  # the panels keep their height
    height = fig.get_figheight()
    fig.suptitle(f"{title}\n{caption}", fontsize=10, y=1 - 0.05 / height, va="top")
    fig.tight_layout()  # it keeps the panels below the suptitle
    return finish(fig, path, layout=False)


def score_heatmap(score: Tensor, title: str = "", path: str | os.PathLike | None = None) -> Figure:
    """One ``[n_layers, n_heads]`` score as a figure sized to the model."""
    n_layers, n_heads = score.shape
    fig, ax = plt.subplots(figsize=(1.6 + 0.35 * n_heads, 1.2 + 0.22 * n_layers))
    head_heatmap(score, ax=ax, title=title)
    return finish(fig, path)


def pruning_curve(result: Any, path: str | os.PathLike | None = None) -> Figure:
    """The task metric against the number of heads kept, of a
    :class:`~headmech.pruning.result.PruningResult`."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    kept = [int(s["n_kept"]) for s in result.steps]
    sns.lineplot(x=kept, y=[float(s["metric"]) for s in result.steps], marker="o", ax=ax)
    ax.invert_xaxis()
    ax.set_xlabel("heads kept")
    ax.set_ylabel(f"{result.task} metric (lower is better)")
    ax.set_title(f"{result.model} {result.method} pruning / {result.task}")
    return finish(fig, path)
