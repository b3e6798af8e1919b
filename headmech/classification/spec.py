"""What one ``classify`` run is asked to do, checked once, before a model loads.

:class:`ClassifySpec` is the run's settings as one frozen, model-free object: the head
types resolved with their thresholds, the probe options, the validation's options (or
None) and the bootstrap's size. :meth:`ClassifySpec.create` is the only checker, in
Python and on the command line alike: it reads the keywords (or the parsed flags,
:meth:`ClassifySpec.from_args`) against one declarative table, :data:`PARAMETERS`
(:mod:`headmech.core.constraints`), and an error names the flag or the keyword the value
came from. :meth:`ClassifySpec.to_json` is what the catalog's provenance records and
what a resumable run's manifest compares; :meth:`ClassifySpec.run` classifies a model.
``headmech.classify(model, ...)`` is ``ClassifySpec.create(...).run(model)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from headmech.core import checks as V
from headmech.core.constraints import Boolean, Custom, Integer, Origin, Param, check, label
from headmech.core.errors import ArgumentError, HeadmechError, InputError
from headmech.core.options import PROBE_FLAG_NAMES, PROBE_PARAMETERS, ProbeOptions

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.montecarlo import TestOptions
    from headmech.classification.results import HeadCatalog
    from headmech.headtypes.base import HeadType
    from headmech.runs.resume import Units

__all__ = ["PARAMETERS", "ClassifySpec", "ValidationOptions"]

N_RANDOM = 99  # control sets per claim at most: p can reach 0.01
N_BOOT = 200  # bootstrap resamples of the probe's examples per score
PROBE_FIELDS = tuple(f.name for f in dataclasses.fields(ProbeOptions))


# --- the command line's spellings ------------------------------------------------------


def _type_names(text: str, flag: str) -> list[str]:
    """``--types``: comma-separated registered names (looked up in the registry's index:
    a typo fails without importing torch), none blank."""
    from headmech.core.registry import HEAD_TYPES

    names = [t.strip() for t in text.split(",")]
    if not any(names):
        raise InputError(f"{flag} lists no head type (got {text!r}; see `headmech types`)")
    if "" in names:
        raise InputError(f"{flag} has an empty entry (a stray comma?): {text!r}")
    for name in names:
        V.lookup(HEAD_TYPES, name)
    return names


def _threshold_pairs(values: list[str], flag: str) -> dict[str, float]:
    """``--threshold TYPE=VALUE`` (repeatable, or comma-separated): a registered type, once,
    with a number (its range is checked with the types, once)."""
    from headmech.core.registry import HEAD_TYPES

    out: dict[str, float] = {}
    for pair in (p.strip() for v in values for p in v.split(",")):
        name, sep, raw = (s.strip() for s in pair.partition("="))
        if not sep or not name or not raw:
            raise InputError(f"{flag} takes TYPE=VALUE, e.g. previous_token=0.3, got {pair!r}")
        try:
            V.lookup(HEAD_TYPES, name)  # unknown: one line, a close name suggested
        except HeadmechError as e:
            raise type(e)(f"{flag} {pair}: {e}") from None
        if name in out:
            raise InputError(f"{flag} gives {name} more than once")
        try:
            out[name] = float(raw)
        except ValueError:
            raise InputError(f"{flag} {pair}: {raw!r} is not a number") from None
    return out


def _alone_text(text: str, flag: str) -> tuple[int, int]:
    """``--alone L,R``: two integers of at least 0."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise InputError(
            f"{flag} takes two counts, labelled and rejected heads ablated alone, as L,R "
            f"(e.g. 24,8), got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def _corpus_path(path: str, flag: str) -> str:
    """``--corpus``: a readable text file of enough sentences (read here, before a load)."""
    from headmech.probes.corpus import corpus_file

    corpus_file(path, flag)
    return path


def _alone(value: Any, name: str) -> tuple[int, int]:
    ok = (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)
    )
    if not ok:
        raise ArgumentError(
            f"{name} must be two integers of at least 0 (labelled, rejected), got {value!r}"
        )
    return int(value[0]), int(value[1])


#: classify's parameters: keyword -> rule, flag and the flag's parser (one table, one checker)
PARAMETERS: dict[str, Param] = {
    "types": Param(None, "--types", _type_names),
    "thresholds": Param(None, "--threshold", _threshold_pairs),
    "validate": Param(Boolean(), "--validate", default=False),
    "n_random": Param(
        Integer(1, V.MAX_N_RANDOM, "each control set is one more ablated run of the task"),
        "--n-random",
    ),
    "control_tokens": Param(Integer(0), "--control-tokens"),
    "alone": Param(Custom(_alone), "--alone", _alone_text),
    "broad": Param(Boolean(), "--no-broad", default=True),
    "n_boot": Param(Integer(0), None, default=N_BOOT),
    "corpus": Param(None, "--corpus", _corpus_path),
    **PROBE_PARAMETERS,
}
_CLI_NAMES = {**PROBE_FLAG_NAMES, "thresholds": "threshold"}


