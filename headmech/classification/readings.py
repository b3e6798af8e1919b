"""What is known of one head on one type beyond its score: a catalog entry's ``per_head``.

Each labelled head, and each head at or above the threshold that a further criterion
rejected, may be measured alone (the validation ablates it by itself:
:class:`~headmech.classification.records.HeadEffect`) and read on ordinary text (the share
of its attention its type's pattern takes: :class:`BroadReading`, from
:mod:`headmech.classification.broad`). :class:`HeadReading` holds both, and is written as
the flat object ``catalog.json`` has always kept under ``per_head`` and read back from it
(:func:`readings_of` reads a type's entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from headmech.classification.records import HeadEffect

__all__ = ["BroadReading", "HeadReading", "reading_of", "readings_of"]


@dataclass
class BroadReading:
    """A head on ordinary text (five domains, 64 and 256 tokens): the share of its
    (non-sink) attention its type's pattern takes, the type's score there, and whether the
    share is under half at both lengths (``narrow``). Catalogs read before the scores were
    recorded lack ``broad_score*``: ``written`` names the fields a record has."""

    broad_share: float | None = None
    broad_share_4x: float | None = None
    broad_score: float | None = None
    broad_score_4x: float | None = None
    narrow: bool = False
    written: tuple[str, ...] = (
        "broad_share",
        "broad_share_4x",
        "broad_score",
        "broad_score_4x",
        "narrow",
    )

    def to_json(self) -> dict[str, Any]:
        """The fields it has, flat (as ``per_head`` holds them)."""
        return {k: getattr(self, k) for k in self.written}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BroadReading:
        """The ``broad_*`` and ``narrow`` fields of a ``per_head`` object."""
        have = tuple(k for k in _BROAD if k in data)
        if "narrow" not in have:
            raise KeyError("narrow")
        return cls(**{k: data[k] for k in have}, written=have)


_BROAD = tuple(f.name for f in fields(BroadReading) if f.name != "written")
_ALONE = tuple(f.name for f in fields(HeadEffect))


@dataclass
class HeadReading:
    """One head's ``per_head`` record on one type.

    Attributes:
        labelled: whether the type labels the head.
        alone: its effect ablated alone with its 95% interval (None: not measured alone).
        broad: its reading on ordinary text (None: not read; the type has no pattern
            outside its probe, or the catalog was not read broadly).
        extra: fields this version does not know, kept as written.
    """

    labelled: bool = False
    alone: HeadEffect | None = None
    broad: BroadReading | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def effect(self) -> float | None:
        """Its own effect (ablated alone, minus clean), or None where not measured."""
        return None if self.alone is None else self.alone.effect

    @property
    def interval(self) -> list[float] | None:
        """The 95% interval of its own effect, or None."""
        return None if self.alone is None else self.alone.interval

    def to_json(self) -> dict[str, Any]:
        """The flat object of ``per_head`` (the fields of what was measured, only)."""
        out: dict[str, Any] = {}
        if self.alone is not None:
            out.update(self.alone.to_json())
        if self.broad is not None:
            out.update(self.broad.to_json())
        return {**out, **self.extra, "labelled": self.labelled}

    @classmethod
    def from_json(cls, data: Any) -> HeadReading:
        """Read one ``per_head`` object back.

        Raises:
            ValueError: not an object, or a measurement with a field missing.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a per_head record must be an object, got {type(data).__name__}")
        try:
            alone = HeadEffect.from_json(data) if "effect" in data else None
            broad = BroadReading.from_json(data) if "broad_share" in data else None
        except (KeyError, TypeError) as e:
            raise ValueError(f"a per_head record lacks {e}: {sorted(data)}") from None
        known = {"labelled", *(_ALONE if alone else ()), *(broad.written if broad else ())}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(bool(data.get("labelled", False)), alone, broad, extra)


def readings_of(entry: dict[str, Any]) -> dict[str, HeadReading]:
    """A ``catalog.json`` type entry's ``per_head`` records, by head name (``"L18H6"``)."""
    return {h: HeadReading.from_json(r) for h, r in (entry.get("per_head") or {}).items()}


def reading_of(entry: dict[str, Any], head: str) -> HeadReading | None:
    """One head's ``per_head`` record of a ``catalog.json`` type entry (``head``: its name,
    ``"L18H6"``), or None: :func:`readings_of` for one head, without reading the others
    (a page per head would otherwise read every head's record once per head)."""
    data = (entry.get("per_head") or {}).get(head)
    return None if data is None else HeadReading.from_json(data)
