"""Control head sets for causal validation: random sets of heads *not of the type*.

A type's labelled heads are judged against random relabellings of their layers: sets of
as many heads, drawn from every head but the other heads that may be of the type (at or
above the threshold but rejected by a further criterion, or with an interval reaching
it: :meth:`headmech.classification.results.TypeResult.not_controls`) and the heads of the
types of its circuit (``HeadType.circuit``), the labelled set itself never drawn.
:func:`draw_controls` draws them per layer as the labelled heads lie (``same_layers``); where
those layers hold too few distinct sets, from the nearest layers that do
(``layers_within_d``), or from every layer where none does; where the model holds no other
set, none. :func:`headmech.classification.claims.control_space` counts the pool and the
distinct sets possible.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from headmech.classification.records import ControlAccounting
from headmech.core.head_index import HeadIndex
from headmech.models import ModelInfo

__all__ = ["Controls", "controls_for"]


@dataclass
class Controls:
    """A type's control sets, in draw order, and their accounting.

    Attributes:
        sets: up to the number asked for, no two alike.
        kind: ``same_layers``, ``layers_within_d``, ``any_layer`` or ``none``.
        note: why the sets were drawn as they were (widened, fallen back, none).
        pool: eligible heads (not of the type, not of its circuit) the sets draw from.
        n_possible: distinct sets the pool holds.
        excluded: heads kept out beyond the labelled ones, each with its reason.
    """

    sets: list[list[HeadIndex]]
    kind: str
    note: str
    pool: int = 0
    n_possible: int = 0
    excluded: dict[HeadIndex, str] = field(default_factory=dict)

    def record(self) -> ControlAccounting:
        """The validation record's control accounting."""
        excluded = circuit = None
        if self.excluded:
            excluded = [[h.layer, h.head] for h in sorted(self.excluded)]
            found: dict[str, list[list[int]]] = {}
            for h, why in sorted(self.excluded.items()):
                if why != "of the type":
                    found.setdefault(why, []).append([h.layer, h.head])
            circuit = found or None
        n_possible = min(self.n_possible, 10**12)
        return ControlAccounting(self.kind, self.note, self.pool, n_possible, excluded, circuit)


def controls_for(
    info: ModelInfo,
    heads: Sequence[HeadIndex],
    n_max: int,
    seed: int,
    excluded: dict[HeadIndex, str] | Collection[HeadIndex] = (),
) -> Controls:
    """:func:`draw_controls` with its accounting: up to ``n_max`` distinct sets (the
    layers widened until the space holds ``n_max``, where it can), the pool and the
    distinct sets possible (:func:`headmech.classification.claims.control_space`), and the
    heads excluded with their reasons (``excluded``: a head → why, e.g. ``"of the type"``
    or ``"name_mover (its circuit)"``)."""
    from headmech.classification.claims import control_space

    reasons = (
        dict(excluded) if isinstance(excluded, dict)
        else dict.fromkeys(excluded, "of the type")
    )  # fmt: skip
    reasons = {h: why for h, why in reasons.items() if h not in set(heads)}
    sets, kind, note = draw_controls(info, heads, n_max, seed, sorted(reasons))
    pool, possible = control_space(heads, info.n_layers, info.n_heads, kind, sorted(reasons))
    return Controls(sets, kind, note, pool if sets else 0, possible if sets else 0, reasons)