@dataclasses.dataclass(frozen=True)
class ValidationOptions:
    """How labels are validated (:mod:`headmech.classification.validation`).

    Attributes:
        n_random: control sets per claim at most.
        control_tokens: the test measured on every k-th probe batch that still holds this
            many tokens (0: every batch).
        alone: at most this many labelled and rejected heads ablated alone (None: 24, 8).
        broad: read the labelled and rejected heads on ordinary text
            (:mod:`headmech.classification.broad`); False: skipped, and said.
    """

    n_random: int = N_RANDOM
    control_tokens: int = 0
    alone: tuple[int, int] | None = None
    broad: bool = True

    @property
    def test(self) -> TestOptions:
        """The Monte Carlo test's options."""
        from headmech.classification.montecarlo import TestOptions

        return TestOptions(n_max=self.n_random, control_tokens=self.control_tokens)


@dataclasses.dataclass(frozen=True)
class ClassifySpec:
    """One classify run's settings, checked (:meth:`create`), model-free.

    Attributes:
        types: the head types, resolved, with their thresholds applied.
        named: whether the caller named them (a named type that does not fit the model is
            an error; one of the default "every type" is skipped with its reason).
        probe: the probe options.
        validation: the validation's options; None: no validation.
        n_boot: bootstrap resamples per score's interval (0: none).
        thresholds: the thresholds given per type (recorded; already applied to ``types``).
    """

    types: tuple[HeadType, ...]
    named: bool
    probe: ProbeOptions
    validation: ValidationOptions | None = None
    n_boot: int = N_BOOT
    thresholds: Mapping[str, float] | None = None

    @classmethod
    def create(
        cls, *, origin: Origin = "python", what: str = "classify()", **given: Any
    ) -> ClassifySpec:
        """The spec of ``given`` (``classify()``'s keywords, or the parsed flags with
        ``origin="cli"``), each checked once against :data:`PARAMETERS`. ``what``: the
        command an error names (``discover()`` when discovery builds its classification).

        Raises:
            HeadmechError: one line naming the flag (from the command line) or the keyword.
        """
        if origin == "python" and "threshold" in given:
            types = given.get("types")
            one = types[0] if isinstance(types, (list, tuple)) and len(types) == 1 else None
            name = one if isinstance(one, str) else "<head type>"
            raise ArgumentError(
                f"{what} takes no threshold=: give one per head type, "
                f"thresholds={{{name!r}: {given['threshold']!r}}}"
            )
        v = check(PARAMETERS, given, origin, what)
        flag = lambda key: label(PARAMETERS, key, origin)  # noqa: E731
        if origin == "cli" and not v["validate"]:  # Python's own callers pass sizes freely
            for key in ("n_random", "alone", "control_tokens"):
                if v[key] is not None:
                    V.warn(f"{flag(key)} is ignored without {flag('validate')}")
            if not v["broad"]:
                V.warn(f"{flag('broad')} is ignored without {flag('validate')}")
        types = _resolved(v["types"], v["thresholds"], origin)
        probe = ProbeOptions(**{k: v[k] for k in PROBE_FIELDS if v[k] is not None})
        validation = None
        if v["validate"]:
            validation = ValidationOptions(
                N_RANDOM if v["n_random"] is None else v["n_random"],
                v["control_tokens"] or 0,
                v["alone"],
                v["broad"],
            )
        thresholds = None if v["thresholds"] is None else dict(v["thresholds"])
        return cls(tuple(types), v["types"] is not None, probe, validation, v["n_boot"], thresholds)

    @classmethod
    def from_args(cls, args: Any) -> ClassifySpec:
        """The spec of a command's parsed arguments (``classify``, ``circuit``, ``discover``:
        the flags a command does not have keep their defaults)."""
        given: dict[str, Any] = {k: getattr(args, _CLI_NAMES.get(k, k), None) for k in PARAMETERS}
        given["validate"] = bool(getattr(args, "validate", False))
        given["broad"] = bool(getattr(args, "broad", True))
        return cls.create(origin="cli", **given)

    def fit(self, tokenizer: Any, causal: bool | None) -> tuple[ClassifySpec, dict[str, str]]:
        """This spec narrowed to the types the tokenizer can be probed with, and the
        types left out with why: types measured on English prose are refused (named) or
        skipped (the default) when the tokenizer cannot read the prose, e.g. the toy
        model's ``t0``..``t255`` vocabulary; a decoder-only type is skipped on an encoder."""
        prose = [t.name for t in self.types if t.probe in V.WORD_PROBES]
        problem = self.prose_problem(tokenizer) if prose else None
        if problem is None:
            return self, {}
        others = [t for t in self.types if t.probe not in V.WORD_PROBES]
        if self.named:
            from headmech.headtypes.registry import resolve_types

            try_ = ",".join(t.name for t in resolve_types(None) if t.probe not in V.WORD_PROBES)
            raise InputError(
                f"head type(s) {', '.join(prose)} are measured on English prose, but "
                f"{problem}; try --types {try_}"
            )
        kept = [t for t in others if not (t.causal_only and causal is False)]
        if not kept:
            raise InputError(f"no head type fits: {problem}")
        names = {t.name for t in kept}
        thresholds = {n: x for n, x in (self.thresholds or {}).items() if n in names} or None
        narrowed = dataclasses.replace(self, types=tuple(kept), thresholds=thresholds)
        return narrowed, {name: f"measured on prose, but {problem}" for name in prose}

    def prose_problem(self, tokenizer: Any) -> str | None:
        """Why ``tokenizer`` cannot read the probes' prose (the corpus's first sentences,
        or plain English), or None (:func:`headmech.core.checks.prose_problem`)."""
        if getattr(tokenizer, "unk_token_id", None) is None:
            return None  # byte-level BPE: every string has a spelling (no corpus read)
        return V.prose_problem(tokenizer, _first_sentences(self.probe.corpus))

    def to_json(self) -> dict[str, Any]:
        """The settings as the catalog's provenance records them and a resumable run's
        manifest compares them (a default of ``control_tokens``, ``alone``, ``broad`` or
        ``thresholds`` leaves no trace)."""
        from headmech.runs.provenance import options_json

        v = self.validation
        out: dict[str, Any] = {
            "types": {t.name: repr(t) for t in self.types},
            "validate": v is not None,
            "n_random": N_RANDOM if v is None else v.n_random,
            "n_boot": self.n_boot,
            "probe_options": options_json(self.probe),
        }
        if v is not None and v.control_tokens:
            out["control_tokens"] = v.control_tokens
        if v is not None and v.alone is not None:
            out["alone"] = list(v.alone)
        if v is not None and not v.broad:
            out["broad"] = False
        if self.thresholds is not None:
            out["thresholds"] = {n: float(x) for n, x in self.thresholds.items()}
        return out

    def run(
        self, model: TransformerBridge, *, units: Units | None = None, progress: bool = True
    ) -> HeadCatalog:
        """Classify ``model`` (:func:`headmech.classification.runner.run_spec`)."""
        from headmech.classification.runner import run_spec

        return run_spec(self, model, units=units, progress=progress)


