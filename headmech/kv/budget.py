"""How a KV budget is spent (:func:`split_budget`) and which KV heads a catalog ranks
first for it (:func:`kv_ranking`); :class:`headmech.kv.plan.KVPlan` builds on both."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from headmech.errors import InputError

if TYPE_CHECKING:
    from headmech.results import HeadCatalog

__all__ = ["kv_ranking", "split_budget"]


def _positive(value: int, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def split_budget(
    budget: float,
    context: int,
    n_kv_total: int,
    sinks: int,
    window: int,
    n_full: int | None = None,
) -> tuple[int, int]:
    """How a KV budget is spent: ``(full KV heads, window)``.

    As many KV heads keep the whole cache as leave every other head at least ``sinks +
    window`` entries within ``budget`` (a fraction of the whole cache at ``context``
    tokens), or ``n_full`` if given; the window of the others then widens to spend what
    is left. Below ``(sinks + window) / context`` no head is full and the window shrinks.

    Raises:
        InputError: a budget outside (0, 1] or too small for one token beyond the sinks.
    """
    if not 0 < budget <= 1:
        raise InputError(f"a KV budget is a fraction in (0, 1], got {budget}")
    _positive(context, "context", 1)
    total = budget * context * n_kv_total  # cached positions the budget allows
    small = min(context, sinks + window)
    if n_full is not None:
        k = n_full
    elif small >= context:
        return n_kv_total, window
    else:
        k = min(n_kv_total, max(0, math.floor((total - n_kv_total * small) / (context - small))))
    if k == n_kv_total:
        return k, window
    w = math.floor((total - k * context) / (n_kv_total - k) + 1e-9) - sinks
    if w < 1:
        raise InputError(f"a budget of {budget} at {context} tokens leaves no window")
    return k, min(w, context)


def kv_ranking(catalog: HeadCatalog, types: Sequence[str], group: int) -> list[tuple[int, int]]:
    """Every ``(layer, kv_head)``, best first: a KV head's score is its best query head's
    best score over ``types``, each score divided by its type's threshold (labelled heads
    first, then the rest by how close they come); ties by position."""
    scores = []
    for t in types:
        r = catalog[t]
        s = torch.nan_to_num(r.score.float(), nan=float("-inf"))
        scores.append(s / r.threshold if r.threshold > 0 else s)
    best = torch.stack(scores).amax(0)  # [n_layers, n_heads]
    kv = best.view(best.shape[0], -1, group).amax(-1)  # [n_layers, n_kv_heads]
    order = sorted(
        ((float(kv[la, k]), la, k) for la in range(kv.shape[0]) for k in range(kv.shape[1])),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    return [(la, k) for _, la, k in order]