def draw_controls(
    info: ModelInfo,
    heads: Sequence[HeadIndex],
    n_random: int,
    seed: int,
    excluded: Collection[HeadIndex] = (),
) -> tuple[list[list[HeadIndex]], str, str]:
    """Control head sets: random relabellings of the labelled heads' layers, as many
    heads per layer as ``heads`` has there, drawn from every head there but those in
    ``excluded`` (the other heads that may be of the type, and its circuit's), the
    labelled set itself never drawn. Where those layers hold fewer than ``n_random``
    distinct sets, the nearest layers that do (:func:`_widened`); where the model holds
    no other set at all, none. Returns ``(sets, kind, note)``.

    The labelled heads stay in the pool because that makes the Monte Carlo p exact under
    the null that the labels are random heads of their layers (a permutation test):
    drawn from the unlabelled heads only, a random labelled set was validated in 8-9% of
    planted seeds at 9-14 heads a layer, not 5% (the other heads of a layer are not the
    population the labelled ones came from; tests/test_verdicts.py)."""
    banned = set(excluded) - set(heads)
    total = info.n_layers * info.n_heads
    if not heads or n_random < 1:
        return [], "none", "no labelled heads" if not heads else "n_random is 0"
    from headmech.classification.claims import control_space

    args = (heads, info.n_layers, info.n_heads)
    if control_space(*args, "any_layer", sorted(banned))[1] < 1:
        more = len(banned)
        note = (
            f"no control possible: {len(set(heads))} of {total} heads are labelled"
            + (f" and {more} more may be of the type or its circuit" if more else "")
            + ": no other set of as many heads exists"
        )
        return [], "none", note
    g = torch.Generator().manual_seed(seed)
    kind, note, banned = _widened(info, heads, n_random, banned)
    like = list(heads) if kind == "same_layers" else None
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
                f"only {same} distinct control set(s) exist in the labelled heads' layers: "
                f"controls drawn from the eligible heads within {d} layer(s) of them"
            )
            return kind, note, banned | outside
    if info.n_layers > 1:  # no distance holds them all: the widest, where it holds more
        kind = f"layers_within_{info.n_layers - 1}"
        _, every = control_space(*args, kind, sorted(banned))
        if every > same:
            note = (
                f"only {same} distinct control set(s) exist in the labelled heads' layers, "
                f"{every} in the whole model: controls drawn from every layer ({n_random} "
                "asked for)"
            )
            return kind, note, banned
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
    the same set of heads; where the space holds no more than :data:`ENUMERATE` sets and
    fewer than twice ``n_random``, every one of them in a random order (drawing would
    need many redraws to find the last ones), so a test can use them all
    (:func:`headmech.classification.claims.control_space` counts them)."""
    from headmech.classification.claims import control_space, near_layers

    _, possible = control_space(heads, info.n_layers, info.n_heads, kind, banned)
    if possible <= min(ENUMERATE, 2 * n_random):
        every = [
            s for s in _every_set(info, heads, set(banned), like, kind) if set(s) != set(heads)
        ]
        order = torch.randperm(len(every), generator=generator).tolist()
        return [every[i] for i in order][:n_random]
    out = set(banned)

    def free(layers: Collection[int]) -> list[HeadIndex]:
        return [
            HeadIndex(la, h) for la in sorted(layers) for h in range(info.n_heads)
            if HeadIndex(la, h) not in out
        ]  # fmt: skip

    if like is not None:  # per layer as many as the labelled heads there
        per: dict[int, int] = {}
        for h in like:
            per[h.layer] = per.get(h.layer, 0) + 1
        pools = [(free([la]), k) for la, k in sorted(per.items())]
    else:
        layers: Collection[int] = range(info.n_layers)
        if kind.startswith("layers_within_"):
            layers = near_layers(
                {h.layer for h in heads}, info.n_layers, int(kind.rsplit("_", 1)[1])
            )
        pools = [(free(layers), len(heads))]
    sets: list[list[HeadIndex]] = []
    seen: set[frozenset[HeadIndex]] = {frozenset(heads)}  # never the labelled set itself
    for _ in range(100 * n_random):  # redraws: only a small pool ever repeats a set
        if len(sets) == min(n_random, possible):
            break
        s = [
            pool[i] for pool, k in pools
            for i in torch.randperm(len(pool), generator=generator)[:k].tolist()
        ]  # fmt: skip
        if frozenset(s) not in seen:
            seen.add(frozenset(s))
            sets.append(s)
    return sets


ENUMERATE = 5000
"""Control spaces up to this many sets are listed whole (see :func:`_distinct_sets`)."""


def _every_set(
    info: ModelInfo,
    heads: Sequence[HeadIndex],
    banned: set[HeadIndex],
    like: list[HeadIndex] | None,
    kind: str,
) -> list[list[HeadIndex]]:
    """Every distinct control set, in a fixed order: per layer as many as ``like`` has
    there (``same_layers``), else any ``len(heads)`` eligible heads of the pool."""
    from itertools import combinations, product

    from headmech.classification.claims import near_layers

    def free(layers: Collection[int]) -> list[HeadIndex]:
        return [
            HeadIndex(la, h) for la in sorted(layers) for h in range(info.n_heads)
            if HeadIndex(la, h) not in banned
        ]  # fmt: skip

    if like is not None and kind == "same_layers":
        per: dict[int, int] = {}
        for h in like:
            per[h.layer] = per.get(h.layer, 0) + 1
        choices = [list(combinations(free([la]), k)) for la, k in sorted(per.items())]
        return [[h for part in combo for h in part] for combo in product(*choices)]
    layers: Collection[int] = range(info.n_layers)
    if kind.startswith("layers_within_"):
        d = int(kind.rsplit("_", 1)[1])
        layers = near_layers({h.layer for h in heads}, info.n_layers, d)
    return [list(c) for c in combinations(free(layers), len(heads))]