def _resolved(types: Any, thresholds: Any, origin: Origin) -> list[HeadType]:
    """The types as instances with their thresholds (each checked here, once); a type
    twice is an error."""
    from headmech.headtypes.registry import resolve_types

    cli = origin == "cli"
    if cli and types is not None and thresholds is not None:
        for name, value in thresholds.items():
            if name not in types:
                raise InputError(
                    f"--threshold {name}={value:g}: {name} is not among --types "
                    f"({', '.join(types)})"
                )
    try:
        resolved = resolve_types(types, thresholds)
    except HeadmechError as e:  # a threshold outside its type's range: name the flag's pair
        given = thresholds if cli and isinstance(thresholds, Mapping) else {}
        pair = [f"{n}={x:g}" for n, x in given.items() if f"'{n}'" in str(e)]
        if not pair:
            raise
        raise type(e)(f"--threshold {pair[0]}: {e}") from None
    names = [t.name for t in resolved]
    if twice := ", ".join(sorted({n for n in names if names.count(n) > 1})):
        raise InputError(
            f"--types lists {twice} more than once"
            if cli
            else f"head type {twice} given more than once"
        )
    return resolved


def _first_sentences(corpus: Any) -> list[str] | None:
    """The corpus's first sentences for :func:`headmech.core.checks.prose_problem` (None:
    the default prose)."""
    if corpus is None:
        return None
    if isinstance(corpus, (list, tuple)):
        return [str(s) for s in corpus[:16]]
    from headmech.probes.corpus import read_corpus

    return read_corpus(corpus)[:16]
