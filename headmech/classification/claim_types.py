"""Claims as objects: each kind of evidence a head type can rest on, tested the same way.

A head type lists its claims (``HeadType.claims``), the paper's own first: its *primary*
claim, the verdict tables show. Each :class:`Claim` says how a head set is measured
(:meth:`Claim.measure`: one value per set, minus the clean run's); the test against
random control sets is shared (:meth:`Claim.validate`, the Monte Carlo test of
:mod:`headmech.classification.montecarlo`). A contributor adds a kind of claim by
subclassing :class:`Claim` in their own file and naming it in their type's ``claims``.

* :class:`Ablation`: ablate the set, measure the type's task (higher is worse).
* :class:`DirectPath`: path patching to the logits from the corrupted prompts (Wang et
  al. 2022's test of name movers; :func:`headmech.classification.claims.direct_path_values`).
* :class:`KComposition`: the set's writes patched into the induction heads' keys
  (Olsson et al. 2022's role of previous-token heads; :func:`~headmech.classification.claims.k_composition`).
* :class:`SinkDose` (:mod:`headmech.classification.sinks`): a dose-response test for
  attention sinks, whose labelled sets leave no equal-sized control.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from headmech.classification.montecarlo import (
    TestOptions,
    measured_on,
    sequential_test,
)
from headmech.classification.records import ClaimRecord
from headmech.core.head_index import HeadIndex
from headmech.core.registry import CLAIMS
from headmech.stream.engine import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.control_sets import Controls
    from headmech.headtypes.base import HeadType
    from headmech.probes import ProbeOptions

__all__ = [
    "Ablation",
    "Claim",
    "ClaimRecord",
    "DirectPath",
    "KComposition",
    "Measured",
    "ValidationContext",
]


@dataclass
class ValidationContext:
    """What a claim is tested with: the model, the type, its labelled heads, the probe
    options, the test's options, the catalog's labels (K-composition reads the induction
    heads), the type's control sets (in draw order), the heads measured alone and the
    type's score grid (dose-response claims read it)."""

    model: TransformerBridge
    head_type: HeadType
    heads: list[HeadIndex]
    options: ProbeOptions
    test: TestOptions
    controls: Controls
    labelled: dict[str, list[HeadIndex]] = field(default_factory=dict)
    alone: list[HeadIndex] = field(default_factory=list)
    score: torch.Tensor | None = None


@dataclass
class Measured:
    """Per head set, its effect (the metric under the set's intervention minus the clean
    run's), the clean metric, and a 95% interval of set ``i``'s effect on demand."""

    effects: list[float]
    clean: float
    interval: Callable[[int], list[float] | None] | None = None  # None: none drawn


