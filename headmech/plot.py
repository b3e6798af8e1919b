"""Seaborn figures of per-head results."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files, not windows; notebooks still display returned figures
import matplotlib.pyplot as plt
import seaborn as sns
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from headmech.classify import HeadCatalog

__all__ = ["catalog_heatmap", "head_heatmap"]


def head_heatmap(score: Tensor, ax=None, title: str = "", heads=(), **kwargs):
    """A layer x head heatmap of a ``[n_layers, n_heads]`` score; ``heads`` (``(layer, head)``
    pairs, e.g. the labelled ones) are outlined in red."""
    ax = ax if ax is not None else plt.gca()
    data = score.detach().float().cpu().numpy()
    kwargs.setdefault("cmap", "viridis")
    sns.heatmap(data, ax=ax, square=False, cbar=True, xticklabels=True, yticklabels=True, **kwargs)
    for layer, head in heads:
        ax.add_patch(plt.Rectangle((head, layer), 1, 1, fill=False, edgecolor="red", lw=1.5))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    return ax


def catalog_heatmap(catalog: HeadCatalog, path: str | os.PathLike | None = None) -> Figure:
    """One heatmap per head type; labelled heads outlined in red."""
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
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
