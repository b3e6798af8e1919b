"""Classify every head of a model into catalog head types.

:func:`classify` groups the requested types by probe, builds each probe once, streams
all of that probe's statistics in one set of forward passes, then lets each type score
and label the heads, with a bootstrap interval over probe examples on every score. The
result, :class:`~headmech.classification.results.HeadCatalog`, round-trips through ``catalog.json``
(schema in docs/architecture.md). :func:`validate_heads` checks labels causally: the
labelled heads are ablated, and so are random control sets drawn from the same layers
(:mod:`headmech.classification.validation`, re-exported here).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from headmech.classification.results import HeadCatalog, TypeResult
from headmech.classification.validation import catalog_fdr, validate_heads, validate_types
from headmech.core.errors import ArgumentError, HeadmechError, IncompleteRunError, InputError
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType, checked_score, collect_statistics, resolve_types
from headmech.models import ModelInfo, model_info
from headmech.probes import Probe, ProbeOptions, build_probe
from headmech.probes.corpus import CorpusError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.montecarlo import TestOptions
    from headmech.runs.resume import Units

__all__ = ["HeadCatalog", "TypeResult", "classify", "validate_heads"]


def runnable_types(
    types: Sequence[str | HeadType | type[HeadType]] | str | None,
    info: ModelInfo,
    thresholds: Mapping[str, float] | None = None,
) -> tuple[list[HeadType], dict[str, str]]:
    """The requested types (with ``thresholds``) that fit the model; a type the user named
    that does not fit is an error, a default type that does not fit is skipped with its
    reason."""
    runnable: list[HeadType] = []
    skipped: dict[str, str] = {}
    resolved = resolve_types(types, thresholds)
    names = [t.name for t in resolved]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise HeadmechError(f"head type {', '.join(twice)} given more than once")
    for t in resolved:
        reason = t.check_model(info)
        if reason is None:
            runnable.append(t)
        elif types is not None:
            raise HeadmechError(reason)
        else:
            skipped[t.name] = reason
    return runnable, skipped


def _check_arguments(
    types: Any, validate: bool, n_random: Any, n_boot: Any, alone: Any, options: dict,
    control_tokens: Any = 0,
) -> None:  # fmt: skip
    """:func:`classify`'s own arguments, as the command line checks its flags: no
    ``threshold=`` (one per type: ``thresholds=``), ``n_random`` a positive integer (at most
    :data:`headmech.core.checks.MAX_N_RANDOM`) when validating, ``n_boot`` and
    ``control_tokens`` integers of at least 0, ``alone`` two integers of at least 0."""
    from headmech.core.checks import MAX_N_RANDOM

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if "threshold" in options:
        one = types[0] if isinstance(types, (list, tuple)) and len(types) == 1 else None
        name = one if isinstance(one, str) else "<head type>"
        raise ArgumentError(
            "classify() takes no threshold=: give one per head type, "
            f"thresholds={{{name!r}: {options['threshold']!r}}}"
        )
    if alone is not None and not (len(alone) == 2 and all(integer(n) and n >= 0 for n in alone)):
        raise ArgumentError(
            f"alone must be two integers of at least 0 (labelled, rejected), got {alone!r}"
        )

    if not integer(n_boot) or n_boot < 0:
        raise ArgumentError(
            f"n_boot must be an integer of at least 0 (0: no interval), got {n_boot!r}"
        )
    if not integer(control_tokens) or control_tokens < 0:
        raise ArgumentError(
            f"control_tokens must be an integer of at least 0 (0: every batch), got {control_tokens!r}"
        )
    if validate and (not integer(n_random) or n_random < 1):
        raise ArgumentError(
            f"n_random must be a positive integer with validate=True, got {n_random!r}"
        )
    if validate and n_random > MAX_N_RANDOM:
        raise ArgumentError(
            f"n_random must be at most {MAX_N_RANDOM} (each control set is one more ablated "
            f"run of the task), got {n_random}"
        )


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


def _classify_probe(
    model: TransformerBridge,
    probe: Probe,
    group: list[HeadType],
    options: ProbeOptions,
    progress: bool,
    n_boot: int,
    build_seconds: float,
) -> tuple[dict[str, TypeResult], dict[str, Any], list[Any]]:
    """Stream one built probe's types' statistics in one set of passes, score and label.
    Returns the results, timings and the batches (for provenance)."""
    probe_name = probe.name
    t1 = time.perf_counter()
    desc = f"{probe_name} ({', '.join(t.name for t in group)})" if progress else False
    stats = collect_statistics(group, model, probe.batches, progress=desc)
    meta = {
        "n_sequences": probe.n_sequences,
        "n_tokens": probe.n_tokens,
        "build_seconds": round(build_seconds, 3),
        "stream_seconds": round(time.perf_counter() - t1, 3),
        **probe.info,
    }
    return {t.name: score_type(t, stats, n_boot, options.seed) for t in group}, meta, probe.batches


def _scored(
    model: TransformerBridge,
    probe: Probe,
    group: list[HeadType],
    options: ProbeOptions,
    progress: bool,
    n_boot: int,
    build_seconds: float,
) -> tuple[dict[str, TypeResult], dict[str, Any]]:
    """:func:`_classify_probe` as one unit of a resumable run (:mod:`headmech.runs.resume`):
    the types' results stored field by field, exactly."""
    from dataclasses import fields

    from headmech.runs.resume import unit

    def compute() -> dict[str, Any]:
        found, meta, _ = _classify_probe(
            model, probe, group, options, progress, n_boot, build_seconds
        )
        kept = {n: {f.name: getattr(r, f.name) for f in fields(r)} for n, r in found.items()}
        return {"types": kept, "meta": meta}

    done = unit(f"scores-{probe.name}", compute)
    return {n: TypeResult(**r) for n, r in done["types"].items()}, done["meta"]


