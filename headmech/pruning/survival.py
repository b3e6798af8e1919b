"""Survival of catalogued heads under pruning: does the model keep the heads the catalog names?

Voita et al. 2019 found that the specialised heads (positional, syntactic, rare-word) are
the last to be pruned. Given the heads kept at each pruning level and a
:class:`~headmech.classification.classify.HeadCatalog`, this module reports

* per type, the fraction of its heads kept at each level (:func:`survival`);
* the order in which types are removed (:func:`removal_order`: the level at which a type
  first falls to half its heads);
* the enrichment of catalogued heads among the survivors against chance
  (:func:`enrichment`: their share among kept heads over their share among all heads);

and compares three pruning orders on one task (:func:`compare_orders`): by catalog
(unlabelled heads first), by importance (least important first) and at random.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.classify import HeadCatalog
    from headmech.stream.engine import ProbeBatch

__all__ = [
    "check_catalog",
    "compare_orders",
    "enrichment",
    "plot_orders",
    "removal_order",
    "survival",
]


def check_catalog(catalog: HeadCatalog | None, model: TransformerBridge) -> None:
    """Refuse a catalog of another shape than ``model`` (its heads would fall outside the
    model, or the model's outside the catalog): :class:`~headmech.core.errors.HeadIndexError`."""
    from headmech.core.errors import HeadIndexError

    if catalog is None:
        return
    shape = (int(model.cfg.n_layers), int(model.cfg.n_heads))
    if (catalog.model.n_layers, catalog.model.n_heads) != shape:
        raise HeadIndexError(
            f"the catalog describes a model of {catalog.model.n_layers}x{catalog.model.n_heads} "
            f"heads, this one has {shape[0]}x{shape[1]}"
        )


def _as_set(heads: Iterable[HeadIndex | Sequence[int]]) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in heads}


def survival(
    steps: Sequence[Sequence[HeadIndex | Sequence[int]]], catalog: HeadCatalog
) -> dict[str, list[float]]:
    """Per catalog type, the fraction of its labelled heads kept at each step (types with
    no labelled heads are left out)."""
    out: dict[str, list[float]] = {}
    for name, r in catalog.types.items():
        labelled = _as_set(r.heads)
        if labelled:
            out[name] = [round(len(labelled & _as_set(kept)) / len(labelled), 4) for kept in steps]
    return out


def removal_order(surv: dict[str, list[float]], n_kept: Sequence[int]) -> list[dict[str, Any]]:
    """Types ordered by when they lose half their heads (earliest first); ``n_kept`` at
    that step, or None if the type keeps at least half to the end."""
    rows = []
    for name, fr in surv.items():
        step = next((i for i, f in enumerate(fr) if f <= 0.5), None)
        rows.append(
            {"type": name, "half_removed_at_n_kept": None if step is None else int(n_kept[step])}
        )
    return sorted(
        rows,
        key=lambda r: (
            -(r["half_removed_at_n_kept"] if r["half_removed_at_n_kept"] is not None else -1)
        ),
    )


def enrichment(kept: Sequence[HeadIndex | Sequence[int]], catalog: HeadCatalog) -> float | None:
    """(share of catalogued heads among ``kept``) / (share among all heads); 1 = chance."""
    n_total = catalog.model.n_layers * catalog.model.n_heads
    labelled = _as_set(catalog.labels())
    k = _as_set(kept)
    if not labelled or not k:
        return None
    return round((len(labelled & k) / len(k)) / (len(labelled) / n_total), 4)


def _order(
    kind: str, catalog: HeadCatalog, importance: Tensor, g: torch.Generator
) -> list[HeadIndex]:
    """Heads in removal order (first removed first)."""
    n_layers, n_heads = importance.shape
    heads = [HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads)]
    noise = torch.rand(len(heads), generator=g)
    if kind == "random":
        return [heads[int(i)] for i in noise.argsort()]
    imp = importance.flatten()
    if kind == "importance":
        return [heads[int(i)] for i in imp.argsort()]
    labelled = _as_set(catalog.labels())
    # unlabelled heads first (least important first within each group)
    key = (
        torch.tensor([1.0 if (h.layer, h.head) in labelled else 0.0 for h in heads]) * 1e6
        + imp.double().argsort().argsort()
    )
    return [heads[int(i)] for i in key.argsort()]


def compare_orders(
    model: TransformerBridge,
    catalog: HeadCatalog,
    importance: Tensor,
    batches: Sequence[ProbeBatch],
    task: str = "lm",
    fractions: Sequence[float] = (0.0, 0.25, 0.5, 0.75),
    n_random: int = 1,
    seed: int = 0,
) -> dict[str, list[dict[str, Any]]]:
    """The task metric after zero-ablating the first ``fraction`` of heads in three orders:
    ``catalog`` (unlabelled heads first), ``importance`` (least important first), ``random``.

    Returns:
        order → ``[{"fraction_removed", "n_kept", "metric"}]`` (random: mean over draws).
    """
    from headmech.interventions import evaluate
    from headmech.interventions.ablation import ablation
    from headmech.tasks import get_task

    t = get_task(task, model)
    refs = [t.reference(model, b) for b in batches]
    n = importance.numel()
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[dict[str, Any]]] = {}
    for kind in ("catalog", "importance", "random"):
        draws = n_random if kind == "random" else 1
        rows = []
        orders = [_order(kind, catalog, importance, g) for _ in range(draws)]
        for f in fractions:
            k = int(round(f * n))
            vals = [
                evaluate(model, t, batches, [ablation(o[:k])] if k else [], references=refs)
                for o in orders
            ]
            rows.append(
                {"fraction_removed": f, "n_kept": n - k, "metric": round(sum(vals) / len(vals), 6)}
            )
        out[kind] = rows
    return out


def plot_orders(
    result: dict[str, list[dict[str, Any]]], path: str | os.PathLike | None = None, title: str = ""
) -> Any:
    """Metric against heads removed, one line per order (seaborn)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = [{"order": k, **r} for k, v in result.items() for r in v]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    sns.lineplot(data=rows, x="fraction_removed", y="metric", hue="order", marker="o", ax=ax)
    ax.set_xlabel("fraction of heads removed")
    ax.set_ylabel("task damage (higher is worse)")
    ax.set_title(title)
    from headmech.core.plot import finish

    return finish(fig, path)
