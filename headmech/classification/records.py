"""Typed validation records: what a type's validation found, as ``catalog.json`` holds it.

A type's validation (:func:`headmech.classification.validation.type_validation`) is a
:class:`TypeValidation`: its primary claim's :class:`ClaimRecord` (flat at the top level
of ``details.validation``, as earlier records were), the control sets' accounting
(:class:`ControlAccounting`), its other claims (``secondary``), the claims that could not
run before the primary one, the redundancy of its heads (:class:`Redundancy`), each head
measured alone (:class:`HeadEffect`, written beside ``details`` as ``per_head``) and the
sufficiency test of its backups (:class:`BackupTest`). Every record is written by its
``to_json`` and read back by its ``from_json``, and nothing else builds or reads one by
key; the published catalogs load and re-save byte for byte (tests/test_records.py).

Values derived from the measured ones (the controls' mean, median and range, the ablated
metric) are computed once from unrounded numbers; a record read back keeps them as written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from headmech.classification.montecarlo import ControlTest

__all__ = [
    "validation_of",
    "BackupRow",
    "BackupTest",
    "ClaimRecord",
    "ControlAccounting",
    "HeadEffect",
    "Redundancy",
    "TypeValidation",
]

Pairs = list[list[int]]  # heads as [layer, head] pairs, as the JSON files write them


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not an object")
    return data


@dataclass
class ClaimRecord:
    """One claim's result: the labelled set's effect, its controls, its test and verdict
    (flat in ``catalog.json``, as earlier records were, with the test under ``test``).

    ``extra``: what a kind of claim adds (a dose-response's ``dose`` and ``rho``,
    K-composition's ``receivers``, ...), written beside the fields."""

    kind: str
    claim: str
    metric: str
    mode: str
    expected: str
    n_heads: int
    effect: float | None = None
    effect_interval: list[float] | None = None
    clean: float | None = None
    control_sets: list[Pairs] = field(default_factory=list)
    test: ControlTest | None = None
    verdict: str = "not run"
    note: str = ""
    shown_controls: list[float] | None = None  # shown as the controls (default: the test's)
    extra: dict[str, Any] = field(default_factory=dict)
    # the derived values as a file wrote them (None: computed from the fields)
    written: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    DERIVED = ("ablated", "random_effects", "random_mean", "random_median", "random_range")

    @property
    def controls(self) -> list[float]:
        """The control sets' values shown beside the effect (the test's, in draw order)."""
        if self.shown_controls is not None:
            return list(self.shown_controls)
        return list(self.test.controls) if self.test is not None else []

    def derived(self) -> dict[str, Any]:
        """The metric under ablation (clean + effect) and the controls' values, mean,
        median and range (as written where the record was read from a file)."""
        if self.written is not None:
            return dict(self.written)
        rand = self.controls
        s = sorted(rand)
        return {
            "ablated": None
            if self.effect is None or self.clean is None
            else self.clean + self.effect,
            "random_effects": rand,
            "random_mean": sum(s) / len(s) if s else None,
            # the lower middle value of an even count (torch's median, as first written)
            "random_median": s[(len(s) - 1) // 2] if s else None,
            "random_range": [s[0], s[-1]] if s else None,
        }

    @property
    def random_effects(self) -> list[float]:
        """The control sets' values shown (as written where read from a file)."""
        return list(self.derived()["random_effects"])

    @property
    def random_mean(self) -> float | None:
        """The controls' mean (None without controls)."""
        return self.derived()["random_mean"]  # type: ignore[no-any-return]

    @property
    def random_median(self) -> float | None:
        """The controls' median (None without controls)."""
        return self.derived()["random_median"]  # type: ignore[no-any-return]

    @property
    def random_range(self) -> list[float] | None:
        """The controls' lowest and highest value."""
        return self.derived()["random_range"]  # type: ignore[no-any-return]

    def to_json(self) -> dict[str, Any]:
        """The flat record: the fields, the test, and the controls' summary under the
        keys earlier readers use (``random_effects``, ``random_median``, ...)."""
        out: dict[str, Any] = {"validation": self.kind}
        for f in dataclasses.fields(self):
            if f.name not in ("kind", "extra", "written", "test", "shown_controls"):
                out[f.name] = getattr(self, f.name)
        out["test"] = None if self.test is None else self.test.to_json()
        if self.shown_controls is not None:
            out["shown_controls"] = self.shown_controls
        return {**out, **self.derived(), **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClaimRecord:
        """The record back from :meth:`to_json` (keys it does not know go to ``extra``)."""
        data = _object(data, "a claim's record")
        names = {f.name for f in dataclasses.fields(cls)} - {"kind", "extra", "test", "written"}
        known = {k: data[k] for k in names if k in data}
        skip = names | set(cls.DERIVED) | {"validation", "test"}
        test = data.get("test")
        written = {k: data[k] for k in cls.DERIVED if k in data}
        return cls(
            kind=str(data.get("validation", "ablation")),
            test=ControlTest.from_json(test) if isinstance(test, dict) else None,
            extra={k: v for k, v in data.items() if k not in skip},
            written=written if len(written) == len(cls.DERIVED) else None,
            **known,
        )

    def decide(self, alpha: float) -> str:
        """The verdict (:func:`headmech.classification.montecarlo.decide`), kept."""
        from headmech.classification.montecarlo import decide

        if not self.n_heads:
            self.verdict = "no heads"
        elif self.effect is None:  # the model cannot run the claim (the note says why)
            self.verdict = "untestable here" if self.note else "not run"
        else:
            rel, tol = self.extra.get("relative_effect"), self.extra.get("tolerance", 0.01)
            within = rel is not None and abs(rel) <= tol
            self.verdict = decide(self.test, self.effect_interval, alpha, within_tolerance=within)
        return self.verdict


@dataclass
class ControlAccounting:
    """How a type's control sets were drawn: ``kind`` (``same_layers``,
    ``layers_within_d``, ``any_layer``, ``none``), why (``note``), the eligible heads
    (``pool``), the distinct sets possible, the heads kept out and, of those, the ones
    kept out as another type of the circuit (by reason)."""

    kind: str
    note: str
    pool: int
    n_possible: int
    excluded: Pairs | None = None
    circuit: dict[str, Pairs] | None = None

    def to_json(self) -> dict[str, Any]:
        """The accounting's keys, flat beside the primary claim's."""
        out: dict[str, Any] = {
            "control": self.kind,
            "control_note": self.note,
            "control_pool": self.pool,
            "n_possible_sets": self.n_possible,
        }
        if self.excluded is not None:
            out["excluded_from_controls"] = self.excluded
        if self.circuit is not None:
            out["circuit_excluded"] = self.circuit
        return out

    KEYS = (
        "control",
        "control_note",
        "control_pool",
        "n_possible_sets",
        "excluded_from_controls",
        "circuit_excluded",
    )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ControlAccounting:
        return cls(
            str(data.get("control", "none")),
            str(data.get("control_note", "")),
            int(data.get("control_pool", 0)),
            int(data.get("n_possible_sets", 0)),
            data.get("excluded_from_controls"),
            data.get("circuit_excluded"),
        )


class _Flat:
    """A record written as its fields (``to_json``) and read back from them; a field with
    a default may be missing."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload, no-any-return]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        data = _object(data, f"a {cls.__name__} record")
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        return cls(**{f.name: data[f.name] for f in fields if f.name in data or f.default is dataclasses.MISSING})  # fmt: skip


@dataclass
class Redundancy(_Flat):
    """The labelled set's effect against the sum of its heads' own effects: ``ratio`` > 1,
    removed together they cost more than one by one (they back each other up); < 1, their
    effects overlap; None where the two differ in sign."""

    set_effect: float
    sum_of_own_effects: float
    ratio: float | None = None


@dataclass
class HeadEffect(_Flat):
    """A head measured alone: its effect (ablated alone, minus clean), its 95% interval,
    and whether it is labelled."""

    effect: float
    interval: list[float] | None = None
    labelled: bool = False


@dataclass
class BackupRow(_Flat):
    """One candidate backup: its own effect (with interval), its restoration of the
    metric with every other candidate ablated (with its paired interval), the Monte Carlo
    test of that against one more random head's cost, and whether it is a backup."""

    own_effect: float | None
    own_interval: list[float] | None
    restoration: float
    interval: list[float] | None
    exceedances: int
    n: int
    p: float
    q: float
    backup: bool


@dataclass
class BackupTest:
    """The sufficiency test of a type's candidate backups
    (:func:`headmech.classification.backups.sufficiency`)."""

    method: str
    metric: str
    mode: str
    units: str
    ablated: Pairs
    all_ablated_effect: float
    controls: dict[str, Any]  # kind, the heads drawn, each one's cost on top
    tested: dict[str, BackupRow]
    heads: Pairs  # the backups: tested heads whose restoration passes, in the order tested

    def to_json(self) -> dict[str, Any]:
        """The test's record (``validation.backups``), each tested head's row by name."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["tested"] = {k: r.to_json() for k, r in self.tested.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BackupTest:
        data = _object(data, "a backups record")
        names = [f.name for f in dataclasses.fields(cls) if f.name != "tested"]
        tested = {k: BackupRow.from_json(r) for k, r in _object(data["tested"], "tested").items()}
        return cls(**{k: data[k] for k in names}, tested=tested)


@dataclass
class TypeValidation:
    """A type's validation: every claim tested against the same control sets.

    Attributes:
        primary: the first of the type's claims that could run (the paper's own, where
            it can), flat at the record's top level.
        controls: how the control sets were drawn.
        claims: the type's claims, in order.
        unavailable: the claims before the primary one that could not run, with why.
        secondary: the other claims, by kind.
        per_head: heads measured alone (written beside ``details``, not inside it).
        per_head_note: why not every labelled head was measured alone.
        redundancy: the set's effect against the sum of its heads' own effects.
        backups: the sufficiency test of the rejected heads within noise.
        circuit_not_classified: types of the circuit whose heads could not be kept out
            of the controls (not classified in this run).
    """

    primary: ClaimRecord
    controls: ControlAccounting
    claims: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    secondary: dict[str, ClaimRecord] = field(default_factory=dict)
    per_head: dict[str, HeadEffect] = field(default_factory=dict)
    per_head_note: str | None = None
    redundancy: Redundancy | None = None
    backups: BackupTest | None = None
    circuit_not_classified: list[str] | None = None

    OWN = (
        "primary",
        "claims",
        "primary_unavailable",
        "secondary",
        "per_head",
        "per_head_note",
        "redundancy",
        "backups",
        "circuit_not_classified",
    )

    @property
    def verdict(self) -> str:
        """The primary claim's verdict."""
        return self.primary.verdict

    def parts(self) -> list[tuple[str, ClaimRecord]]:
        """Every claim's record, the primary first: ``(kind, record)``."""
        return [(self.primary.kind, self.primary), *self.secondary.items()]

    def tested(self) -> list[ClaimRecord]:
        """The claims with a Monte Carlo test (those Benjamini-Hochberg corrects)."""
        return [r for _, r in self.parts() if r.test is not None]

    def backup_heads(self) -> Pairs:
        """The heads the sufficiency test found to be backups."""
        return list(self.backups.heads) if self.backups is not None else []

    def to_json(self, per_head: bool = False) -> dict[str, Any]:
        """``details.validation`` (with ``per_head``: also each head measured alone, as a
        finished unit of a resumable run stores it)."""
        out = {**self.primary.to_json(), **self.controls.to_json()}
        out |= {"primary": self.primary.kind, "claims": list(self.claims)}
        if self.unavailable:
            out["primary_unavailable"] = dict(self.unavailable)
        if self.secondary:
            out["secondary"] = {k: r.to_json() for k, r in self.secondary.items()}
        if per_head and self.per_head:
            out["per_head"] = {k: e.to_json() for k, e in self.per_head.items()}
        if self.per_head_note is not None:
            out["per_head_note"] = self.per_head_note
        if self.redundancy is not None:
            out["redundancy"] = self.redundancy.to_json()
        if self.backups is not None:
            out["backups"] = self.backups.to_json()
        if self.circuit_not_classified is not None:
            out["circuit_not_classified"] = list(self.circuit_not_classified)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TypeValidation:
        """The record back from :meth:`to_json` (``ValueError`` on a malformed one)."""
        data = _object(data, "a validation record")
        claim = {k: v for k, v in data.items() if k not in (*cls.OWN, *ControlAccounting.KEYS)}
        per = _object(data.get("per_head") or {}, "per_head")
        red, backups = data.get("redundancy"), data.get("backups")
        secondary = _object(data.get("secondary") or {}, "secondary")
        try:
            return cls(
                ClaimRecord.from_json(claim),
                ControlAccounting.from_json(data),
                [str(c) for c in data.get("claims", [claim.get("validation", "ablation")])],
                dict(data.get("primary_unavailable") or {}),
                {str(k): ClaimRecord.from_json(r) for k, r in secondary.items()},
                {str(k): HeadEffect.from_json(e) for k, e in per.items()},
                data.get("per_head_note"),
                None if red is None else Redundancy.from_json(red),
                None if backups is None else BackupTest.from_json(backups),
                data.get("circuit_not_classified"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"a validation record is malformed ({type(e).__name__}: {e})") from e


def validation_of(entry: dict[str, Any]) -> TypeValidation | None:
    """A type's validation from its ``catalog.json`` entry (None where it has none)."""
    v = (entry.get("details") or {}).get("validation")
    return None if v is None else TypeValidation.from_json(v)
