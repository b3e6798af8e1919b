"""What the published catalogs are made of: the models, the sizes (:data:`FULL`, the
published catalogs; :data:`CHECK`, the small ``check.json`` the tests regenerate), the
types that fit each model, and the classification itself."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headmech.runs.provenance import dumps

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.results import HeadCatalog

__all__ = [
    "CHECK",
    "FULL",
    "MODELS",
    "Size",
    "applicable_types",
    "build_catalog",
    "check_json",
    "expected_types",
    "readme",
]

MODELS = (
    "smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "minilm-l6",
    "toy-induction",
)  # fmt: skip
"""The bundled models published in ``catalog/``."""


@dataclass(frozen=True)
class Size:
    """Probe sizes and validation settings of one classification (CLI flag → value)."""

    n_sentences: int = 256  # prose sentences
    n_sequences: int = 32  # repeated random sequences
    context: tuple[int, ...] = (300, 700, 1100, 1500)  # needle haystack lengths
    validate: bool = True
    n_random: int = 99  # control sets per claim, at most (the sequential test stops earlier)
    control_tokens: int = 0  # the control sets measured on batches of at least this many tokens
    n_boot: int = 200  # bootstrap resamples for score intervals (not a CLI flag)
    extra: dict[str, Any] = field(default_factory=dict)  # more ProbeOptions fields
    type_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per type: its arguments
    # validation's labelled and rejected heads ablated alone, at most (None: classify's
    # default, 24 and 8); not in the repr, which a resumed run compares: each validation
    # records how many it ablated alone (``per_head_note``)
    alone: tuple[int, int] | None = field(default=None, repr=False)

    def probe_options(self) -> dict[str, Any]:
        """Keyword arguments for :func:`headmech.classify` (the CLI's defaults beside)."""
        from headmech.probes import ProbeOptions

        options = ProbeOptions(
            n_sentences=self.n_sentences,
            n_sequences=self.n_sequences,
            needle_lengths=self.context,
            **self.extra,
        )
        return {k: getattr(options, k) for k in options.__dataclass_fields__}

    def command(self, model: str) -> str:
        """The ``headmech classify`` command whose ``catalog.json`` this size reproduces."""
        flags = f"--n-sentences {self.n_sentences} --n-sequences {self.n_sequences} "
        flags += f"--context {','.join(map(str, self.context))}"
        if self.validate:
            flags += f" --validate --n-random {self.n_random}"
            if self.control_tokens:
                flags += f" --control-tokens {self.control_tokens}"
            if self.alone is not None:
                flags += f" --alone {self.alone[0]},{self.alone[1]}"
        return f"headmech classify {model} {flags}"


FULL: dict[str, Size] = {
    # control sets measured on pieces of the probe holding at least 512 tokens (a fifth of
    # the prose, half the repeated sequences, half a needle batch): 99 of them per claim
    "smollm2-135m": Size(n_sentences=128, n_sequences=16, control_tokens=512),
    # half SmolLM2's prose: Gemma 3's forward, with its 262k-token unembedding and four norms
    # a block, costs 2-3x SmolLM2's per token on this CPU, and validation is most of the time
    "gemma3-270m": Size(n_sentences=64, n_sequences=16, control_tokens=512),
    # Qwen2.5-Coder-0.5B: 336 heads (24 x 14), a 151k-token unembedding and 4.9k-wide MLPs,
    # about 4x SmolLM2's forward: smaller probes, control sets measured on pieces of at least
    # 256 tokens (each head ablated alone is a pass of the task: 8 labelled and 4 rejected)
    "qwen2.5-coder-0.5b": Size(
        n_sentences=48,
        n_sequences=12,
        context=(300, 700, 1100),
        alone=(8, 4),
        control_tokens=256,
    ),
    # Qwen2.5-Coder-1.5B: about 3x the 0.5B model's forward a token (28 x 12 heads of 128,
    # 8.9k-wide MLPs, an untied 151k-token unembedding): half its prose and two thirds of
    # its sequences, two needle lengths, 4 and 2 heads ablated alone, the function vectors'
    # indirect effects on 8 prompts (24 by default: a last-token pass per head and prompt);
    # 99 control sets a claim at most, as for the smaller models: at 39 (p >= 0.025) the
    # Benjamini-Hochberg q over its 17 claims could not reach 0.05 unless 10 of them did
    "qwen2.5-coder-1.5b": Size(
        n_sentences=24,
        n_sequences=8,
        context=(300, 700),
        alone=(4, 2),
        control_tokens=256,
        type_options={"function_vector": {"max_prompts": 8}},
    ),
    "minilm-l6": Size(),
    "toy-induction": Size(),
}
"""The published sizes: the command line's defaults with validation; half the prose and
sequences for SmolLM2-135M (its run with validation: about an hour on 2 CPU cores), a quarter
of the prose and half the sequences for Gemma 3 270M, less again for Qwen2.5-Coder-0.5B."""

CHECK = Size(
    n_sentences=16,
    n_sequences=4,
    context=(120,),
    validate=False,
    n_boot=20,
    extra={"half_len": 16},
    type_options={"copy_suppression": {"n_tokens": 100}, "cri": {"max_questions": 2, "n_exact": 4}},
)
"""The small size of ``check.json``, regenerated by the tests: seconds a type, but for the
vocabulary-wide OV circuits (copy suppression over 100 word tokens, not 500: 140 s → 35 s
for Gemma 3's 262k-token vocabulary on one thread), and CRI on two questions with its four
heads of highest estimate patched (a patched pass per head and question)."""


def _probe_problem(model: TransformerBridge, probe: str) -> str | None:
    """Why ``probe`` cannot be built for ``model`` at the check size, or None."""
    from headmech.core.errors import HeadmechError
    from headmech.probes import ProbeOptions, build_probe

    try:
        build_probe(probe, model, ProbeOptions(**CHECK.probe_options()))
    except HeadmechError as e:
        return f"its probe '{probe}' does not fit the model: {e}"
    return None


def applicable_types(model: TransformerBridge) -> tuple[list[str] | None, dict[str, str]]:
    """The head types to classify on ``model``, as ``headmech classify`` picks them.

    On a model whose tokenizer reads no English (the toy model), the types measured on
    prose are left out, and so is any type whose probe cannot be built for the model.

    Returns:
        ``(types, skipped)``: ``types`` is None (every registered type that fits the
        model's shape: :func:`headmech.classify`'s default) when the tokenizer reads
        English, else the names of the types kept; ``skipped`` maps every registered type
        left out to the reason.
    """
    from headmech.core.checks import PROSE_PROBES, prose_problem
    from headmech.headtypes.registry import resolve_types
    from headmech.models import model_info

    info = model_info(model)
    problem = prose_problem(model.tokenizer)
    probes: dict[str, str | None] = {}
    kept: list[str] = []
    skipped: dict[str, str] = {}
    for t in resolve_types(None):
        reason = t.check_model(info)
        if reason is None and problem is not None and t.probe in PROSE_PROBES:
            reason = f"measured on prose, but {problem}"
        elif reason is None and problem is not None:
            if t.probe not in probes:
                probes[t.probe] = _probe_problem(model, t.probe)
            reason = probes[t.probe]
        if reason is None:
            kept.append(t.name)
        else:
            skipped[t.name] = reason
    return (None if problem is None else kept), skipped


def expected_types(model: TransformerBridge) -> list[str]:
    """The names of the types a published catalog of ``model`` must hold, sorted."""
    from headmech.headtypes.registry import head_types

    _, skipped = applicable_types(model)
    return sorted(n for n in head_types() if n not in skipped)


def build_catalog(
    model: TransformerBridge,
    size: Size,
    *,
    progress: bool = False,
    only: Collection[str] | None = None,
) -> HeadCatalog:
    """Classify every applicable type at ``size``, or those of them named in ``only``
    (every sampler is seeded from the probe options, not the global generators: the same
    bytes every run)."""
    from headmech.classification.classify import classify
    from headmech.headtypes.registry import resolve_types
    from headmech.models import model_info

    names, skipped = applicable_types(model)
    if only is not None:
        names = [t.name for t in resolve_types(None) if t.name in only and t.name not in skipped]
    types: list[Any] | None = names
    info = model_info(model)
    runnable = [t for t in resolve_types(names) if t.check_model(info) is None]
    if any(t.name in size.type_options for t in runnable):  # those types with their options
        types = [type(t)(**size.type_options.get(t.name, {})) for t in runnable]
    return classify(
        model,
        types,
        validate=size.validate,
        n_random=size.n_random,
        control_tokens=size.control_tokens,
        n_boot=size.n_boot,
        progress=progress,
        alone=size.alone,
        **size.probe_options(),
    )


def check_json(
    model: TransformerBridge, only: Collection[str] | None = None, *, size: Size | None = None
) -> str:
    """The text of ``check.json``: the catalog at :data:`CHECK` size (or ``size``) of the
    types in ``only`` (the part of the file those types write)."""
    return dumps(build_catalog(model, size or CHECK, only=only).to_json())


def readme(root: Path) -> str:
    """``catalog/README.md`` from the published folders under ``root``
    (:func:`headmech.publish.markdown.readme` of :data:`MODELS`)."""
    from headmech.publish.markdown import readme as markdown

    return markdown(root, MODELS)
