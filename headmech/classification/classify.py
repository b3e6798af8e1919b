"""Classify every head of a model into catalog head types: ``headmech.classify``.

:func:`classify` checks its keywords once into a
:class:`~headmech.classification.spec.ClassifySpec` and runs it
(:mod:`headmech.classification.runner`): each probe built once and streamed, each type
scored and labelled with a bootstrap interval on every score. The result,
:class:`~headmech.classification.results.HeadCatalog`, round-trips through ``catalog.json``
(schema in docs/architecture.md). :func:`validate_heads` checks labels causally: the
labelled heads are ablated, and so are random control sets drawn from the same layers
(:mod:`headmech.classification.validation`, re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from headmech.classification.results import HeadCatalog, TypeResult
from headmech.classification.spec import ClassifySpec
from headmech.classification.validation import validate_heads
from headmech.headtypes.registry import HeadType

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.runs.resume import Units

__all__ = ["ClassifySpec", "HeadCatalog", "TypeResult", "classify", "validate_heads"]


def classify(
    model: TransformerBridge,
    types: Sequence[str | HeadType | type[HeadType]] | str | None = None,
    *,
    validate: bool = False,
    n_random: int | None = None,
    control_tokens: int | None = None,
    n_boot: int = 200,
    thresholds: Mapping[str, float] | None = None,
    progress: bool = True,
    units: Units | None = None,
    alone: tuple[int, int] | None = None,
    broad: bool = True,
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
        n_random: control sets per claim at most (default 99: p can reach 0.01; fewer: quick work,
            ``inconclusive`` where p cannot reach 0.05).
        control_tokens: the test measured on every k-th probe batch that still holds this
            many tokens (0: every batch; ``TestOptions.test_batches``).
        alone: at most this many labelled and rejected heads ablated alone, the highest
            scores first (default 24, 8; a pass of the task each).
        broad: with ``validate``, also read the labelled and rejected heads on ordinary
            text (default); ``False`` skips that reading (a forward pass over about 3,800
            tokens: a third of a small validation's time on SmolLM2 and Qwen2.5-0.5B) and
            says so in each type's ``details["broad"]``.
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
    spec = ClassifySpec.create(
        types=types, validate=validate, n_random=n_random, control_tokens=control_tokens,
        n_boot=n_boot, thresholds=thresholds, alone=alone, broad=broad, **probe_options,
    )  # fmt: skip
    return spec.run(model, units=units, progress=progress)