def classify(
    model: TransformerBridge,
    types: Sequence[str | HeadType | type[HeadType]] | str | None = None,
    *,
    validate: bool = False,
    n_random: int = 99,
    control_tokens: int = 0,
    n_boot: int = 200,
    thresholds: Mapping[str, float] | None = None,
    progress: bool = True,
    units: Units | None = None,
    alone: tuple[int, int] | None = None,
    **probe_options: Any,
) -> HeadCatalog:
    """Score and label every head of ``model`` for each head type.

    Args:
        model: a bridge from :func:`headmech.load_model`.
        types: names, classes or instances (default: every registered type that can run
            on this model; types needing a decoder are skipped on encoders, and types
            whose probe the tokenizer cannot spell, e.g. IOI prompts without single-token
            names, are skipped with the probe's reason in ``meta["skipped"]``).
        validate: also test each type's claims against random control sets
            (``TypeResult.validation``: :mod:`headmech.classification.validation`), ablate
            each labelled and rejected head alone (``per_head``) and read them on ordinary
            text (:mod:`headmech.classification.broad`).
        n_random: control sets per claim at most (99: p can reach 0.01; fewer: quick work,
            ``inconclusive`` where p cannot reach 0.05).
        control_tokens: the test measured on every k-th probe batch that still holds this
            many tokens (0: every batch; ``TestOptions.test_batches``).
        alone: at most this many labelled and rejected heads ablated alone, the highest
            scores first (default 24, 8; a pass of the task each).
        n_boot: bootstrap resamples of the probe's examples for each score's interval
            (0: no interval).
        thresholds: a threshold per head type, ``{"previous_token": 0.3}`` (the command
            line's ``--threshold previous_token=0.3``), each within the type's score range;
            recorded in the catalog's ``provenance["settings"]["thresholds"]``.
        progress: show progress bars on stderr (default; ``False``: silent).
        units: a :class:`headmech.runs.resume.Units` store: each probe's scores and each
            type's validation read from it where stored, else stored as they finish.
        **probe_options: fields of :class:`headmech.probes.ProbeOptions` (``corpus``,
            ``n_sentences``, ``n_sequences``, ``half_len``, ``batch_size``, ``seed``).

    Returns:
        A :class:`HeadCatalog`.

    Examples:
        >>> headmech.classify(model, ["previous_token"], n_sentences=32)  # doctest: +SKIP
    """
    from headmech.classification.montecarlo import TestOptions
    from headmech.core.progress import reporting
    from headmech.runs.resume import recording

    _check_arguments(types, validate, n_random, n_boot, alone, probe_options, control_tokens)
    resolve_types(types, thresholds)  # names, classes, thresholds: checked before the model
    test = TestOptions(n_max=n_random, control_tokens=control_tokens)
    with reporting(progress), recording(units):
        return _classify(
            model, types, validate, test, n_boot, progress, probe_options, alone, thresholds
        )


