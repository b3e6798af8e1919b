"""Backups: heads at or above a type's threshold whose own effect is within noise, tested
for sufficiency.

A head that matters little when ablated alone may do the type's job all the same when the
others are gone: Wang et al. (2022) found backup name movers that take over when the
name movers are knocked out, and McGrath et al. (2023) the same self-repair across a
model ("the Hydra effect"). Qwen2.5-Coder-0.5B leaves 14 heads above the induction
threshold unlabelled because each one's own effect is small, while removing the set
costs 2.96x the sum of its heads' own effects: they back each other up.

:func:`sufficiency` ablates every candidate (the labelled heads and every head at or
above the threshold), ``K``, and then ``K`` but one tested head ``h``, kept alone. Its
*restoration*, ``metric(K) - metric(K without h)``, is what ``h`` alone gives back. The
controls are single heads ``c`` outside ``K`` and not of the type or its circuit, from the
tested heads' layers widened until ``n_max`` exist: what one more random head costs on
top of ``K``, ``metric(K + c) - metric(K)``. Each tested head's Monte Carlo p
(:func:`headmech.classification.montecarlo.mc_p`) is corrected by Benjamini-Hochberg across
the tested heads; a head is a *backup* when q <= alpha and its restoration's 95% interval
excludes 0. Both numbers, its own effect and its restoration, are recorded.

References:
    Wang et al. 2022, "Interpretability in the Wild" (backup name movers); McGrath,
    Rahtz, Kramar, Mikulik, Legg 2023, "The Hydra Effect: Emergent Self-repair in
    Language Model Computations", arXiv:2307.15771.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from headmech.classification.montecarlo import benjamini_hochberg, exceeds, mc_p, measured_on
from headmech.classification.records import BackupRow, BackupTest
from headmech.core.head_index import HeadIndex

if TYPE_CHECKING:
    from headmech.classification.claim_types import Ablation, ValidationContext

__all__ = ["MAX_TESTED", "backup_candidates", "sufficiency"]

MAX_TESTED = 16  # heads tested for sufficiency per type, the highest scores first


def backup_candidates(
    own: dict[HeadIndex, tuple[float, list[float] | None]], rejected: Sequence[HeadIndex]
) -> list[HeadIndex]:
    """The heads of ``rejected`` (at or above the threshold, not labelled; best first)
    whose own effect's interval (``own``) contains 0: within noise."""
    out = []
    for h in rejected:
        effect, iv = own.get(h, (None, None))
        if iv is not None and iv[0] <= 0 <= iv[1]:
            out.append(h)
    return out[:MAX_TESTED]


def _control_heads(ctx: ValidationContext, ablated: set[HeadIndex], tested: list[HeadIndex]) -> tuple[list[HeadIndex], str]:  # fmt: skip
    """Up to ``n_max`` single heads outside ``ablated`` and the type's exclusions, from the
    tested heads' layers widened by the fewest layers that hold that many, in a random
    order; and the kind (``layers_within_d``)."""
    from headmech.classification.claims import near_layers

    n_layers, n_heads = int(ctx.model.cfg.n_layers), int(ctx.model.cfg.n_heads)
    banned = ablated | set(ctx.controls.excluded)
    layers = {h.layer for h in tested}
    pool: list[HeadIndex] = []
    d = 0
    for d in range(n_layers):
        near = near_layers(layers, n_layers, d)
        pool = [HeadIndex(la, h) for la in near for h in range(n_heads) if HeadIndex(la, h) not in banned]  # fmt: skip
        if len(pool) >= ctx.test.n_max:
            break
    g = torch.Generator().manual_seed(ctx.options.seed + 1)
    order = torch.randperm(len(pool), generator=g).tolist()
    return [pool[i] for i in order][: ctx.test.n_max], f"layers_within_{d}"