class Claim:
    """One kind of evidence about a type's heads (subclass it to add a kind).

    Attributes:
        kind: its name in records (``ablation``, ``direct_path``, ...).
        measures_alone: the heads measured one at a time (``per_head``) are measured
            with the type's first claim that does this.
    """

    kind: ClassVar[str] = ""
    measures_alone: ClassVar[bool] = False

    def unavailable(self, ctx: ValidationContext) -> str | None:
        """Why this claim cannot be tested on the model, or None."""
        return None

    def describe(self, ctx: ValidationContext) -> str:
        """One line: what the claim says (the type's ``claim`` where it wrote one)."""
        return ctx.head_type.claim or (
            f"ablating the labelled heads changes the '{ctx.head_type.task}' task's metric more "
            "than ablating as many random heads"
        )

    def prepare(self, ctx: ValidationContext) -> tuple[Any, list[ProbeBatch], str, str]:
        """``(task, batches, metric description, mode)``."""
        raise NotImplementedError

    def measure(
        self, ctx: ValidationContext, task: Any, sets: Sequence[Sequence[HeadIndex]],
        batches: Sequence[ProbeBatch],
    ) -> Measured:  # fmt: skip
        """Each set's effect on ``batches``."""
        raise NotImplementedError

    def expected(self, ctx: ValidationContext) -> str:
        """The direction the claim expects (``raise``, ``lower``, ``little``)."""
        return ctx.head_type.expected()

    def validate(self, ctx: ValidationContext) -> tuple[ClaimRecord, list[tuple[HeadIndex, float, Any]]]:  # fmt: skip
        """The labelled set against the control sets (the sequential test), and each head
        of ``ctx.alone`` measured alone where this claim does that: ``(record, [(head,
        effect, interval)])``."""
        why = self.unavailable(ctx)
        task, batches, metric, mode = self.prepare(ctx) if why is None else (None, [], "", "")
        record = ClaimRecord(
            self.kind, self.describe(ctx), metric, mode, self.expected(ctx), len(ctx.heads)
        )
        if why is not None or not ctx.heads:
            record.note = why or "no labelled heads"
            return record, []
        sets = ctx.controls.sets
        test_batches, stride = ctx.test.test_batches(batches)
        shared = stride == 1
        first_n = min(ctx.test.rounds()[0], len(sets)) if sets else 0
        alone = list(ctx.alone) if self.measures_alone else []
        full = [list(ctx.heads), *[[h] for h in alone], *(sets[:first_n] if shared else [])]
        m = self.measure(ctx, task, full, batches)
        iv = m.interval or (lambda i: None)
        record.effect, record.effect_interval, record.clean = m.effects[0], iv(0), m.clean
        own = [(h, m.effects[1 + i], iv(1 + i)) for i, h in enumerate(alone)]
        if shared:
            statistic, first = m.effects[0], m.effects[1 + len(alone) :]
        else:
            t = self.measure(ctx, task, [list(ctx.heads), *sets[:first_n]], test_batches)
            statistic, first = t.effects[0], t.effects[1:]

        def more(start: int, count: int) -> list[float]:
            return self.measure(ctx, task, sets[start : start + count], test_batches).effects

        if sets:
            units = measured_on(test_batches, batches, stride)
            record.test = sequential_test(
                statistic, first, more, len(sets), ctx.test, record.expected,
                ctx.controls.n_possible, units,
            )  # fmt: skip
            record.control_sets = [[[h.layer, h.head] for h in s] for s in sets[: record.test.n]]
        record.note = ctx.controls.note
        self.finish(ctx, record)
        return record, own

    def finish(self, ctx: ValidationContext, record: ClaimRecord) -> None:
        """Anything a kind adds to its record (default: the relative effect and the
        tolerance of a claim that expects little)."""
        if record.expected == "little" and record.effect is not None and record.clean:
            record.extra["relative_effect"] = record.effect / abs(record.clean)
            record.extra["tolerance"] = ctx.head_type.effect_tolerance


def progress_label(ctx: ValidationContext, what: str) -> str | bool:
    """A progress bar's name for a measurement of ``ctx``'s type (none when silent)."""
    from headmech.core.progress import active

    return f"validate {ctx.head_type.name} ({what})" if active() else False


@dataclass(frozen=True)
class Ablation(Claim):
    """Ablating the set changes the type's task metric (the type's ``task`` and
    ``ablation`` mode unless given): the set's effect against random sets'."""

    task: str | None = None
    mode: str | None = None
    kind: ClassVar[str] = "ablation"
    measures_alone: ClassVar[bool] = True

    def unavailable(self, ctx: ValidationContext) -> str | None:
        from headmech.core.registry import TASKS
        from headmech.tasks import is_causal

        t = TASKS.get(str(self.task or ctx.head_type.task))(ctx.model)
        if t.causal_only and not is_causal(ctx.model):
            return f"not validated: task '{t.name}' needs a causal (decoder) model"
        return None

    def prepare(self, ctx: ValidationContext) -> tuple[Any, list[ProbeBatch], str, str]:
        from headmech.tasks import get_task

        t = get_task(self.task or ctx.head_type.task, ctx.model)
        mode = self.mode or ctx.head_type.ablation
        return t, t.batches(ctx.model, ctx.options), t.description, mode

    def measure(self, ctx, task, sets, batches):  # type: ignore[no-untyped-def]
        """See :meth:`Claim.measure`: :func:`headmech.interventions.run_variants`."""
        from headmech.interventions import run_variants
        from headmech.interventions.ablation import ablation_variants
        from headmech.stream.uncertainty import UnitValues

        mode = self.mode or ctx.head_type.ablation
        variants = ablation_variants(ctx.model, batches, sets, mode)
        values, clean, sums, counts = run_variants(
            ctx.model, task, batches, variants, per_unit=True,
            progress=progress_label(ctx, f"{self.kind}, {len(sets)} sets"),
        )  # fmt: skip

        def interval(i: int) -> list[float] | None:
            paired = UnitValues(sums[1 + i] - sums[0], counts[0]).interval(seed=ctx.options.seed)
            out = None if paired is None else [float(paired[0]), float(paired[1])]
            return None if out is None or out[0] != out[0] else out  # NaN: no unit scored

        return Measured([float(v) - clean for v in values], clean, interval)


