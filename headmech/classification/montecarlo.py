"""Monte Carlo tests of claims about head sets, their false discovery rate, and verdicts.

A claim about a type's labelled heads (ablating them hurts the type's task; their writes
feed the induction heads' keys; their direct path carries the IOI logit difference) is a
statistic ``T(S)`` of a head set ``S``. Under the null hypothesis the labelled set is one
more draw from the control sets' distribution (as many heads not of the type, drawn as
the labelled heads lie: :mod:`headmech.classification.control_sets`), and the number of
controls at least as extreme as the labelled set gives the Monte Carlo p-value

    p = (1 + exceedances) / (1 + n)

(North, Curtis, Sham 2002), which is valid for any ``n`` and can never be smaller than
``1 / (1 + n)``: beating every one of 5 control sets is p = 0.17, not a finding.
Controls are drawn in rounds, and the test stops once ``stop_after`` controls are at least
as extreme (Besag & Clifford 1991): a set no better than random costs about
``stop_after / p`` draws instead of ``n_max``; the p of a stopped test is still
``(1 + h) / (1 + n)``, slightly above Besag and Clifford's ``h / n`` (conservative).
Benjamini-Hochberg (1995) across the claims of one catalog turns the p-values into
q-values (:func:`benjamini_hochberg`), and :func:`decide` says the verdict: *validated*
when q <= alpha and the effect's 95% interval excludes 0.

References:
    Besag, Clifford 1991, "Sequential Monte Carlo p-values", Biometrika 78(2).
    North, Curtis, Sham 2002, "A note on the calculation of empirical P values from Monte
    Carlo procedures", Am. J. Hum. Genet. 71(2).
    Benjamini, Hochberg 1995, "Controlling the false discovery rate", JRSS B 57(1).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "VERDICTS",
    "ControlTest",
    "TestOptions",
    "benjamini_hochberg",
    "decide",
    "describe_test",
    "exceeds",
    "mc_p",
    "measured_on",
    "sequential_test",
]

VERDICTS = (
    "validated",
    "not validated",
    "inconclusive",
    "untestable here",
    "no heads",
    "not run",
)
"""What :func:`decide` says of a claim: *inconclusive* when fewer control sets were asked
for than a p <= alpha needs (``--n-random 5``: p >= 0.17 at best); *untestable here* when
the model holds too few distinct control sets for such a p (widened as far as allowed),
or none at all."""


PIECE = 4
"""Sequences per piece the probe's batches are cut into for the test (``control_tokens``)."""
MIN_SEQUENCES = 2
"""The fewest probe sequences a test with ``control_tokens`` is measured on (one needle
trial of a thousand tokens holds 512 on its own)."""


