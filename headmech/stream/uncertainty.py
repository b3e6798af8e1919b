"""Bootstrap intervals over probe examples for every per-head score.

A head score is computed from a probe's examples (sentences, repeated sequences, needle
trials); another draw of examples would give another score. The interval here is the
percentile bootstrap over examples: resample the probe's sequences with replacement
``n_boot`` times, recompute the score from the resample, and take the central ``level``
quantiles. It is cheap because nothing runs the model again: the engine keeps each
sequence's sums (:meth:`headmech.stream.engine.HeadStats.units`), and exact methods keep each
sequence's metric (:class:`UnitValues`), so a resample is a weighted sum.

Two shapes of score are covered:

* catalog types: any function of :class:`~headmech.stream.engine.HeadStats`
  (:func:`stats_interval`);
* ratio estimates ``Σ_u num_u / Σ_u den_u`` over units ``u`` (importance, pruning metrics):
  :class:`UnitValues`.

References:
    Efron, Tibshirani 1993, "An Introduction to the Bootstrap" (percentile intervals).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.stream.engine import HeadStats

__all__ = ["LEVEL", "N_BOOT", "UnitValues", "bootstrap_weights", "stats_interval"]

N_BOOT = 200  # resamples
LEVEL = 0.95  # central interval


def bootstrap_weights(n_units: int, n_boot: int = N_BOOT, seed: int = 0) -> Tensor:
    """``[n_boot, n_units]`` counts: how often each unit is drawn in each resample."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(n_units, (n_boot, n_units), generator=g)
    return torch.zeros(n_boot, n_units, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(n_boot, n_units, dtype=torch.float64)
    )


def _quantiles(samples: Tensor, level: float) -> tuple[Tensor, Tensor]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=samples.dtype)
    lo, hi = torch.nanquantile(samples, q, dim=0)
    return lo, hi


class _Resamples:
    """Every resample's sums and counts of a statistic, computed on first use, at once
    (``[n_boot, n_layers, n_heads]``; statistics without per-sequence sums are fixed)."""

    def __init__(self, stats: HeadStats, weights: Tensor) -> None:
        self.stats, self.weights = stats, weights
        self.cache: dict[str, tuple[Tensor, Tensor]] = {}

    def get(self, name: str) -> tuple[Tensor, Tensor]:
        if name not in self.cache:
            units = self.stats.units(name)
            n = self.weights.shape[0]
            if units is None:
                s, c = self.stats.sums[name], self.stats.counts[name]
                self.cache[name] = (s.expand(n, -1, -1), c.expand(n, -1, -1))
            else:
                w = self.weights
                self.cache[name] = (
                    torch.einsum("bu,ulh->blh", w, units[0]),
                    torch.einsum("bu,ulh->blh", w, units[1]),
                )
        return self.cache[name]


class _Column(Mapping[str, Tensor]):
    """One resample's sums (``part=0``) or counts (``part=1``), as HeadStats holds them."""

    def __init__(self, resamples: _Resamples, b: int, part: int) -> None:
        self.r, self.b, self.part = resamples, b, part

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.r.stats.sums:
            raise KeyError(name)
        return self.r.get(name)[self.part][self.b]

    def __iter__(self) -> Iterator[str]:
        return iter(self.r.stats.sums)

    def __len__(self) -> int:
        return len(self.r.stats.sums)


def _view(resamples: _Resamples, b: int) -> HeadStats:
    out = HeadStats(resamples.stats.n_layers, resamples.stats.n_heads)
    out.sums = _Column(resamples, b, 0)  # type: ignore[assignment]
    out.counts = _Column(resamples, b, 1)  # type: ignore[assignment]
    return out


def stats_interval(
    stats: HeadStats,
    score: Callable[[HeadStats], Tensor],
    *,
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[Float[Tensor, "n_layers n_heads"], Float[Tensor, "n_layers n_heads"]] | None:
    """Percentile bootstrap interval of ``score(stats)`` over the probe's sequences; None
    when the statistics keep no per-sequence sums (or fewer than 2 sequences).

    Only the statistics ``score`` reads are resampled, all resamples at once.
    """
    n = stats.n_units
    if n < 2:
        return None
    resamples = _Resamples(stats, bootstrap_weights(n, n_boot, seed))
    from headmech.core.progress import steps

    boot = steps(range(n_boot), "bootstrap resamples", total=n_boot)
    samples = torch.stack([score(_view(resamples, b)).double() for b in boot])
    lo, hi = _quantiles(samples, level)
    return lo.float(), hi.float()


@dataclass
class UnitValues:
    """Per-unit parts of a ratio estimate: ``score = Σ_u num[u] / Σ_u den[u]``.

    Attributes:
        num: ``[n_units, ...]`` each unit's share of the numerator (e.g. a sequence's
            summed loss difference with a head ablated).
        den: ``[n_units]`` or ``[n_units, ...]`` its share of the denominator (e.g. the
            sequence's number of scored tokens).
    """

    num: Tensor
    den: Tensor

    def _den(self) -> Tensor:
        d = self.den.double()
        return d.reshape(d.shape + (1,) * (self.num.dim() - d.dim()))

    def point(self) -> Tensor:
        """The estimate on all units."""
        return (self.num.double().sum(0) / self._den().sum(0)).float()

    def interval(
        self, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
    ) -> tuple[Tensor, Tensor] | None:
        """Percentile bootstrap interval over units (None with fewer than 2 units)."""
        n = int(self.num.shape[0])
        if n < 2:
            return None
        w = bootstrap_weights(n, n_boot, seed)  # [n_boot, n_units]
        num = torch.tensordot(w, self.num.double(), dims=1)  # [n_boot, ...]
        den = torch.tensordot(w, self._den().expand_as(self.num).double(), dims=1)
        lo, hi = _quantiles(num / den, level)
        return lo.float(), hi.float()

    def __add__(self, other: UnitValues) -> UnitValues:
        return UnitValues(torch.cat([self.num, other.num]), torch.cat([self.den, other.den]))
