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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import seaborn as sns
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "catalog_heatmap",
    "finish",
    "head_heatmap",
    "pattern_heatmap",
    "pruning_curve",
    "score_heatmap",
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


def catalog_heatmap(catalog: Any, path: str | os.PathLike | None = None) -> Figure:
    """One heatmap per head type of a :class:`~headmech.results.HeadCatalog`; labelled
    heads outlined in red."""
    n = len(catalog.types)
    cols = min(3, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    h_layers, h_heads = catalog.model.n_layers, catalog.model.n_heads
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(cols * (1.6 + 0.35 * h_heads), rows * (1.2 + 0.22 * h_layers)),
        squeeze=False,
    )
    for ax, (name, r) in zip(axes.flat, catalog.types.items(), strict=False):
        head_heatmap(r.score, ax=ax, title=f"{name} ({r.reference})", heads=r.heads)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"{catalog.model.name}: head scores by type (red: labelled)")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
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
