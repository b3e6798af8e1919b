"""The verdict's own test: planted claims whose truth is known, run through the same
control draws, sequential Monte Carlo test and decision as a real validation.

:class:`PlantedClaim` measures a head set without a model: its effect on each probe unit
is the sum of its heads' planted effects plus the unit's noise (shared by every set, as
one probe input is shared by every ablation of it: common random numbers) plus a small
noise of its own. :func:`planted_verdict` labels a set of heads, draws the controls as
:func:`headmech.classification.control_sets.controls_for` does for any type, runs
:meth:`headmech.classification.claim_types.Claim.validate` and decides the verdict. Under the
null hypothesis (the labelled heads are as random as the controls) a valid test says
*validated* in at most ``alpha`` of seeds (type I error); with a planted effect it should
say so in most (power). tests/test_verdicts.py checks both at the published ``n_max``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from headmech.classification.claim_types import Claim, ClaimRecord, Measured, ValidationContext
from headmech.classification.control_sets import controls_for
from headmech.classification.montecarlo import TestOptions
from headmech.core.head_index import HeadIndex
from headmech.models import ModelInfo
from headmech.probes import ProbeOptions

__all__ = ["PlantedClaim", "planted_verdict"]


@dataclass(frozen=True, eq=False)
class PlantedClaim(Claim):
    """A head set's effect per unit: its heads' ``effects`` summed, plus the unit's
    shared noise (sd ``unit_noise``), plus its own (sd ``set_noise``), over ``n_units``
    units in ``n_batches`` batches."""

    effects: Tensor = field(default_factory=lambda: torch.zeros(1, 1))
    unit_noise: float = 1.0
    set_noise: float = 0.2
    n_units: int = 64
    n_batches: int = 4
    seed: int = 0
    kind: ClassVar[str] = "planted"
    measures_alone: ClassVar[bool] = True

    def describe(self, ctx: ValidationContext) -> str:
        return "planted: each head's effect known"

    def prepare(self, ctx: ValidationContext) -> tuple[Any, list[Any], str, str]:
        return None, list(range(self.n_batches)), "planted effect", "planted"

    def measure(self, ctx, task, sets, batches):  # type: ignore[no-untyped-def]
        """See :meth:`Claim.measure`: the planted sums with their noise, per unit."""
        from headmech.stream.uncertainty import UnitValues

        per = self.n_units // self.n_batches
        units = torch.tensor([b * per + i for b in batches for i in range(per)])
        g = torch.Generator().manual_seed(self.seed)
        shared = torch.randn(self.n_units, generator=g, dtype=torch.float64) * self.unit_noise
        flat = self.effects.flatten()
        n_heads = int(self.effects.shape[1])
        rows = []
        for s in sets:
            idx = sorted(h.layer * n_heads + h.head for h in s)
            gs = torch.Generator().manual_seed(hash((self.seed, *idx)) % (2**63))
            own = torch.randn(self.n_units, generator=gs, dtype=torch.float64) * self.set_noise
            rows.append(float(flat[idx].sum()) + shared + own)
        values = (
            torch.stack(rows)[:, units] if rows else torch.zeros(0, len(units), dtype=torch.float64)
        )

        def interval(i: int) -> list[float] | None:
            iv = UnitValues(values[i], torch.ones(len(units))).interval(seed=self.seed)
            return None if iv is None else [float(iv[0]), float(iv[1])]

        return Measured([float(v) for v in values.mean(1)], 0.0, interval)


def planted_verdict(
    effects: Tensor,
    labelled: list[HeadIndex],
    seed: int,
    options: TestOptions | None = None,
    **claim: Any,
) -> ClaimRecord:
    """Validate ``labelled`` on a planted model whose heads' effects are ``effects``
    (``[n_layers, n_heads]``), controls drawn as for any type, the verdict decided on p
    (one claim: q = p)."""
    options = options or TestOptions()
    n_layers, n_heads = effects.shape
    info = ModelInfo("planted", int(n_layers), int(n_heads), int(n_heads), 1, 1, True)
    controls = controls_for(info, labelled, options.n_max, seed)
    ctx = ValidationContext(
        None,  # type: ignore[arg-type]  # a planted claim runs no model
        _PlantedType(),  # type: ignore[arg-type]
        labelled,
        ProbeOptions(seed=seed),
        options,
        controls,  # type: ignore[arg-type]
    )
    record, _ = PlantedClaim(effects=effects, seed=seed, **claim).validate(ctx)
    record.decide(options.alpha)
    return record


class _PlantedType:
    """The little of a head type a planted claim reads."""

    name = "planted"
    claim = ""
    task = "planted"
    effect_tolerance = 0.01

    def expected(self) -> str:
        return "raise"