def sufficiency(
    ctx: ValidationContext,
    claim: Ablation,
    rejected: Sequence[HeadIndex],
    tested: Sequence[HeadIndex],
    own: dict[HeadIndex, tuple[float, list[float] | None]],
) -> BackupTest:
    """The backup test of the module docstring for ``tested`` (a subset of ``rejected``,
    the heads above the threshold not labelled), the record ``validation.backups``."""
    from headmech.interventions import run_variants
    from headmech.interventions.ablation import ablation_variants
    from headmech.stream.uncertainty import UnitValues

    task, batches, metric, mode = claim.prepare(ctx)
    used, stride = ctx.test.test_batches(batches)
    knocked = list(dict.fromkeys([*ctx.heads, *rejected]))
    controls, kind = _control_heads(ctx, set(knocked), list(tested))
    rounds = ctx.test.rounds()
    sets = [knocked, *[[h for h in knocked if h != t] for t in tested]]
    sets += [[*knocked, c] for c in controls[: rounds[0]]]
    variants = ablation_variants(ctx.model, used, sets, mode)
    values, clean, sums, counts = run_variants(ctx.model, task, used, variants, per_unit=True)
    base, n_t = float(values[0]), len(tested)
    restore = [base - float(values[1 + i]) for i in range(n_t)]
    costs = [float(v) - base for v in values[1 + n_t :]]

    def n_exceeding(i: int) -> int:
        return sum(exceeds(c, restore[i], "raise") for c in costs)

    for size in rounds[1:]:  # further rounds of controls until every head has h exceedances
        if len(costs) >= len(controls) or all(n_exceeding(i) >= ctx.test.stop_after for i in range(n_t)):  # fmt: skip
            break
        more = [[*knocked, c] for c in controls[len(costs) : len(costs) + size]]
        vals, _ = run_variants(ctx.model, task, used, ablation_variants(ctx.model, used, [knocked, *more], mode))  # fmt: skip
        costs += [float(v) - float(vals[0]) for v in vals[1:]]
    intervals = [
        UnitValues(sums[1] - sums[2 + i], counts[0]).interval(seed=ctx.options.seed)
        for i in range(n_t)
    ]
    rows = _rows(ctx, tested, own, restore, intervals, [n_exceeding(i) for i in range(n_t)], len(costs))  # fmt: skip
    return BackupTest(
        method=(
            "sufficiency: every candidate (labelled, or at or above the threshold) ablated "
            "but the tested head; its restoration against one more random head's cost on top "
            "(Monte Carlo p, Benjamini-Hochberg across the tested heads)"
        ),
        metric=metric,
        mode=mode,
        units=measured_on(used, batches, stride),
        ablated=[[h.layer, h.head] for h in knocked],
        all_ablated_effect=base - clean,
        controls={
            "kind": kind,
            "heads": [[c.layer, c.head] for c in controls[: len(costs)]],
            "costs": costs,
        },
        tested=rows,
        heads=[list(HeadIndex.parse(k)) for k, r in rows.items() if r.backup],
    )


def _rows(
    ctx: ValidationContext,
    tested: Sequence[HeadIndex],
    own: dict[HeadIndex, tuple[float, list[float] | None]],
    restore: list[float],
    intervals: list[Any],
    exceedances: list[int],
    n: int,
) -> dict[str, BackupRow]:
    """Each tested head's record: its own effect, its restoration with its paired
    interval, its Monte Carlo p over ``n`` controls, Benjamini-Hochberg's q across the
    tested heads, and whether it is a backup."""
    rows: dict[str, BackupRow] = {}
    ps = [mc_p(e, n) if n else 1.0 for e in exceedances]
    qs = benjamini_hochberg(ps)
    for i, h in enumerate(tested):
        paired = intervals[i]
        iv = None if paired is None else [float(paired[0]), float(paired[1])]
        effect, own_iv = own.get(h, (None, None))
        backup = bool(qs[i] <= ctx.test.alpha and iv is not None and iv[0] > 0)
        rows[str(h)] = BackupRow(effect, own_iv, restore[i], iv, exceedances[i], n, ps[i], qs[i], backup)  # fmt: skip
    return rows
