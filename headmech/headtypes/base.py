"""The head-type base class: what a head type declares and what it inherits.

A head type (``headmech/headtypes/``, a plug-in, a file in a ``$HEADMECH_CATALOG_PATH``
folder) subclasses :class:`HeadType`, importable as ``headmech.headtypes.registry.HeadType``. It declares

* ``name`` (snake_case, written once: it is the registry key), ``reference`` (paper, year)
  and ``citation``;
* ``probe``: the probe it is measured on (see :mod:`headmech.probes`);
* ``reducers()``: the per-head statistics the engine computes inside the hooks — most
  types only override :meth:`HeadType.targets`, "for each query, which key is the
  target?", and inherit the attention-mass reducer;
* ``score()``: statistics → ``[n_layers, n_heads]``; ``select()``: the decision rule with
  the paper's default threshold;
* ``details()``: type-specific evidence for ``catalog.json``;
* ``task``: the name of the task (:mod:`headmech.tasks`) whose metric ablating heads of
  this type should hurt (catalog validation).

What a type's positive control plants (:mod:`headmech.testing.planting`) and the lines the
command line prints of its details (:mod:`headmech.cli.evidence`) live where they are used,
keyed by the type's ``name``: the class measures and decides.

The registry, the discovery of the catalog and the checks of what a type returns are in
:mod:`headmech.headtypes.registry`; docs/contributing-head-types.md walks through a new type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.errors import ArgumentError
from headmech.core.head_index import HeadIndex
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer, target_reducer

if TYPE_CHECKING:
    from headmech.models import ModelInfo

__all__ = ["HeadType", "checked_threshold"]


def checked_threshold(t: HeadType | type[HeadType], value: Any) -> float:
    """A threshold given to a head type (an instance or a class): a finite number inside
    the values its score can take (``threshold_range``, else ``score_range``).

    Raises:
        ArgumentError: not a finite number, or outside that range (one line naming the
            type and the range).
    """
    cls = t if isinstance(t, type) else type(t)
    name = getattr(cls, "name", cls.__name__)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not math.isfinite(number):
        raise ArgumentError(
            f"the threshold of head type '{name}' must be a finite number, got {value!r}"
        )
    low, high = cls.threshold_range or cls.score_range
    if not low <= number <= high:
        raise ArgumentError(
            f"the threshold of head type '{name}' must lie in its score's range "
            f"[{low:g}, {high:g}], got {number:g}"
        )
    return number


SCORE_DECIMALS = 6
"""Decimals ``catalog.json`` keeps of a score: thresholds compare the score so rounded."""


def at_or_above(score: Tensor, threshold: float) -> Tensor:
    """``score >= threshold`` on the score as the catalog shows it (rounded to
    :data:`SCORE_DECIMALS`), so a head shown at the threshold is at the threshold: a gain
    of 0.5 - 0.4 is 0.09999999 in float32 and 0.1 in the file."""
    return torch.round(score.double(), decimals=SCORE_DECIMALS) >= threshold


def above_zero(share: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """Per head, the exact one-sided sign test of per-example values against 0 and its
    Benjamini-Hochberg q across every head: ``share`` of the ``n`` examples above 0 (both
    ``[n_layers, n_heads]``), p = P(Bin(n, 1/2) >= share x n); p = 1 with no example."""
    from scipy.stats import binom, false_discovery_control

    n = n.double()
    k = (share.nan_to_num(0.0).double() * n).round()
    p = torch.from_numpy(binom.sf(k.numpy() - 1, n.numpy(), 0.5)).view_as(k)
    p = torch.where(n > 0, p, torch.ones_like(p))
    q = torch.from_numpy(false_discovery_control(p.flatten().numpy())).view_as(p)
    return p.float(), q.float()


def unconfirmed(
    score: Tensor, threshold: float, q: Tensor, alpha: float, why: str
) -> dict[HeadIndex, str]:
    """The heads at the threshold whose q is above ``alpha``, each with the reason: ``why``
    (what is not above 0 beyond chance), then the Benjamini-Hochberg cut over every head."""
    return {
        HeadIndex(a, b): (
            f"{why}: Benjamini-Hochberg at q = {alpha:g} over {q.numel()} heads "
            f"(q {float(q[a, b]):.3f})"
        )
        for a, b in (at_or_above(score, threshold) & (q > alpha)).nonzero().tolist()
    }


def first_examples(batches: Sequence[ProbeBatch], n: int) -> list[ProbeBatch]:
    """The first ``n`` examples of the batches (whole batches, the last one cut): a bound
    on a type whose measurement costs a pass per head and example."""
    out: list[ProbeBatch] = []
    left = n
    for b in batches:
        if left <= 0:
            break
        k = min(left, int(b.input_ids.shape[0]))
        out.append(b if k == b.input_ids.shape[0] else b.head(k))
        left -= k
    return out


def best_heads(score: Tensor, k: int) -> list[HeadIndex]:
    """The ``k`` heads of highest score, best first."""
    order = score.flatten().argsort(descending=True)[:k].tolist()
    return [HeadIndex(i // score.shape[1], i % score.shape[1]) for i in order]


class HeadType:
    """Base class of a catalog head type.

    Attributes:
        name: registry key, snake_case (``previous_token``).
        reference: short citation shown in tables (``"Olsson et al. 2022"``).
        citation: full reference.
        description: one sentence: what the head does.
        probe: the probe it is measured on.
        default_threshold: the anchor's decision threshold on :meth:`score`.
        causal_only: True for types that need a decoder (generation, next-token loss).
        task: the task whose metric (higher is worse) ablating the heads should hurt,
            measured by validation (``lm``, ``induction``, ...).
        ablation: how validation removes the heads (``zero``, ``mean``, ``uniform``).
        helps_task: True: ablating the heads should raise the task's metric (they serve
            the task); False: lower it (they work against it, as negative name movers do).
        claims: the claims validation tests, by their names in the claim registry
            (:mod:`headmech.classification.claim_types`), the paper's own first: the
            *primary* claim, whose verdict the tables show (the first that can run on the
            model). Default: ``("ablation",)`` (ablate the heads, measure ``task``);
            built in besides: ``direct_path`` (path patching to the logits, with the
            backup heads), ``k_composition`` (the heads' writes patched into the
            induction heads' keys), ``sink_dose``; a contributor's own
            :class:`~headmech.classification.claim_types.Claim` registered in ``CLAIMS``.
        circuit: the types its paper treats as one mechanism with it (the IOI roles); the
            heads of those types at or above their thresholds leave its control sets too.
        claim: one line: what the validation tests and why that metric (the paper's).
        expected_effect: what validation expects of ablating the heads, when it is not
            what ``helps_task`` says: ``"little"`` (inactive heads: zeroing them changes the
            metric by at most ``effect_tolerance`` of its clean value, and less than as many
            random heads do); None: ``"raise"`` or ``"lower"`` from ``helps_task``.
        score_range: the fixed range figures draw :meth:`score` on, the same for every
            model: ``(0, 1)`` for a share of attention or a rate; a signed score (a
            difference, as a function vector's indirect effect) spans both signs and is
            drawn diverging, white at 0.
        threshold_range: the values :meth:`score` can take, where wider than
            ``score_range`` (default: ``score_range``); a threshold outside it is an error.
        threshold_note: one line: what the threshold means, where it comes from, and the
            null it beats (uniform attention, chance, a baseline).
        threshold: the threshold in use (constructor argument, else the default).
        The constructor also takes ``probe`` to measure the type on another probe.
    """

    name: ClassVar[str]
    reference: ClassVar[str] = ""
    citation: ClassVar[str] = ""
    description: ClassVar[str] = ""
    probe: str = "prose"  # class default; the constructor may override it per instance
    default_threshold: ClassVar[float] = 0.5
    causal_only: ClassVar[bool] = False
    task: ClassVar[str] = "lm"
    ablation: ClassVar[str] = "zero"
    helps_task: ClassVar[bool] = True
    expected_effect: ClassVar[str | None] = None
    effect_tolerance: ClassVar[float] = 0.01  # "little": within 1% of the clean metric
    claims: ClassVar[tuple[str, ...]] = ()
    circuit: ClassVar[tuple[str, ...]] = ()
    claim: ClassVar[str] = ""
    score_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    threshold_range: ClassVar[tuple[float, float] | None] = None
    threshold_note: ClassVar[str] = ""

    def __init__(self, threshold: float | None = None, *, probe: str | None = None) -> None:
        self.threshold = checked_threshold(
            self, self.default_threshold if threshold is None else threshold
        )
        if probe is not None:  # e.g. previous_token on repeated random tokens for a toy vocabulary
            self.probe = probe

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold})"

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """Per query, the target key position (``Int[batch, query_pos]``, -1 = none) or
        set of positions (``Bool[batch, query_pos, key_pos]``)."""
        raise NotImplementedError(f"{type(self).__name__} must define targets() or reducers()")

    def reducers(self) -> list[Reducer]:
        """Statistics to stream; by default attention mass on :meth:`targets`."""
        return [target_reducer(self.name, self.targets)]

    def weight_statistics(self, model: Any) -> dict[str, Tensor]:
        """Per-head statistics from the weights rather than data (``[n_layers, n_heads]``
        each); stored in the stats as ``name.key``. Default: none."""
        return {}

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        """Per-head statistics the type measures by running the model itself on its
        probe's batches — interventions such as patching, which no attention hook can
        stream (``[n_layers, n_heads]`` each, stored as ``name.key``). Default: none."""
        return {}

    def candidate_statistics(
        self, model: Any, batches: Sequence[ProbeBatch], heads: Sequence[HeadIndex]
    ) -> dict[str, Tensor]:
        """Per-head statistics measured only for ``heads``, those whose score reaches the
        threshold (:meth:`above`), when a measurement costs a pass per head — such as each
        head's own effect, ablated alone, which :meth:`rejected` may test
        (``[n_layers, n_heads]`` each, NaN elsewhere; stored as ``name.key``). Default:
        none."""
        return {}

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        """The per-head score the threshold applies to (default: mean attention mass on target)."""
        return stats.mean(f"{self.name}.mass")

    def above(self, score: Float[Tensor, "n_layers n_heads"]) -> list[HeadIndex]:
        """Heads whose score reaches the threshold, best first: the first criterion alone.
        The score is compared as ``catalog.json`` shows it (:func:`at_or_above`)."""
        s = torch.nan_to_num(score, nan=float("-inf"))
        hits = at_or_above(s, self.threshold).nonzero().tolist()
        hits.sort(key=lambda lh: -float(s[lh[0], lh[1]]))
        return [HeadIndex(int(layer), int(head)) for layer, head in hits]

    def rejected(
        self, score: Float[Tensor, "n_layers n_heads"], stats: HeadStats
    ) -> dict[HeadIndex, str]:
        """The heads (at any score) that fail the type's further criteria, each with the
        criterion it failed and its value, as a reader should see it ("copying score
        -0.23 < 0 (Olsson et al.: an induction head copies)"). A head at or above the
        threshold that is rejected here is not labelled, and is listed with this reason
        in ``catalog.json`` (``types[T]["not_labelled"]``). Default: no further criterion."""
        return {}

    def select(
        self, score: Float[Tensor, "n_layers n_heads"], stats: HeadStats | None = None
    ) -> list[HeadIndex]:
        """The labelled heads, best first: those whose score reaches the threshold
        (:meth:`above`) and, given ``stats``, that no further criterion rejects
        (:meth:`rejected`)."""
        heads = self.above(score)
        if stats is None:
            return heads
        no = self.rejected(score, stats)
        return [h for h in heads if h not in no]

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        """Type-specific evidence for ``catalog.json``."""
        return {}

    # --- beyond the probe ------------------------------------------------------------
    broad_on_first: ClassVar[bool] = False  # the pattern is the first position (sinks)

    def broad_targets(self, batch: ProbeBatch) -> Tensor | None:
        """The type's pattern on ordinary text (:mod:`headmech.classification.broad`), in the format of
        :meth:`targets`: which keys a head of this type attends to in any sentence, not
        only in its probe. None: the type has no pattern outside its probe (a name
        mover's IO name, a function vector's task). Its share of a labelled head's
        attention on several domains of prose says how much of the head's ordinary
        behaviour the type explains (HeadVis, Anthropic 2026). ``broad_on_first``: the
        pattern is the first position, which the share otherwise leaves out (a sink's
        no-op attention is not behaviour another type's pattern should have to explain)."""
        return None

    # --- behaviour ----------------------------------------------------------------
    def expected(self) -> str:
        """What ablating the heads should do to the task's metric: ``raise``, ``lower``
        or ``little``."""
        return self.expected_effect or ("raise" if self.helps_task else "lower")

    def claim_kinds(self) -> tuple[str, ...]:
        """The names of the claims validation tests, the primary first (``claims``, else
        the ablation alone)."""
        return tuple(self.claims) or ("ablation",)

    def own_effects(self, details: dict[str, Any]) -> dict[HeadIndex, tuple[float, list[float]]]:
        """Each head's own effect, ablated alone, with its 95% interval, where the type's
        own evidence holds it (``details``; induction measures it for every head above
        the threshold): the backups test reads it for the heads validation did not
        ablate alone. Default: none."""
        return {}

    def check_model(self, info: ModelInfo) -> str | None:
        """Why this type cannot run on the model, or None."""
        if self.causal_only and not info.causal:
            return f"head type '{self.name}' needs a causal (decoder) model"
        return None


class SignTestedHead(HeadType):
    """A type whose per-example values are tested against 0 head by head: labelled at the
    threshold when the exact sign test (:func:`above_zero`) survives Benjamini-Hochberg
    across every head at ``alpha`` (qrhead, locos, subject, relation). Not a type itself
    (no ``name``)."""

    def __init__(
        self, threshold: float | None = None, alpha: float = 0.05, *, probe: str | None = None
    ) -> None:
        super().__init__(threshold, probe=probe)
        self.alpha = float(alpha)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold}, alpha={self.alpha})"

    def top_values(self, stats: HeadStats, key: str, top: list[HeadIndex]) -> dict[str, float]:
        """The statistic ``key`` of the heads ``top``, rounded, for ``details``."""
        values = stats.mean(f"{self.name}.{key}")
        return {str(h): round(float(values[h]), 4) for h in top}

    def top_tests(self, stats: HeadStats, top: list[HeadIndex]) -> dict[str, dict[str, float]]:
        """``{"p": ..., "q": ...}`` of the heads ``top``'s sign tests (:meth:`significance`)."""
        p, q = self.significance(stats)  # type: ignore[attr-defined]
        return {
            "p": {str(h): float(f"{float(p[h]):.3g}") for h in top},
            "q": {str(h): float(f"{float(q[h]):.3g}") for h in top},
        }
