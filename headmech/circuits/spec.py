"""What one circuit run is asked to do, checked once, before a model loads.

:class:`CircuitSpec` holds the composition kinds, how many senders each receiver keeps and
the ratio an edge needs over its random baseline, checked against one table
(:data:`PARAMETERS`, :mod:`headmech.core.constraints`) from Python's keywords or the
command line's flags alike; with no ``--catalog`` the command also carries the
:class:`~headmech.classification.spec.ClassifySpec` of the catalog it classifies first.
:func:`headmech.circuits.circuit` is ``CircuitSpec.create(...)`` then the graph.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from headmech.core.constraints import Custom, Integer, Origin, Param, check
from headmech.core.errors import InputError

__all__ = ["PARAMETERS", "CircuitSpec"]

KINDS = ("q", "k", "v")


def _kinds(value: Any, name: str) -> tuple[str, ...]:
    """A non-empty subset of q, k and v, each at most once."""
    kinds = tuple(value)
    if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) < len(kinds):
        raise InputError(f"{name} takes q, k and v, once each; got {value!r}")
    return kinds


def _kinds_text(text: str, flag: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def _ratio(value: Any, name: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value <= 0:
        raise InputError(f"{name} must be a positive number, got {value!r}")
    return float(value)


#: the circuit's parameters: keyword -> rule, flag and the flag's parser
PARAMETERS: dict[str, Param] = {
    "kinds": Param(Custom(_kinds), "--kinds", _kinds_text, default=KINDS),
    "top_k": Param(Integer(1), "--top-k", default=3),
    "min_ratio": Param(Custom(_ratio), None, default=1.5),
}


@dataclasses.dataclass(frozen=True)
class CircuitSpec:
    """A circuit run's settings, checked (:meth:`create`), model-free.

    Attributes:
        kinds: the composition kinds (q, k, v).
        top_k: strongest senders kept per receiver and kind.
        min_ratio: an edge's score over its random baseline needed to keep it.
        classify: the classification run first when no catalog is given (command line).
    """

    kinds: tuple[str, ...] = KINDS
    top_k: int = 3
    min_ratio: float = 1.5
    classify: Any = None

    @classmethod
    def create(cls, *, origin: Origin = "python", **given: Any) -> CircuitSpec:
        """The spec of ``given`` (``circuit()``'s keywords, or parsed flags), checked once."""
        v = check(PARAMETERS, given, origin, "circuit()")
        return cls(v["kinds"], v["top_k"], v["min_ratio"])

    @classmethod
    def from_args(cls, args: Any) -> CircuitSpec:
        """The spec of ``headmech circuit``'s arguments (with the classification's, unless
        ``--catalog`` gives the catalog)."""
        from headmech.classification.spec import ClassifySpec

        spec = cls.create(origin="cli", kinds=args.kinds, top_k=args.top_k)
        if getattr(args, "catalog", None) is None:
            spec = dataclasses.replace(spec, classify=ClassifySpec.from_args(args))
        return spec

    def to_json(self) -> dict[str, Any]:
        """The settings the circuit's provenance records."""
        return {"kinds": list(self.kinds), "top_k": self.top_k, "min_ratio": self.min_ratio}
