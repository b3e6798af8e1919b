"""A test of attention sinks that can fail: a dose-response over sink-score bins.

Sinks are most heads of every decoder (66-83% here), so no random set of as many heads
that are not sinks exists, and a labelled-vs-control comparison cannot be made. The
claim that can be tested is Xiao et al.'s (2024): the model relies on the attention its
heads park on the first token, and relies on it more the more a head parks there. For
head sets drawn within quantile bins of the sink score, the first position is removed
from the set's heads' attention and the rest renormalised
(:class:`headmech.interventions.effects.DropFirst`), and the language-modelling loss
measured. The statistic is Spearman's rank correlation between a set's mean sink score and
its effect; its p-value comes from permuting the effects across the sets (an exact Monte
Carlo permutation test, :func:`headmech.classification.montecarlo.mc_p`). The effect
reported is the top bin's mean (the heads most like the labelled ones), with a bootstrap
interval over its sets, against the bottom bin's sets as the controls.

A model where sinks are a no-op that renormalising absorbs, or whose most sink-like heads
matter no more than the least, fails it. A bridge that ignores attention-pattern edits
(BERT's) cannot run it, and the record says so (*untestable here*).

References:
    Xiao, Tian, Chen, Han, Lewis 2024, "Efficient Streaming Language Models with Attention
    Sinks", ICLR 2024; Gu et al. 2025, "When Attention Sink Emerges in Language Models".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from headmech.classification.claim_types import (
    Claim,
    ClaimRecord,
    Measured,
    ValidationContext,
)
from headmech.classification.montecarlo import ControlTest, exceeds, mc_p, measured_on
from headmech.core.head_index import HeadIndex
from headmech.core.registry import CLAIMS
from headmech.stream.engine import ProbeBatch

__all__ = ["SinkDose", "spearman"]

N_PERMUTATIONS = 999  # p can reach 0.001


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties; scipy's ``spearmanr``)."""
    from scipy.stats import spearmanr

    if len(set(x)) < 2 or len(set(y)) < 2:
        return 0.0
    return float(spearmanr(x, y).statistic)


