"""Run a classification: the work behind :meth:`ClassifySpec.run <headmech.classification.spec.ClassifySpec.run>`.

:func:`run_spec` groups the spec's types by probe, builds each probe once, streams all of
that probe's statistics in one set of forward passes, then lets each type score and label
the heads, with a bootstrap interval over probe examples on every score; with validation,
each type's claims are tested against random control sets
(:mod:`headmech.classification.validation`). Each probe's scores and each type's
validation are units of a resumable run (:mod:`headmech.runs.resume`); a stopped run
raises :class:`~headmech.core.errors.IncompleteRunError` carrying the types it finished.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from headmech.classification.results import HeadCatalog, TypeResult
from headmech.classification.validation import catalog_fdr, validate_types
from headmech.core.errors import HeadmechError, IncompleteRunError, InputError
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType, checked_score, collect_statistics
from headmech.models import ModelInfo, model_info
from headmech.probes import Probe, ProbeOptions, build_probe
from headmech.probes.corpus import CorpusError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.runs.resume import Units

__all__ = ["NOT_READ", "build_or_skip", "not_labelled", "run_spec", "runnable_types", "score_type"]

NOT_READ = "not read on ordinary text (validated with broad=False, --no-broad)"
"""A type's ``details["broad"]`` note when its heads were not read on ordinary text."""


def runnable_types(
    types: Sequence[HeadType], named: bool, info: ModelInfo
) -> tuple[list[HeadType], dict[str, str]]:
    """The ``types`` that fit the model; a type the caller ``named`` that does not fit is
    an error, one of the default "every type" that does not fit is skipped with its
    reason."""
    runnable: list[HeadType] = []
    skipped: dict[str, str] = {}
    for t in types:
        reason = t.check_model(info)
        if reason is None:
            runnable.append(t)
        elif named:
            raise HeadmechError(reason)
        else:
            skipped[t.name] = reason
    return runnable, skipped


def score_type(t: HeadType, stats: Any, n_boot: int, seed: int) -> TypeResult:
    """One type's score, labels, evidence and bootstrap interval from its statistics."""
    from headmech.stream.uncertainty import stats_interval

    score, heads = checked_score(t, stats)  # a plug-in's wrong shape: one line naming it
    result = TypeResult(
        t.name, t.reference, t.threshold, score, heads, t.details(stats, score, heads)
    )
    rejected = t.rejected(score, stats)
    result.not_labelled = not_labelled(t, score, heads, rejected)
    interval = stats_interval(stats, t.score, n_boot=n_boot, seed=seed) if n_boot else None
    if interval is not None:
        result.low, result.high = interval
        straddle = (result.low < t.threshold) & (result.high >= t.threshold)
        result.borderline = sorted(
            (
                h
                for a, b in straddle.nonzero().tolist()
                if (h := HeadIndex(int(a), int(b))) not in rejected
            ),
            key=lambda h: -float(score[h]),
        )
    return result


def not_labelled(
    t: HeadType, score: Any, heads: Sequence[HeadIndex], rejected: dict[HeadIndex, str]
) -> list[dict[str, Any]]:
    """Every head at or above ``t``'s threshold that is not labelled, best first, with
    the criterion it failed (``rejected``, :meth:`HeadType.rejected`; a type that
    overrides ``select`` itself without saying why gets its class named)."""
    chosen = set(heads)
    fallback = f"not selected by {type(t).__name__}.select() (no reason given)"
    return [
        {"head": str(h), "score": round(float(score[h]), 6), "reason": rejected.get(h, fallback)}
        for h in t.above(score)
        if h not in chosen
    ]


def build_or_skip(
    model: TransformerBridge,
    probe_name: str,
    group: Sequence[HeadType],
    options: ProbeOptions,
    named: bool,
    skipped: dict[str, str],
) -> Probe | None:
    """Build a probe; where the model's tokenizer cannot spell it (a small vocabulary with
    no single-token names for IOI prompts, no ordinal items, ...), raise if the user named
    the types, else record them in ``skipped`` with the probe's one-line reason and return
    None."""
    try:
        return build_probe(probe_name, model, options)
    except InputError as e:
        if named or isinstance(e, CorpusError):  # the user's corpus is at fault, not the vocabulary
            raise
        for t in group:
            skipped[t.name] = f"probe '{probe_name}' cannot be built: {e}"
        return None


def _stream(model: TransformerBridge, probe: Probe, group: list[HeadType], progress: bool) -> Any:
    """One built probe's statistics for its types, in one set of passes."""
    desc = f"{probe.name} ({', '.join(t.name for t in group)})" if progress else False
    return collect_statistics(group, model, probe.batches, progress=desc)


