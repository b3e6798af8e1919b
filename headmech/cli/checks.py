"""What ``classify``, ``circuit`` and ``discover`` are given, checked before a model
loads: the head types (and whether the model's tokenizer reads their prose), the
thresholds per type, ``--alone``, ``--n-random`` and the corpus, returned as a
:class:`ClassifyInput` (the parsed arguments are left as they were typed)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from headmech.cli.base import check_run, corpus_file, head_type_names, probe_options
from headmech.core import checks as V
from headmech.core.errors import HeadmechError, InputError

__all__ = ["ClassifyInput", "check_classify", "fit_types"]


@dataclasses.dataclass(frozen=True)
class ClassifyInput:
    """What ``classify``, ``circuit`` and ``discover`` were given, checked before a load:
    the type names (None: every type), the ``--corpus`` sentences, ``--threshold`` per type
    and ``--alone`` (None where not given)."""

    names: list[str] | None
    sentences: list[str] | None
    thresholds: dict[str, float] | None = None
    alone: tuple[int, int] | None = None


def fit_types(
    tokenizer: Any, names: list[str] | None, sentences: list[str] | None, causal: bool | None
) -> tuple[list[Any] | None, dict[str, str]]:
    """The head types to run and those skipped with a reason: types measured on English
    prose are refused (named by ``--types``) or skipped (the default: all types) when the
    tokenizer cannot read the prose, e.g. the toy model's ``t0``..``t255`` vocabulary."""
    from headmech.headtypes.registry import resolve_types

    types = resolve_types(names)
    prose = [t.name for t in types if t.probe in V.WORD_PROBES]
    problem = V.prose_problem(tokenizer, sentences) if prose else None
    if problem is None:
        return names, {}
    others = [t for t in resolve_types(None) if t.probe not in V.WORD_PROBES]
    if names is not None:
        raise InputError(
            f"head type(s) {', '.join(prose)} are measured on English prose, but {problem}; "
            f"try --types {','.join(t.name for t in others)}"
        )
    kept = [t for t in others if not (t.causal_only and causal is False)]
    if not kept:
        raise InputError(f"no head type fits: {problem}")
    return kept, {name: f"measured on prose, but {problem}" for name in prose}


def _alone(text: str) -> tuple[int, int]:
    """``--alone L,R``: two integers of at least 0."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise InputError(
            f"--alone takes two counts, labelled and rejected heads ablated alone, as L,R "
            f"(e.g. 24,8), got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def _thresholds(values: list[str], names: list[str] | None) -> dict[str, float]:
    """``--threshold TYPE=VALUE`` (repeatable, or comma-separated): a registered type
    (among ``--types`` where given), once, with a number in its score's range."""
    from headmech.core.registry import HEAD_TYPES
    from headmech.headtypes.base import checked_threshold

    out: dict[str, float] = {}
    for pair in (p.strip() for v in values for p in v.split(",")):
        name, sep, raw = pair.partition("=")
        name = name.strip()
        if not sep or not name or not raw.strip():
            raise InputError(f"--threshold takes TYPE=VALUE, e.g. previous_token=0.3, got {pair!r}")
        try:
            cls = V.lookup(HEAD_TYPES, name).obj  # unknown: one line, a close name suggested
        except HeadmechError as e:
            raise type(e)(f"--threshold {pair}: {e}") from None
        if name in out:
            raise InputError(f"--threshold gives {name} more than once")
        if names is not None and name not in names:
            raise InputError(
                f"--threshold {pair}: {name} is not among --types ({', '.join(names)})"
            )
        try:
            value = float(raw)
        except ValueError:
            raise InputError(f"--threshold {pair}: {raw.strip()!r} is not a number") from None
        try:
            out[name] = checked_threshold(cls, value)
        except InputError as e:
            raise InputError(f"--threshold {pair}: {e}") from None
    return out


def check_classify(args: argparse.Namespace, command: str) -> ClassifyInput:
    """``headmech classify`` (and ``circuit``, ``discover``) input checks before loading:
    the run options, ``--types``, ``--n-random``, ``--threshold``, ``--alone``, ``--corpus``."""
    check_run(args, command)
    names = head_type_names(args.types) if args.types is not None else None
    if getattr(args, "n_random", None) is not None:
        V.count(args.n_random, "--n-random")
        if args.n_random > V.MAX_N_RANDOM:
            raise InputError(
                f"--n-random must be at most {V.MAX_N_RANDOM} (each control set is one more "
                f"ablated run of the task), got {args.n_random}"
            )
        if not args.validate:
            V.warn("--n-random is ignored without --validate")
    if getattr(args, "control_tokens", None) is not None:
        V.count(args.control_tokens, "--control-tokens", minimum=0)
    thresholds = alone = None
    if getattr(args, "threshold", None) is not None:
        thresholds = _thresholds(args.threshold, names)
    if getattr(args, "alone", None) is not None:
        alone = _alone(args.alone)
        if not args.validate:
            V.warn("--alone is ignored without --validate")
    corpus = getattr(args, "corpus", None)
    sentences = corpus_file(corpus) if corpus is not None else None
    if hasattr(args, "n_sentences"):
        V.probe_options(probe_options(args))
    source = _model_source(args.model)
    if source is not None and source.tokenizer is not None:  # e.g. a toy not trained yet
        fit_types(source.tokenizer(), names, sentences, None)
    return ClassifyInput(names, sentences, thresholds, alone)


def _model_source(name: str) -> Any:
    """The registered :class:`headmech.models.ModelSource` of ``name``, or None."""
    from headmech.core.registry import MODELS

    return MODELS.get(name) if name in MODELS else None