def _classify(
    model: TransformerBridge,
    types: Sequence[str | HeadType | type[HeadType]] | str | None,
    validate: bool,
    test: TestOptions,
    n_boot: int,
    progress: bool,
    probe_options: dict[str, Any],
    alone: tuple[int, int] | None = None,
    thresholds: Mapping[str, float] | None = None,
) -> HeadCatalog:
    from headmech.runs.provenance import provenance, weights_hash
    from headmech.runs.resume import unit

    try:
        options = ProbeOptions(**probe_options)
    except TypeError as e:
        raise HeadmechError(f"unknown probe option: {e}") from None
    info = model_info(model)
    runnable, skipped = runnable_types(types, info, thresholds)
    weights_hash(model)  # fail fast (a tensor it cannot read), and cached for provenance
    by_probe: dict[str, list[HeadType]] = {}
    for t in runnable:
        by_probe.setdefault(t.probe, []).append(t)
    results: dict[str, TypeResult] = {}
    meta: dict[str, Any] = {"skipped": skipped, "probes": {}}
    used: dict[str, Any] = {}

    def catalog(done: list[HeadType]) -> HeadCatalog:
        settings = _settings(done, skipped, validate, test, n_boot, alone, thresholds)
        prov = provenance(model, probes=used, options=options, settings=settings)
        return HeadCatalog(info, {t.name: results[t.name] for t in done}, meta, prov)

    try:
        for name, group in by_probe.items():
            t0 = time.perf_counter()
            probe = build_or_skip(model, name, group, options, types is not None, skipped)
            if probe is None:
                continue
            found, meta["probes"][name] = _scored(
                model, probe, group, options, progress, n_boot, time.perf_counter() - t0
            )
            used[name] = probe.batches
            results.update(found)
        runnable = [t for t in runnable if t.name in results]
        if validate and runnable:
            validate_types(model, runnable, results, options, test, alone, unit, meta)
            _beyond_the_probe(model, runnable, results, unit)
    except (Exception, KeyboardInterrupt) as e:
        # keep what is finished: the types scored (and validated, with validation)
        done = [t for t in runnable if t.name in results]
        done = [t for t in done if not validate or results[t.name].validation is not None]
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


def _settings(
    done: list[HeadType],
    skipped: dict[str, str],
    validate: bool,
    test: TestOptions,
    n_boot: int,
    alone: tuple[int, int] | None,
    thresholds: Mapping[str, float] | None,
) -> dict[str, Any]:
    """The provenance's settings: the types as configured, those skipped, the validation's
    sizes; ``alone``, ``thresholds`` and ``control_tokens`` only where given (a default
    leaves no trace)."""
    settings: dict[str, Any] = {"types": {t.name: repr(t) for t in done}, "skipped": skipped}
    settings.update(validate=validate, n_random=test.n_max, n_boot=n_boot)
    if test.control_tokens:
        settings["control_tokens"] = test.control_tokens
    if alone is not None:
        settings["alone"] = list(alone)
    if thresholds is not None:
        settings["thresholds"] = {n: float(v) for n, v in thresholds.items()}
    return settings


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