@dataclass(frozen=True)
class DirectPath(Claim):
    """The set's direct effect on the logits (path patching from the corrupted prompts,
    Wang et al. 2022), with the backup heads of a set that serves the task."""

    kind: ClassVar[str] = "direct_path"
    measures_alone: ClassVar[bool] = True

    def unavailable(self, ctx: ValidationContext) -> str | None:
        from headmech.tasks import is_causal

        return None if is_causal(ctx.model) else "path patching to the logits needs a decoder"

    def prepare(self, ctx: ValidationContext) -> tuple[Any, list[ProbeBatch], str, str]:
        from headmech.tasks import get_task

        t: Any = get_task(ctx.head_type.task, ctx.model)
        metric = f"direct effect on the logits (path patching from the corrupted prompts): {t.description}"
        return t, t.batches(ctx.model, ctx.options), metric, "path patching to the logits"

    def measure(self, ctx, task, sets, batches):  # type: ignore[no-untyped-def]
        """See :meth:`Claim.measure`: :func:`headmech.classification.claims.direct_path_values`."""
        from headmech.classification.claims import direct_path_values
        from headmech.stream.uncertainty import UnitValues

        values, clean, per = direct_path_values(ctx.model, task, batches, sets, ctx.options.seed)

        def interval(i: int) -> list[float] | None:
            paired = UnitValues(per[i], torch.ones(per.shape[1])).interval(seed=ctx.options.seed)
            return None if paired is None else [float(paired[0]), float(paired[1])]

        return Measured([float(v) - clean for v in values], clean, interval)

    def finish(self, ctx: ValidationContext, record: ClaimRecord) -> None:
        from headmech.classification.claims import backup_heads

        if ctx.heads and record.expected == "raise":
            task, batches, _, _ = self.prepare(ctx)
            record.extra["backup"] = backup_heads(
                ctx.model, task, batches, list(ctx.heads), ctx.options.seed
            )


@dataclass(frozen=True)
class KComposition(Claim):
    """The set's writes, patched from the corrupted run into the induction heads' keys
    (the catalog's ``induction`` labels), raise the repeated half's loss (Olsson et al.
    2022: previous-token heads feed induction heads through K-composition)."""

    kind: ClassVar[str] = "k_composition"

    def _receivers(self, ctx: ValidationContext) -> list[HeadIndex]:
        return [
            r for r in ctx.labelled.get("induction", [])
            if any(h.layer < r.layer for h in ctx.heads)
        ]  # fmt: skip

    def unavailable(self, ctx: ValidationContext) -> str | None:
        from headmech.tasks import is_causal

        if not is_causal(ctx.model):
            return "K-composition into induction heads needs a decoder"
        if not self._receivers(ctx):
            return "no induction head after a labelled head (the catalog's induction labels)"
        return None

    def describe(self, ctx: ValidationContext) -> str:
        return (
            "Olsson et al.: the heads' writes feed the induction heads' keys (K-composition): "
            "patched from a run without the repeat, they raise the repeated half's loss more "
            "than random heads' writes"
        )

    def prepare(self, ctx: ValidationContext) -> tuple[Any, list[ProbeBatch], str, str]:
        from headmech.tasks import get_task

        t = get_task("induction", ctx.model)
        metric = (
            f"{t.description}, with the senders' corrupted writes patched into the receivers' "
            "keys only (first halves replaced)"
        )
        return t, t.batches(ctx.model, ctx.options), metric, "path patching into the keys"

    def measure(self, ctx, task, sets, batches):  # type: ignore[no-untyped-def]
        """See :meth:`Claim.measure`: :func:`headmech.classification.claims.k_composition`."""
        from headmech.classification.claims import k_composition

        effects, iv = k_composition(
            ctx.model, sets, self._receivers(ctx), batches, task, ctx.options.seed
        )
        return Measured(list(effects), 0.0, lambda i: iv if i == 0 else None)

    def finish(self, ctx: ValidationContext, record: ClaimRecord) -> None:
        record.clean = None  # a change of the metric, not a level
        record.extra["receivers"] = [[r.layer, r.head] for r in self._receivers(ctx)]


CLAIMS.register("ablation", Ablation)
CLAIMS.register("direct_path", DirectPath)
CLAIMS.register("k_composition", KComposition)