@dataclass(frozen=True)
class SinkDose(Claim):
    """Removing the first position from heads' attention raises the language-modelling
    loss more, the higher the heads' sink score (``bins`` quantile bins of the score,
    ``per_bin`` sets of ``set_size`` heads each; fewer, down to 2 a bin, where the test's
    ``n_max`` asks for quick work: about ``n_max / 12`` a bin)."""

    bins: int = 5
    per_bin: int = 8
    set_size: int = 4
    kind: ClassVar[str] = "sink_dose"

    def unavailable(self, ctx: ValidationContext) -> str | None:
        from headmech.interventions import pattern_edits_apply

        if ctx.score is None:
            return "no sink scores to bin"
        if not pattern_edits_apply(ctx.model):
            return (
                "the bridge does not apply attention-pattern edits (BERT's): the first "
                "position cannot be removed from one head's attention"
            )
        if int(torch.isfinite(ctx.score).sum()) < self.bins * self.set_size:
            return f"fewer than {self.bins * self.set_size} scored heads to bin"
        return None

    def describe(self, ctx: ValidationContext) -> str:
        return (
            "Xiao et al.: the model relies on the attention its heads park on the first token, "
            "the more so the higher their sink score (dose-response: Spearman's rho between a "
            "head set's sink score and the loss its first-position removal costs, by permutation)"
        )

    def prepare(self, ctx: ValidationContext) -> tuple[Any, list[ProbeBatch], str, str]:
        from headmech.tasks import get_task

        t = get_task("lm", ctx.model)
        metric = f"{t.description}, with the first position removed from the set's heads' attention (renormalised)"
        return t, t.batches(ctx.model, ctx.options), metric, "first position removed"

    def measure(self, ctx, task, sets, batches):  # type: ignore[no-untyped-def]
        """See :meth:`Claim.measure`: the first position removed, in one batched run."""
        from headmech.classification.claim_types import progress_label
        from headmech.interventions import Intervention, run_variants
        from headmech.interventions.effects import DropFirst

        variants = [[Intervention.on(s, DropFirst(), "pattern")] for s in sets]
        what = f"first position removed, {len(sets)} sets"
        values, clean = run_variants(
            ctx.model, task, batches, variants, progress=progress_label(ctx, what)
        )
        return Measured([float(v) - clean for v in values], clean)

    def draw(self, ctx: ValidationContext) -> list[tuple[int, list[HeadIndex]]]:
        """``(bin, heads)`` sets: the scored heads cut into ``bins`` quantile bins (lowest
        first), ``per_bin`` distinct random sets of ``set_size`` heads in each."""
        assert ctx.score is not None
        flat = ctx.score.flatten()
        n_heads = int(ctx.score.shape[1])
        order = [int(i) for i in torch.argsort(flat) if torch.isfinite(flat[i])]
        g = torch.Generator().manual_seed(ctx.options.seed)
        out: list[tuple[int, list[HeadIndex]]] = []
        for b in range(self.bins):
            members = order[b * len(order) // self.bins : (b + 1) * len(order) // self.bins]
            seen: set[frozenset[int]] = set()
            per_bin = max(2, min(self.per_bin, -(-ctx.test.n_max // 12)))
            for _ in range(50 * per_bin):
                if len([1 for bb, _ in out if bb == b]) == per_bin:
                    break
                pick = torch.randperm(len(members), generator=g)[: self.set_size].tolist()
                key = frozenset(members[i] for i in pick)
                if key not in seen:
                    seen.add(key)
                    out.append((b, [HeadIndex(i // n_heads, i % n_heads) for i in sorted(key)]))
        return out

    def validate(self, ctx: ValidationContext) -> tuple[ClaimRecord, list[tuple[HeadIndex, float, Any]]]:  # fmt: skip
        """The dose-response test (the module docstring); no head is measured alone."""
        why = self.unavailable(ctx)
        task, batches, metric, mode = self.prepare(ctx) if why is None else (None, [], "", "")
        record = ClaimRecord(self.kind, self.describe(ctx), metric, mode, "raise", len(ctx.heads))
        if why is not None or not ctx.heads:
            record.note = why or "no labelled heads"
            return record, []
        assert ctx.score is not None
        used, stride = ctx.test.test_batches(batches)
        drawn = self.draw(ctx)
        m = self.measure(ctx, task, [s for _, s in drawn], used)
        dose = [float(torch.stack([ctx.score[h] for h in s]).mean()) for _, s in drawn]
        rho = spearman(dose, m.effects)
        g = torch.Generator().manual_seed(ctx.options.seed)
        y = torch.tensor(m.effects)
        perms = [spearman(dose, y[torch.randperm(len(y), generator=g)].tolist()) for _ in range(N_PERMUTATIONS)]  # fmt: skip
        e = sum(exceeds(r, rho, "raise") for r in perms)
        units = f"{len(drawn)} head sets in {self.bins} sink-score bins, on {measured_on(used, batches, stride)}"
        record.test = ControlTest(
            statistic=rho, controls=perms, exceedances=e, p=mc_p(e, len(perms)),
            p_min=1 / (1 + N_PERMUTATIONS), stopped="n_max", n_max=N_PERMUTATIONS, stop_after=0,
            n_possible=10**12, units=units, method="permutation test of Spearman's rho",
        )  # fmt: skip
        top = [eff for (b, _), eff in zip(drawn, m.effects, strict=True) if b == self.bins - 1]
        low = sorted(eff for (b, _), eff in zip(drawn, m.effects, strict=True) if b == 0)
        record.effect, record.effect_interval = _mean_interval(top, ctx.options.seed)
        record.clean = m.clean
        record.control_sets = [[[h.layer, h.head] for h in s] for b, s in drawn if b == 0]
        record.note = "no equal-sized set of non-sink heads exists: a dose-response over sink-score bins instead"
        record.extra = {
            "rho": rho,
            "dose": [
                {"bin": b, "heads": [[h.layer, h.head] for h in s], "sink_score": d, "effect": eff}
                for (b, s), d, eff in zip(drawn, dose, m.effects, strict=True)
            ],
        }
        record.shown_controls = low  # the least sink-like bin's sets
        return record, []


def _mean_interval(xs: list[float], seed: int, n_boot: int = 2000) -> tuple[float | None, list[float] | None]:  # fmt: skip
    """The mean of ``xs`` and its 95% percentile bootstrap interval."""
    if not xs:
        return None, None
    t = torch.tensor(xs, dtype=torch.float64)
    if len(xs) < 2:
        return float(t.mean()), None
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(xs), (n_boot, len(xs)), generator=g)
    means = t[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(t.mean()), [float(lo), float(hi)]


CLAIMS.register("sink_dose", SinkDose)