def _scored(
    model: TransformerBridge,
    probe: Probe,
    group: list[HeadType],
    options: ProbeOptions,
    progress: bool,
    n_boot: int,
    build_seconds: float,
) -> tuple[dict[str, TypeResult], dict[str, Any]]:
    """One built probe's types streamed (:func:`_stream`), scored and labelled, as one unit
    of a resumable run (:mod:`headmech.runs.resume`): the types' results stored field by
    field, exactly, with the probe's sizes and timings."""
    from dataclasses import fields

    from headmech.runs.resume import unit

    def compute() -> dict[str, Any]:
        t1 = time.perf_counter()
        stats = _stream(model, probe, group, progress)
        meta = {
            "n_sequences": probe.n_sequences,
            "n_tokens": probe.n_tokens,
            "build_seconds": round(build_seconds, 3),
            "stream_seconds": round(time.perf_counter() - t1, 3),
            **probe.info,
        }
        found = {t.name: score_type(t, stats, n_boot, options.seed) for t in group}
        kept = {n: {f.name: getattr(r, f.name) for f in fields(r)} for n, r in found.items()}
        return {"types": kept, "meta": meta}

    done = unit(f"scores-{probe.name}", compute)
    return {n: TypeResult(**r) for n, r in done["types"].items()}, done["meta"]


def run_spec(
    spec: Any,
    model: TransformerBridge,
    *,
    units: Units | None = None,
    progress: bool = True,
) -> HeadCatalog:
    """Classify ``model`` as ``spec`` (a :class:`~headmech.classification.spec.ClassifySpec`,
    whose :meth:`run` calls this) says: each probe built
    once and streamed, each type scored, labelled and (with validation) validated; a
    stopped run raises :class:`IncompleteRunError` carrying the types it finished."""
    from headmech.core.progress import reporting
    from headmech.runs.resume import recording

    with reporting(progress), recording(units):
        return _classify(spec, model, progress)


def _classify(spec: Any, model: TransformerBridge, progress: bool) -> HeadCatalog:
    from headmech.runs.provenance import provenance, weights_hash
    from headmech.runs.resume import unit

    options, info = spec.probe, model_info(model)
    runnable, skipped = runnable_types(spec.types, spec.named, info)
    weights_hash(model)  # fail fast (a tensor it cannot read), and cached for provenance
    by_probe: dict[str, list[HeadType]] = {}
    for t in runnable:
        by_probe.setdefault(t.probe, []).append(t)
    results: dict[str, TypeResult] = {}
    meta: dict[str, Any] = {"skipped": skipped, "probes": {}}
    used: dict[str, Any] = {}
    check = spec.validation

    def catalog(done: list[HeadType]) -> HeadCatalog:
        settings = dataclasses.replace(spec, types=tuple(done)).to_json()
        del settings["probe_options"]  # the provenance's own entry
        prov = provenance(
            model, probes=used, options=options, settings={**settings, "skipped": skipped}
        )
        return HeadCatalog(info, {t.name: results[t.name] for t in done}, meta, prov)

    try:
        for name, group in by_probe.items():
            t0 = time.perf_counter()
            probe = build_or_skip(model, name, group, options, spec.named, skipped)
            if probe is None:
                continue
            found, meta["probes"][name] = _scored(
                model, probe, group, options, progress, spec.n_boot, time.perf_counter() - t0
            )
            used[name] = probe.batches
            results.update(found)
        runnable = [t for t in runnable if t.name in results]
        if check is not None and runnable:
            validate_types(model, runnable, results, options, check.test, check.alone, unit, meta)
            if check.broad:
                _beyond_the_probe(model, runnable, results, unit)
            else:
                for t in runnable:
                    results[t.name].details["broad"] = {"note": NOT_READ}
    except (Exception, KeyboardInterrupt) as e:
        # keep what is finished: the types scored (and validated, with validation)
        done = [t for t in runnable if t.name in results]
        done = [t for t in done if check is None or results[t.name].validation is not None]
        if not done:
            raise
        raise _incomplete(e, catalog, done, results, len(runnable)) from e
    return catalog(runnable)


def _incomplete(
    e: BaseException, catalog: Any, done: list[HeadType], results: dict[str, TypeResult], of: int
) -> IncompleteRunError:
    """The error of a stopped run, carrying the catalog of the types it finished (their
    verdicts decided again on Benjamini-Hochberg's q among themselves)."""
    catalog_fdr({t.name: results[t.name] for t in done})
    why = "interrupted" if isinstance(e, KeyboardInterrupt) else _first_line(e)
    finished = catalog(done)
    finished.meta["incomplete"] = why
    return IncompleteRunError(f"stopped after {len(done)} of {of} type(s) ({why})", finished)


def _beyond_the_probe(
    model: TransformerBridge, types: list[HeadType], results: dict[str, TypeResult], unit: Any
) -> None:
    """Each type's labelled (and rejected) heads read on ordinary text
    (:func:`headmech.classification.broad.broad_behaviour`), into ``per_head`` and ``details["broad"]``."""
    from headmech.classification.broad import broad_behaviour, heads_to_read, merge

    def compute() -> dict[str, Any]:
        wanted = {t.name: heads_to_read(results[t.name]) for t in types}
        return broad_behaviour(model, types, wanted)

    for name, record in unit("broad", compute).items():
        r = results[name]
        r.details["broad"] = merge(r.per_head, record, r.heads)


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]