@dataclass(frozen=True)
class TestOptions:
    """How a claim is tested against control sets.

    Attributes:
        n_max: control sets drawn at most (99: p can reach 0.01).
        stop_after: stop once this many controls are at least as extreme (Besag and
            Clifford's h).
        first_round: control sets of the first round (19: the fewest that can give
            p = 0.05); later rounds draw the rest in two halves.
        alpha: the false discovery rate a verdict is decided at.
        control_tokens: the controls (and, for the test, the labelled set) are measured
            on every k-th probe batch, k the largest that still holds this many tokens
            (0: every batch; :meth:`test_batches`); the labelled effect and its interval
            always use every batch.
    """

    __test__ = False  # not a pytest class

    n_max: int = 99
    stop_after: int = 5
    first_round: int = 19
    alpha: float = 0.05
    control_tokens: int = 0

    def rounds(self) -> list[int]:
        """Control sets per round: ``first_round``, then the rest in two halves."""
        first = min(self.first_round, self.n_max)
        rest = self.n_max - first
        half = -(-rest // 2)
        return [n for n in (first, half, rest - half) if n > 0]

    def test_batches(self, batches: Sequence[Any]) -> tuple[list[Any], int]:
        """The batches the test is measured on and their stride ``k``: the probe's
        batches cut into pieces of at most :data:`PIECE` sequences, then every k-th piece
        from the middle of the first ``k`` (batches come sorted by length, so the sample
        spans the lengths), ``k`` the largest whose pieces hold ``control_tokens`` and at
        least :data:`MIN_SEQUENCES` sequences; the batches whole where that is all of them."""
        batches = list(batches)
        if self.control_tokens <= 0:
            return batches, 1
        pieces = [
            b.rows(i, i + PIECE) if hasattr(b, "rows") else b
            for b in batches
            for i in (range(0, b.input_ids.shape[0], PIECE) if hasattr(b, "rows") else [0])
        ]
        sizes = [int(b.attention_mask.sum()) if hasattr(b, "attention_mask") else 1 for b in pieces]
        rows = [int(b.input_ids.shape[0]) if hasattr(b, "input_ids") else 1 for b in pieces]
        best = 1
        for k in range(2, len(pieces) + 1):
            enough = sum(rows[k // 2 :: k]) >= min(MIN_SEQUENCES, sum(rows))
            if sum(sizes[k // 2 :: k]) >= self.control_tokens and enough:
                best = k
        return (batches, 1) if best == 1 else (pieces[best // 2 :: best], best)

    def p_min(self, n_possible: int | None = None) -> float:
        """The smallest p a test of these options can give (where ``n_possible``
        distinct control sets exist)."""
        n = self.n_max if n_possible is None else min(self.n_max, n_possible)
        return 1.0 / (1 + n)


def measured_on(used: Sequence[Any], batches: Sequence[Any], stride: int) -> str:
    """The probe sequences the test was measured on, in words."""

    def rows(bs: Sequence[Any]) -> int:
        return sum(int(b.input_ids.shape[0]) if hasattr(b, "input_ids") else 1 for b in bs)

    if stride == 1:
        return f"all {rows(batches)} probe sequences"
    return f"{rows(used)} of {rows(batches)} probe sequences (every {stride}th group of up to 4)"


def mc_p(exceedances: int, n: int) -> float:
    """The Monte Carlo p-value ``(1 + exceedances) / (1 + n)`` (North et al. 2002)."""
    return (1 + exceedances) / (1 + n)


def exceeds(control: float, labelled: float, expected: str) -> bool:
    """Whether a control set's value is at least as extreme as the labelled set's, in
    the direction the claim expects: ``raise`` (ablating the heads raises the metric:
    a control at least as high), ``lower`` (at least as low), ``little`` (inactive heads:
    a control that changes the metric at most as much, in absolute value). Ties count
    as exceedances (conservative)."""
    if expected == "raise":
        return control >= labelled
    if expected == "lower":
        return control <= labelled
    if expected == "little":
        return abs(control) <= abs(labelled)
    raise ValueError(f"expected is 'raise', 'lower' or 'little', got {expected!r}")


@dataclass
class ControlTest:
    """One claim's Monte Carlo test (the ``test`` entry of a validation record).

    Attributes:
        statistic: the labelled set's value on the test's units.
        controls: every control set's value, in draw order.
        exceedances: controls at least as extreme (:func:`exceeds`).
        p: :func:`mc_p`; ``p_min``: the smallest p this test could have given.
        stopped: ``stop_after`` (enough exceedances), ``n_max`` or ``space`` (every
            distinct control set drawn).
        n_possible: distinct control sets the model holds (capped at 10**12).
        units: the probe units the test was measured on.
        expected: the claim's direction (:func:`exceeds`).
        q: Benjamini-Hochberg's q across the catalog's claims (``family`` of them);
            None until :func:`benjamini_hochberg` has run.
    """

    statistic: float
    controls: list[float]
    exceedances: int
    p: float
    p_min: float
    stopped: str
    n_max: int
    stop_after: int
    n_possible: int
    units: str
    expected: str = "raise"
    q: float | None = None
    family: int | None = None
    method: str = "Monte Carlo (Besag & Clifford 1991; North et al. 2002)"
    extra: dict[str, Any] = field(default_factory=dict)
    # the summary as a file wrote it (None: computed from the controls)
    written: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    SUMMARY = ("median", "range_90", "multiple")

    @property
    def n(self) -> int:
        """Control sets drawn."""
        return len(self.controls)

    def summary(self) -> dict[str, Any]:
        """The controls' median, 5-95% range and the statistic as a multiple of the
        median (None where the median is 0); as written where the test was read from a
        file (computed from the unrounded values when it was measured)."""
        if self.written is not None:
            return dict(self.written)
        if not self.controls:
            return {"median": None, "range_90": None, "multiple": None}
        xs = sorted(self.controls)
        q = statistics.quantiles(xs, n=20, method="inclusive") if len(xs) > 1 else [xs[0]] * 19
        med = statistics.median(xs)
        return {
            "median": med,
            "range_90": [q[0], q[-1]],
            "multiple": self.statistic / med if med else None,
        }

    def to_json(self) -> dict[str, Any]:
        """The record in ``catalog.json`` (with :meth:`summary` and ``n``)."""
        out = asdict(self)
        del out["written"]
        if not out["extra"]:
            del out["extra"]
        return {**out, "n": self.n, **self.summary()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ControlTest:
        """The test from its record (the summary kept as written)."""
        names = {f.name for f in fields(cls)} - {"written"}
        written = {k: data[k] for k in cls.SUMMARY if k in data}
        return cls(
            **{k: v for k, v in data.items() if k in names},
            written=written if len(written) == len(cls.SUMMARY) else None,
        )


def sequential_test(
    statistic: float,
    first: Sequence[float],
    more: Callable[[int, int], Sequence[float]],
    n_drawn: int,
    options: TestOptions,
    expected: str,
    n_possible: int,
    units: str,
) -> ControlTest:
    """Besag and Clifford's sequential test: the first round's control values
    (``first``), then further rounds ``more(start, count)`` (the values of control sets
    ``start .. start + count`` of the draw order) until ``options.stop_after`` controls
    exceed the labelled ``statistic``, ``options.n_max`` are drawn, or the ``n_drawn``
    distinct sets available are used up."""
    values = list(first)
    sizes = options.rounds()
    stopped = ""
    for size in sizes[1:]:
        if sum(exceeds(v, statistic, expected) for v in values) >= options.stop_after:
            stopped = "stop_after"
            break
        if len(values) >= n_drawn:
            break
        count = min(size, n_drawn - len(values))
        values += list(more(len(values), count))
    e = sum(exceeds(v, statistic, expected) for v in values)
    if not stopped:
        if e >= options.stop_after:
            stopped = "stop_after"
        elif len(values) >= options.n_max:
            stopped = "n_max"
        else:
            stopped = "space"
    return ControlTest(
        statistic=statistic,
        controls=values,
        exceedances=e,
        p=mc_p(e, len(values)),
        p_min=options.p_min(n_possible),
        stopped=stopped,
        n_max=options.n_max,
        stop_after=options.stop_after,
        n_possible=min(n_possible, 10**12),
        units=units,
        expected=expected,
    )


def benjamini_hochberg(ps: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg q-values of ``ps`` (scipy's ``false_discovery_control``)."""
    if not ps:
        return []
    from scipy.stats import false_discovery_control

    return [float(q) for q in false_discovery_control(list(ps), method="bh")]


def decide(
    test: ControlTest | None,
    interval: Sequence[float] | None,
    alpha: float = 0.05,
    *,
    within_tolerance: bool | None = None,
) -> str:
    """A claim's verdict (one of :data:`VERDICTS` but for ``no heads`` and ``not run``,
    which the caller knows first).

    * ``untestable here``: no control set, or fewer distinct ones than a p <= ``alpha``
      needs (the model's space, not the request);
    * ``inconclusive``: fewer control sets asked for than such a p needs;
    * ``validated``: q <= ``alpha`` (p where no q was computed), the effect's 95%
      ``interval`` excludes 0 in the expected direction (``little``: ``within_tolerance``,
      the effect within its tolerance of the clean metric, instead);
    * ``not validated``: otherwise.
    """
    if test is None or not test.controls:
        return "untestable here"
    if test.p_min > alpha:
        return "inconclusive" if test.n_possible > test.n_max else "untestable here"
    q = test.q if test.q is not None else test.p
    if test.expected == "little":
        ok = bool(within_tolerance)
    elif interval is None:
        ok = False
    else:
        ok = interval[0] > 0 if test.expected == "raise" else interval[1] < 0
    return "validated" if q <= alpha and ok else "not validated"


def describe_test(test: ControlTest | None) -> str:
    """A test in a few words: ``p 0.01, q 0.013, n 99`` (``n`` the control sets drawn; a
    permutation test says ``999 permutations``)."""
    if test is None:
        return ""
    parts = [f"p {test.p:.2g}"]
    if test.q is not None:
        parts.append(f"q {test.q:.2g}")
    parts.append(f"{test.n} permutations" if "permutation" in test.method else f"n {test.n}")
    if test.p_min > 0.05:  # quick work, or a small model: the best p it could give
        parts.append(f"p >= {test.p_min:.2g} at best")
    return ", ".join(parts)
