"""Causal validation of head labels: do the labelled heads do what their type claims?

:func:`type_validation` tests each of a type's claims (``HeadType.claims``, the paper's
own first: :mod:`headmech.classification.claim_types`) with the labelled heads against up to
``n_max`` random control sets of as many heads not of the type nor of its circuit, drawn
as the labelled heads lie (:mod:`headmech.classification.control_sets`), in a sequential
Monte Carlo test (:mod:`headmech.classification.montecarlo`); it measures each labelled
head, and each head rejected above the threshold, alone (``per_head``); and it tests the
rejected heads whose own effect is within noise for sufficiency (backups:
:mod:`headmech.classification.backups`). :func:`apply_fdr` then corrects the p-values of every
claim of a catalog (Benjamini-Hochberg) and decides the verdicts. :func:`validate_heads`
is the ablation claim alone, for any head set. Not to be confused with
:mod:`headmech.core.checks`, the checks of user input.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from headmech.classification.claim_types import (
    Ablation,
    Claim,
    ClaimRecord,
    ValidationContext,
)
from headmech.classification.control_sets import controls_for
from headmech.classification.montecarlo import TestOptions, benjamini_hochberg
from headmech.classification.records import (
    BackupTest,
    HeadEffect,
    Redundancy,
    TypeValidation,
)
from headmech.classification.results import TypeResult
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.models import model_info
from headmech.probes import ProbeOptions

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "apply_fdr",
    "catalog_fdr",
    "controls_excluded",
    "type_validation",
    "validate_heads",
    "validate_types",
]


MAX_PER_HEAD = 24  # labelled heads ablated one at a time (the highest scores first)
MAX_REJECTED = 8  # heads at or above the threshold but not labelled, ablated one at a time


def _context(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    test: TestOptions,
    excluded: Mapping[HeadIndex, str] | Collection[HeadIndex],
    **more: Any,
) -> ValidationContext:
    """The context every claim of a type is tested in: its control sets drawn once (the
    repeated halves of the induction task fitted to the model's context)."""
    fit = (int(model.cfg.n_ctx) - 2) // 2  # a BOS before, a separator after
    options = dataclasses.replace(options, half_len=max(2, min(options.half_len, fit)))
    controls = controls_for(model_info(model), list(heads), test.n_max, options.seed, excluded)
    return ValidationContext(model, head_type, list(heads), options, test, controls, **more)


def validate_heads(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    *,
    n_random: int = 99,
    mode: str | None = None,
    task: str | None = None,
    excluded: Collection[HeadIndex] = (),
    one_by_one: Sequence[HeadIndex] | None = None,
    test: TestOptions | None = None,
) -> TypeValidation:
    """The ablation claim for any head set: ablate ``heads``, and up to ``n_random``
    control sets of as many heads not of the type (neither labelled nor in ``excluded``)
    from the same layers (per-layer counts matched), and measure the type's task metric
    (higher is worse; ``task``, ``mode``: another task or ablation than the type's), in the
    sequential Monte Carlo test; each head of ``one_by_one`` (default: the labelled heads,
    at most :data:`MAX_PER_HEAD`) is also ablated alone (``per_head``, ``redundancy``).

    Returns:
        A :class:`~headmech.classification.records.TypeValidation` of the one claim:
        ``primary`` (``effect`` is ablated minus clean; ``test``: n, exceedances, p;
        ``verdict`` on p alone), the controls' accounting, ``per_head``, ``redundancy``.
    """
    from headmech.core.head_index import check_heads

    heads = check_heads(heads, None, None, "heads")  # pairs or "L18H6"
    excluded = check_heads(excluded, None, None, "excluded")
    if one_by_one is not None:
        one_by_one = check_heads(one_by_one, None, None, "one_by_one")
    test = test or TestOptions(n_max=n_random)
    ctx = _context(model, head_type, heads, options, test, excluded)
    ctx.alone = _one_by_one(heads, one_by_one)
    record, own = Ablation(task, mode).validate(ctx)
    record.decide(test.alpha)
    out = _record(ctx, [record])
    out.per_head, out.per_head_note, out.redundancy = _per_head(heads, own, record.effect)
    return out


def claims_of(head_type: HeadType) -> list[Claim]:
    """The type's claims as objects (``HeadType.claim_kinds``, from the claim registry)."""
    from headmech.core.registry import CLAIMS

    return [CLAIMS.get(kind)() for kind in head_type.claim_kinds()]


def type_validation(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    n_random: int,
    labelled: dict[str, list[HeadIndex]] | None = None,
    excluded: Mapping[HeadIndex, str] | Collection[HeadIndex] = (),
    rejected: Sequence[HeadIndex] = (),
    *,
    alone: tuple[int, int] | None = None,
    test: TestOptions | None = None,
    score: torch.Tensor | None = None,
    own: Mapping[HeadIndex, tuple[float, list[float] | None]] | None = None,
) -> TypeValidation:
    """Every claim of the type (:func:`claims_of`), the first that can run on the model
    its *primary* claim (the paper's own, where it can), each tested against the same
    control sets (``test``: the test's options; default ``n_max = n_random``); the
    labelled heads (at most :data:`MAX_PER_HEAD`) and the heads ``rejected`` above the
    threshold by a further criterion (at most :data:`MAX_REJECTED`; other caps: ``alone``)
    each measured alone; and the rejected heads whose own effect is within noise
    (``own``, else measured alone) tested for sufficiency (``backups``).

    Controls are drawn from heads neither of the type nor of its circuit (``excluded``:
    a head, or a head → why: :meth:`headmech.classification.results.TypeResult.not_controls`
    and the circuit's types' heads). The verdicts are decided on p alone; a catalog's
    :func:`apply_fdr` decides them again on Benjamini-Hochberg's q."""
    test = test or TestOptions(n_max=max(1, n_random))
    n_labelled, n_rejected = alone or (MAX_PER_HEAD, MAX_REJECTED)
    extra = [h for h in rejected if h not in heads][:n_rejected]
    ctx = _context(
        model, head_type, heads, options, test, excluded, labelled=dict(labelled or {}),
        score=score,
    )  # fmt: skip
    pending = [*heads[:n_labelled], *extra]
    records: list[ClaimRecord] = []
    measured: list[tuple[HeadIndex, float, Any]] = []
    set_effect = None  # the set's effect under the claim that measured the heads alone
    for claim in claims_of(head_type):
        ctx.alone = pending if claim.measures_alone and not measured else []
        record, own_effects = claim.validate(ctx)
        if own_effects and not measured:
            measured, set_effect = own_effects, record.effect
        record.decide(test.alpha)
        records.append(record)
    out = _record(ctx, records)
    out.per_head, out.per_head_note, out.redundancy = _per_head(heads, measured, set_effect)
    out.backups = _backups(ctx, records, [h for h in rejected if h not in heads], measured, own)
    return out


def _record(ctx: ValidationContext, records: list[ClaimRecord]) -> TypeValidation:
    """The type's validation record: its primary claim (the first that ran) with the
    controls' accounting, the claims that could not run before it (with why), the others
    as ``secondary``."""
    primary = next((r for r in records if r.effect is not None), records[0])
    controls = ctx.controls.record()
    if primary.effect is None and primary.note:  # the claim cannot run here: why
        controls.note = primary.note
    return TypeValidation(
        primary,
        controls,
        claims=[r.kind for r in records],
        unavailable={r.kind: r.note for r in records[: records.index(primary)]},
        secondary={r.kind: r for r in records if r is not primary},
    )


def validate_types(
    model: TransformerBridge,
    types: list[HeadType],
    results: dict[str, TypeResult],
    options: ProbeOptions,
    test: TestOptions,
    alone: tuple[int, int] | None,
    unit: Any,
    meta: dict[str, Any],
) -> None:
    """Each type's validation (:func:`type_validation`), one resumable unit per type, into
    ``TypeResult.validation`` (:meth:`TypeResult.set_validation`: also ``per_head`` and ``backups``), its seconds into
    ``meta["validation_seconds"]`` and the process's peak resident memory after it (MB,
    the peak so far: ``meta["validation_peak_mb"]``); then Benjamini-Hochberg across every
    claim (:func:`catalog_fdr`)."""
    from headmech.core.progress import peak_memory_mb

    labelled = {n: r.heads for n, r in results.items()}  # induction heads: K-composition
    seconds = meta.setdefault("validation_seconds", {})
    peaks = meta.setdefault("validation_peak_mb", {})
    for t in types:
        r = results[t.name]
        rejected = [HeadIndex.parse(e["head"]) for e in r.not_labelled]
        run = partial(
            type_validation, model, t, r.heads, options, test.n_max, labelled,
            controls_excluded(t, results), rejected, alone=alone, test=test, score=r.score,
            own=t.own_effects(r.details),
        )  # fmt: skip
        t0 = time.perf_counter()
        v = TypeValidation.from_json(unit(f"validate-{t.name}", partial(_stored, run)))
        seconds[t.name] = round(time.perf_counter() - t0, 1)
        peaks[t.name] = round(peak_memory_mb())
        missing = [c for c in t.circuit if c not in results]
        if missing:  # their heads could not be kept out of the controls
            v.circuit_not_classified = missing
        r.set_validation(v)
    catalog_fdr(results)


def _stored(run: Callable[[], TypeValidation]) -> dict[str, Any]:
    """A type's validation as a finished unit stores it (with each head measured alone)."""
    return run().to_json(per_head=True)


def catalog_fdr(results: Mapping[str, TypeResult]) -> None:
    """Benjamini-Hochberg across the validated types' claims (:func:`apply_fdr`)."""
    apply_fdr({n: r.validation for n, r in results.items()})


def controls_excluded(t: HeadType, results: Mapping[str, TypeResult]) -> dict[HeadIndex, str]:
    """The heads no control set of ``t`` may hold, each with why: those that may be of
    the type (:meth:`TypeResult.not_controls`), then those of the types of its circuit
    (``HeadType.circuit``) classified here."""
    out = dict.fromkeys(sorted(results[t.name].not_controls()), "of the type")
    for other in t.circuit:
        if other in results:
            for h in sorted(results[other].not_controls()):
                out.setdefault(h, f"{other} (its circuit)")
    return out


def _backups(
    ctx: ValidationContext,
    records: Sequence[ClaimRecord],
    rejected: Sequence[HeadIndex],
    measured: Sequence[tuple[HeadIndex, float, Any]],
    own: Mapping[HeadIndex, tuple[float, list[float] | None]] | None,
) -> BackupTest | None:
    """The sufficiency test of the heads the type rejected for their own effect (``own``,
    the type's evidence: :meth:`HeadType.own_effects`, e.g. induction's measured copying)
    where it is within noise (measured alone here, else as the type measured it), tested
    for sufficiency under the ablation claim where the type has one that expects a raise;
    else None. A head rejected for another reason (a syntactic head no better than the
    positional baseline) is not a candidate backup."""
    from headmech.classification.backups import backup_candidates, sufficiency

    ablation = next((r for r in records if r.kind == "ablation" and r.effect is not None), None)
    alone = {h: (e, iv) for h, e, iv in measured}
    known = {h: alone.get(h, v) for h, v in (own or {}).items()}
    tested = backup_candidates(known, rejected)
    if ablation is None or ablation.expected != "raise" or not tested or not ctx.heads:
        return None
    claim = next(c for c in claims_of(ctx.head_type) if isinstance(c, Ablation))
    return sufficiency(ctx, claim, rejected, tested, known)


def apply_fdr(validations: Mapping[str, TypeValidation | None], alpha: float = 0.05) -> int:
    """Benjamini-Hochberg across every claim of a catalog with a Monte Carlo test (each
    type's primary and secondary claims): each test's ``q`` and ``family`` set, each
    claim's verdict decided again on q (:meth:`ClaimRecord.decide`), in place. Returns the
    family's size."""
    found = [r for v in validations.values() if v is not None for r in v.tested()]
    qs = benjamini_hochberg([r.test.p for r in found if r.test is not None])
    for r, q in zip(found, qs, strict=True):
        assert r.test is not None
        r.test.q, r.test.family = q, len(found)
        r.decide(alpha)
    return len(found)


def _one_by_one(
    heads: Sequence[HeadIndex], one_by_one: Sequence[HeadIndex] | None
) -> list[HeadIndex]:
    """The heads ablated alone: ``one_by_one`` as given, else the labelled heads (at most
    :data:`MAX_PER_HEAD`, the first, i.e. highest-scoring, ones)."""
    return list(dict.fromkeys(one_by_one if one_by_one is not None else heads[:MAX_PER_HEAD]))


def _per_head(
    heads: Sequence[HeadIndex],
    own: list[tuple[HeadIndex, float, list[float] | None]],
    set_effect: float | None,
) -> tuple[dict[str, HeadEffect], str | None, Redundancy | None]:
    """``(per_head, per_head_note, redundancy)``: each head's own effect, ablated alone,
    with its interval; why not every labelled head was measured; and the labelled set's
    effect against the sum of its heads' own effects, where every labelled head was
    measured (ratio > 1: removed together they cost more than one by one, so they back
    each other up, one compensating for another; < 1: their effects overlap; None where
    the set and the sum differ in sign)."""
    labelled = set(heads)
    per = {str(h): HeadEffect(e, iv, h in labelled) for h, e, iv in own}
    measured = {h for h, _, _ in own} & labelled
    if not own:
        return per, None, None
    if len(measured) < len(labelled):
        note = (
            f"{len(measured)} of {len(labelled)} labelled heads ablated alone (the highest scores)"
        )
        return per, note, None
    if set_effect is None:
        return per, None, None
    total = sum(e for h, e, _ in own if h in labelled)
    same_sign = total != 0 and (total > 0) == (set_effect > 0)
    ratio = set_effect / total if same_sign else None  # opposite signs: no ratio
    return per, None, Redundancy(set_effect, total, ratio)
