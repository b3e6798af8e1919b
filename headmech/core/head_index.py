"""A head as ``(layer, head)``, and the check that a list of heads fits a model.

:mod:`headmech.headtypes.registry` re-exports both; they live here, below everything that names heads
(the exact JSON of :mod:`headmech.runs.resume`, interventions, masks), because they need
nothing but the errors.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from headmech.core.errors import HeadIndexError

__all__ = ["HeadIndex", "check_heads"]


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
    heads: Iterable[HeadIndex | Sequence[int]],
    n_layers: int | None,
    n_heads: int | None,
    what: str = "heads",
) -> list[HeadIndex]:
    """``heads`` as :class:`HeadIndex` es, each inside a model of ``n_layers`` x ``n_heads``
    (None: any size; negative indices are refused all the same).

    Raises:
        HeadIndexError: a head outside the model (negative indices included), or not a
            ``(layer, head)`` pair of integers, in one line naming it and the model's shape.
    """
    out = []
    for h in heads:
        try:
            layer, head = h
            pair = HeadIndex(_index(layer), _index(head))
        except (TypeError, ValueError):
            raise HeadIndexError(f"{what}: {h!r} is not a (layer, head) pair of integers") from None
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
