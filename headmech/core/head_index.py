"""A head as ``(layer, head)``, and the check that a list of heads fits a model.

:func:`check_heads` is where every head of the public API is normalised: a
:class:`HeadIndex`, a ``(layer, head)`` pair of integers, or ``"L18H6"`` (as the command
line and ``catalog.json`` write a head) are all accepted, and a comma-separated string
``"L1H0,L2H3"`` stands for a list of heads.

:mod:`headmech.headtypes.registry` re-exports both; they live here, below everything that names heads
(the exact JSON of :mod:`headmech.runs.resume`, interventions, masks), because they need
nothing but the errors.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from headmech.core.errors import HeadIndexError

__all__ = ["HeadIndex", "check_heads", "top_k"]


class HeadIndex(NamedTuple):
    """A head: ``(layer, head)``, both 0-indexed."""

    layer: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"

    @classmethod
    def parse(cls, text: str) -> HeadIndex:
        """``"L18H6"`` (as :meth:`__str__` writes it; case and spaces ignored) → a head.

        Raises:
            HeadIndexError: text that does not name a head that way.
        """
        import re

        m = re.fullmatch(r"\s*L(\d+)\s*H(\d+)\s*", str(text), flags=re.IGNORECASE)
        if m is None:
            raise HeadIndexError(
                f"{text!r} does not name a head: write it as L<layer>H<head>, e.g. L18H6"
            )
        return cls(int(m.group(1)), int(m.group(2)))


def check_heads(
    heads: Iterable[HeadIndex | Sequence[int] | str] | str,
    n_layers: int | None,
    n_heads: int | None,
    what: str = "heads",
) -> list[HeadIndex]:
    """``heads`` as :class:`HeadIndex` es, each inside a model of ``n_layers`` x ``n_heads``
    (None: any size; negative indices are refused all the same).

    Each head is a :class:`HeadIndex`, a ``(layer, head)`` pair of integers or a string
    ``"L18H6"``; ``heads`` itself may be one string of comma-separated heads
    (``"L1H0,L2H3"``).

    Raises:
        HeadIndexError: a head outside the model (negative indices included), a string
            not of the form ``L<layer>H<head>``, or not a ``(layer, head)`` pair of
            integers, in one line naming it and the model's shape.
    """
    if isinstance(heads, str):
        heads = [t for t in heads.split(",") if t.strip()]
    elif isinstance(heads, HeadIndex) or not isinstance(heads, Iterable):
        raise HeadIndexError(
            f"{what}: expected a list of heads ((layer, head) pairs or 'L<layer>H<head>' "
            f"strings such as 'L18H6'), got {heads!r}"
        )
    out = []
    for h in heads:
        if isinstance(h, str):
            try:
                pair = HeadIndex.parse(h)
            except HeadIndexError as e:
                raise HeadIndexError(f"{what}: {e}") from None
        else:
            try:
                layer, head = h
                pair = HeadIndex(_index(layer), _index(head))
            except (TypeError, ValueError):
                raise HeadIndexError(
                    f"{what}: {h!r} is not a head: give a (layer, head) pair of integers or "
                    "a string L<layer>H<head>, e.g. 'L18H6'"
                ) from None
        if n_layers is None or n_heads is None:
            if min(pair) < 0:
                raise HeadIndexError(
                    f"{what}: head ({pair.layer}, {pair.head}) has a negative index"
                )
        elif not (0 <= pair.layer < n_layers and 0 <= pair.head < n_heads):
            raise HeadIndexError(
                f"{what}: head ({pair.layer}, {pair.head}) is outside the model "
                f"({n_layers} layers x {n_heads} heads)"
            )
        out.append(pair)
    return out


def _index(value: Any) -> int:
    """An integer index (a Python, NumPy or 0-dim tensor integer; not a bool or a float)."""
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


def top_k(score: Any, k: int) -> list[HeadIndex]:
    """The ``k`` highest-scoring heads of a ``[n_layers, n_heads]`` score tensor, best
    first (NaN last; ties in layer-head order)."""
    import torch

    flat = torch.nan_to_num(score.flatten().double(), nan=float("-inf"))
    order = torch.argsort(-flat, stable=True)[:k].tolist()
    n_heads = int(score.shape[1])
    return [HeadIndex(i // n_heads, i % n_heads) for i in order]
