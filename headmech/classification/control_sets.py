"""Control head sets for causal validation: random sets of heads *not of the type*.

A type's labelled heads are judged against random sets of as many heads that are not of
the type: neither labelled, nor at or above the threshold (rejected by a further
criterion), nor with an interval reaching it (:meth:`headmech.classification.results.TypeResult.not_controls`).
:func:`draw_controls` draws them per layer as the labelled heads lie (``same_layers``); where
those layers hold too few distinct sets, from the nearest layers that do
(``layers_within_d``); where a layer has fewer eligible heads than labelled ones, from
every layer (``any_layer``, with a warning); where the model has too few at all, none.
:func:`headmech.classification.claims.control_space` counts the pool and the distinct sets possible.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from headmech.core.head_index import HeadIndex
from headmech.models import ModelInfo

__all__: list[str] = []


def draw_controls(
    info: ModelInfo,
    heads: Sequence[HeadIndex],
    n_random: int,
    seed: int,
    excluded: Collection[HeadIndex] = (),
) -> tuple[list[list[HeadIndex]], str, str]:
    """Control head sets: as many heads per layer as ``heads`` has there, drawn only from
    the heads that are not of the type (neither labelled nor in ``excluded``: at or above
    the threshold, or with an interval reaching it; :meth:`TypeResult.not_controls`).
    Where a layer has too few such heads, the sets fall back to any layer (with a
    warning); where the model has too few at all, there is no control. Returns
    ``(sets, kind, note)``."""
    import warnings

    banned = set(heads) | set(excluded)
    total = info.n_layers * info.n_heads
    free = total - len(banned)
    if not heads or n_random < 1:
        return [], "none", "no labelled heads" if not heads else "n_random is 0"
    if free < len(heads):
        more = len(banned) - len(set(heads))
        note = (
            f"no control possible: {len(set(heads))} of {total} heads are labelled"
            + (f" and {more} more may be of the type" if more else "")
            + f", and a random set of as many heads not of the type does not exist ({free} "
            "eligible)"
        )
        return [], "none", note
    per_layer: dict[int, int] = {}
    for h in heads:
        per_layer[h.layer] = per_layer.get(h.layer, 0) + 1
    eligible = {la: sum((la, h) not in banned for h in range(info.n_heads)) for la in per_layer}
    short = [la for la, n in per_layer.items() if eligible[la] < n]
    g = torch.Generator().manual_seed(seed)
    like = None if short else list(heads)
    kind, note = "same_layers", ""
    if not short:  # enough eligible heads per layer, but perhaps too few distinct sets
        kind, note, banned = _widened(info, heads, n_random, banned)
        like = list(heads) if kind == "same_layers" else None
    if short:
        kind = "any_layer"
        note = (
            f"layers {sorted(short)} have fewer eligible heads (not of the type) than labelled "
            "ones: controls drawn from every layer"
        )
        warnings.warn(note, stacklevel=3)
    sets = _distinct_sets(info, heads, sorted(banned), n_random, g, like, kind)
    return sets, kind, note


def _widened(
    info: ModelInfo, heads: Sequence[HeadIndex], n_random: int, banned: set[HeadIndex]
) -> tuple[str, str, set[HeadIndex]]:
    """``same_layers`` where the labelled heads' layers hold ``n_random`` distinct control
    sets; else the eligible heads of the layers within the smallest distance ``d`` that
    do (``layers_within_d``, the heads outside those layers banned too), with a note;
    where no distance does, ``same_layers`` (the controls are then degenerate)."""
    from headmech.classification.claims import control_space, near_layers

    args = (heads, info.n_layers, info.n_heads)
    _, same = control_space(*args, "same_layers", sorted(banned))
    if same >= n_random:
        return "same_layers", "", banned
    for d in range(1, info.n_layers):
        kind = f"layers_within_{d}"
        _, possible = control_space(*args, kind, sorted(banned))
        if possible >= n_random:
            near = set(near_layers({h.layer for h in heads}, info.n_layers, d))
            outside = {
                HeadIndex(la, h)
                for la in range(info.n_layers)
                if la not in near
                for h in range(info.n_heads)
            }
            note = (
                f"only {same} distinct control set(s) of heads not of the type exist in the "
                f"labelled heads' layers: controls drawn from the eligible heads within {d} "
                f"layer(s) of them"
            )
            return kind, note, banned | outside
    return "same_layers", "", banned


def _distinct_sets(
    info: ModelInfo,
    heads: Sequence[HeadIndex],
    banned: Sequence[HeadIndex],
    n_random: int,
    generator: torch.Generator,
    like: list[HeadIndex] | None,
    kind: str,
) -> list[list[HeadIndex]]:
    """``n_random`` control sets of as many heads as ``heads``, outside ``banned``, no two
    the same set of heads; as many as exist where fewer do
    (:func:`headmech.classification.claims.control_space`)."""
    from headmech.classification.claims import control_space
    from headmech.interventions.ablation import random_heads

    _, possible = control_space(heads, info.n_layers, info.n_heads, kind, banned)
    sets: list[list[HeadIndex]] = []
    seen: set[frozenset[HeadIndex]] = set()
    for _ in range(100 * n_random):  # redraws: only a small pool ever repeats a set
        if len(sets) == min(n_random, possible):
            break
        s = random_heads(
            info.n_layers, info.n_heads, len(heads), exclude=banned, generator=generator, like=like
        )
        if frozenset(s) not in seen:
            seen.add(frozenset(s))
            sets.append(s)
    return sets
