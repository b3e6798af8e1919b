"""Conformance checks for head types, in the style of scikit-learn's ``check_estimator``.

Each check is a small named function ``check_x(head_type, ...)`` that raises
``AssertionError`` with a reason; :func:`check_head_type` runs them all and
:func:`head_type_checks` yields ``(type, check)`` pairs for ``pytest.mark.parametrize``
so that ``pytest -k check_positive_control`` runs one check for every type.

The checks:

* ``check_metadata`` — name, citation, threshold and probe are declared;
* ``check_score_shape_and_finite`` — the score is a finite ``[n_layers, n_heads]`` tensor;
* ``check_deterministic`` — the same seed gives the same scores;
* ``check_inputs_not_mutated`` — reducers leave the activation and the probe untouched;
* ``check_blocks_add_up`` — a blockwise reducer's sums over blocks of query rows equal
  its sums over the whole pattern (what the pattern-free path relies on);
* ``check_positive_control`` — the head that does the type's job in a control model is
  found, and ranked first: for a type scored from attention, a head whose pattern is
  replaced by the type's ideal pattern (:mod:`headmech.testing.planting`); for a type
  scored from weights or from runs of the model (:data:`POSITIVE_CONTROLS`), head
  ``PLANTED`` of a tiny model built by hand to do the job (copy suppression, succession, a
  function vector, writing nothing), scored from that model as from any other;
* ``check_negative_control`` — no head of a randomly initialised model is labelled;
* ``check_causal`` — on a real model, ablating the labelled heads hurts the type's task
  metric more than ablating as many random heads (mean over draws; helps it more for a
  type with ``helps_task = False``; for ``expected_effect = "little"``, hurts it less, and
  by at most ``effect_tolerance`` of the clean metric).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.headtypes.registry import HeadType, collect_statistics, head_types
from headmech.interventions import Intervention, Set, applied
from headmech.probes import PROBES, Probe, ProbeOptions, build_probe
from headmech.stream.engine import HeadStats, ProbeBatch, stream_statistics
from headmech.testing.controls import PLANTED, POSITIVE_CONTROLS
from headmech.testing.planting import ideal_pattern, ideal_values

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.records import TypeValidation

__all__ = [
    "CHECKS",
    "applies",
    "check_causal",
    "check_deterministic",
    "check_head_type",
    "check_inputs_not_mutated",
    "check_metadata",
    "check_negative_control",
    "check_positive_control",
    "check_score_shape_and_finite",
    "head_type_checks",
    "planted_statistics",
    "tiny_model",
]

# Small probes: the checks run for every type in CI.
CONTROL_OPTIONS = ProbeOptions(n_sentences=48, n_sequences=16, half_len=16, batch_size=16, seed=0)


@functools.lru_cache(maxsize=4)
def tiny_model(kind: str = "causal", seed: int = 0) -> TransformerBridge:
    """A randomly initialised 2-layer, 4-head model with a real tokenizer.

    ``kind="causal"``: LLaMA with grouped-query attention (2 KV heads) and SmolLM2's
    tokenizer; ``kind="encoder"``: BERT with MiniLM's tokenizer; ``d_model`` 64, 256
    positions, transformers' initialisation (:func:`headmech.models.tiny.tiny_model`
    builds it). Built once per process; the caller's random stream is left as it was.
    """
    from headmech.models.bundled import minilm_tokenizer, smollm2_tokenizer
    from headmech.models.tiny import tiny_model as build

    if kind not in ("causal", "encoder"):
        raise ValueError(f"kind must be 'causal' or 'encoder', got {kind!r}")
    sizes: dict[str, Any] = {"d_model": 64, "d_mlp": 128, "n_ctx": 256, "init": 0.02}
    if kind == "causal":  # SmolLM2's pad token is no padding row of the embedding
        tok = smollm2_tokenizer()
        return build(
            "llama", seed=seed, name=f"tiny-{kind}", tokenizer=tok, pad_token_id=None, **sizes
        )
    tok = minilm_tokenizer()
    return build("bert", seed=seed, name=f"tiny-{kind}", tokenizer=tok, **sizes)


def _control_model(head_type: HeadType) -> TransformerBridge:
    return tiny_model("causal" if head_type.causal_only else "encoder")


def _stats(
    head_type: HeadType, model: TransformerBridge, probe: Probe, plant: bool = False
) -> HeadStats:
    """Stream the type's statistics; with ``plant``, head PLANTED attends ideally
    (:func:`planted_statistics`)."""
    if not plant:
        return collect_statistics([head_type], model, probe.batches)
    return planted_statistics(head_type, model, probe.batches)


def planted_statistics(
    head_type: HeadType,
    model: TransformerBridge,
    batches: Sequence[ProbeBatch],
    pattern: Callable[[ProbeBatch], Tensor] | None = None,
) -> HeadStats:
    """The type's statistics with head PLANTED attending by ``pattern(batch)``
    (``[batch, query_pos, key_pos]``; default: the type's ideal pattern), and its weight,
    model and candidate statistics at the type's ideal values for that head
    (:mod:`headmech.testing.planting`: :func:`ideal_pattern`, :func:`ideal_values`; the
    conditions some attention-scored types add to their score, such as induction's
    copying; a type whose score is such a statistic has a hand-built control instead,
    :data:`POSITIVE_CONTROLS`)."""
    total: HeadStats | None = None
    for batch in batches:
        plant = ideal_pattern(head_type, batch) if pattern is None else pattern(batch)
        ideal = plant[:, None]  # [batch, 1, q, k]
        planted = Intervention.on([PLANTED], Set(ideal), site="pattern")
        # only the statistics need the planted pattern: some bridges (BERT) warn that the
        # edit does not reach the model's output, which is fine here
        with applied(model, [planted], strict=False), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            s = stream_statistics(model, [batch], head_type.reducers())
        total = s if total is None else total + s
    assert total is not None
    measured = {**head_type.weight_statistics(model)}
    measured.update(head_type.model_statistics(model, batches))
    for key, value in measured.items():
        total.set(f"{head_type.name}.{key}", value)
    # measured on the heads at or above the threshold, the planted one among them
    candidates = head_type.above(head_type.score(total))
    measured.update(head_type.candidate_statistics(model, batches, candidates))
    values = ideal_values(head_type)
    for key, value in measured.items():
        value = value.clone()
        if key in values:
            value[PLANTED] = values[key]
        total.set(f"{head_type.name}.{key}", value)
    return total


def check_metadata(head_type: HeadType) -> None:
    """Name (snake_case, ``<Role>Head`` class), reference with a year, citation, description, float threshold, a registered probe and a References section."""
    cls = type(head_type)
    assert re.fullmatch(r"[a-z][a-z0-9_]*", cls.name), f"name {cls.name!r} is not snake_case"
    assert cls.__name__.endswith("Head"), f"class {cls.__name__} should be named <Role>Head"
    assert cls.reference and re.search(r"\d{4}", cls.reference), "reference needs author and year"
    assert cls.citation, "citation is empty"
    assert cls.description, "description is empty"
    assert isinstance(head_type.threshold, float), "threshold must be a float"
    assert cls.probe in PROBES, f"probe {cls.probe!r} is not registered"
    assert cls.__doc__ and "References" in cls.__doc__, "docstring needs a References section"


def check_score_shape_and_finite(
    head_type: HeadType, model: TransformerBridge | None = None
) -> None:
    """The score is a finite ``[n_layers, n_heads]`` tensor on a tiny control model."""
    model = model or _control_model(head_type)
    probe = build_probe(head_type.probe, model, CONTROL_OPTIONS)
    score = head_type.score(_stats(head_type, model, probe))
    shape = (int(model.cfg.n_layers), int(model.cfg.n_heads))
    assert tuple(score.shape) == shape, f"score shape {tuple(score.shape)} != {shape}"
    assert torch.isfinite(score).all(), "score has non-finite entries"


def check_deterministic(head_type: HeadType, model: TransformerBridge | None = None) -> None:
    """The same probe options (seed) give bit-identical scores."""
    model = model or _control_model(head_type)
    a = head_type.score(
        _stats(head_type, model, build_probe(head_type.probe, model, CONTROL_OPTIONS))
    )
    b = head_type.score(
        _stats(head_type, model, build_probe(head_type.probe, model, CONTROL_OPTIONS))
    )
    assert torch.equal(a, b), "same seed, different scores"


def check_inputs_not_mutated(head_type: HeadType, model: TransformerBridge | None = None) -> None:
    """Reducers leave their activation and the probe batches untouched."""
    model = model or _control_model(head_type)
    probe = build_probe(head_type.probe, model, CONTROL_OPTIONS)
    before = [
        (b.input_ids.clone(), b.attention_mask.clone(), b.special.clone()) for b in probe.batches
    ]
    batch = probe.batches[0]
    g = torch.Generator().manual_seed(0)
    n, pos = batch.input_ids.shape
    h = int(model.cfg.n_heads)
    for r in head_type.reducers():
        if r.hook == "hook_pattern":
            act = torch.rand(n, h, pos, pos, generator=g).softmax(-1)
        else:
            act = torch.rand(n, pos, h, int(model.cfg.d_head), generator=g)
        copy = act.clone()
        r(act, batch, r.prepare(batch) if r.prepare else None, 0)
        assert torch.equal(act, copy), f"reducer {r.name} modified its activation"
    _stats(head_type, model, probe)
    for b, (ids, mask, special) in zip(probe.batches, before, strict=True):
        assert torch.equal(b.input_ids, ids) and torch.equal(b.attention_mask, mask), (
            "probe batch modified"
        )
        assert torch.equal(b.special, special), "probe special-token mask modified"


def check_blocks_add_up(head_type: HeadType, model: TransformerBridge | None = None) -> None:
    """Sums and counts of a blockwise reducer over three blocks of query rows equal its
    sums over all rows at once, on a random pattern."""
    from headmech.stream.reducers import merge_sums

    model = model or _control_model(head_type)
    batch = build_probe(head_type.probe, model, CONTROL_OPTIONS).batches[0]
    n, pos = batch.input_ids.shape
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(n, int(model.cfg.n_heads), pos, pos, generator=g)
    causal = model.cfg.attention_dir == "causal"
    if causal:  # blocks of a causal pattern leave out the keys after their last query
        scores = scores.masked_fill(torch.ones(pos, pos, dtype=torch.bool).triu(1), -torch.inf)
    pattern = scores.softmax(-1)
    blockwise = [r for r in head_type.reducers() if _blockwise(r)]
    assert blockwise, f"{head_type.name} has no blockwise pattern reducer: nothing to check"
    for r in blockwise:
        prepared = r.prepare(batch) if r.prepare else None
        whole = r(pattern, batch, prepared, 0)
        parts: dict[str, list[Any]] = {}
        cuts = [0, pos // 3, pos // 2 + 1, pos]
        for a, b in zip(cuts, cuts[1:], strict=False):
            block = pattern[:, :, a:b, : b if causal else pos]
            merge_sums(parts, r(block, batch, prepared, 0, slice(a, b)))
        assert sorted(parts) == sorted(whole), f"reducer {r.name}: blocks give other statistics"
        for stat, (total, count) in whole.items():
            got_total, got_count = parts[stat]
            assert torch.allclose(
                torch.as_tensor(got_total).double(), torch.as_tensor(total).double(), atol=1e-5
            ), f"reducer {r.name}: {stat} summed over blocks differs from the whole pattern's"
            assert torch.allclose(
                torch.as_tensor(got_count).double(), torch.as_tensor(count).double(), atol=1e-9
            ), f"reducer {r.name}: {stat} counts over blocks differ from the whole pattern's"


def check_positive_control(head_type: HeadType, model: TransformerBridge | None = None) -> None:
    """The head that does the type's job in a control model is labelled, and ranked first.

    A type in :data:`POSITIVE_CONTROLS` is scored, from its probe, on its hand-built model
    (``model`` is not used: a random model has no such head); for any other type, head
    PLANTED of ``model`` attends by the type's ideal pattern.
    """
    build = POSITIVE_CONTROLS.get(head_type.name)
    if build is not None:
        model = build()
        probe = build_probe(head_type.probe, model, CONTROL_OPTIONS)
        stats = collect_statistics([head_type], model, probe.batches)
    else:
        model = model or _control_model(head_type)
        probe = build_probe(head_type.probe, model, CONTROL_OPTIONS)
        stats = _stats(head_type, model, probe, plant=True)
    score = head_type.score(stats)
    heads = head_type.select(score, stats)
    assert PLANTED in heads, (
        f"planted head {PLANTED} not found (its score {float(score[PLANTED]):.3f})"
    )
    assert heads[0] == PLANTED, f"planted head {PLANTED} not ranked first: {heads[:3]}"


def check_negative_control(head_type: HeadType, model: TransformerBridge | None = None) -> None:
    """No head of a randomly initialised model is labelled."""
    model = model or _control_model(head_type)
    probe = build_probe(head_type.probe, model, CONTROL_OPTIONS)
    stats = _stats(head_type, model, probe)
    score = head_type.score(stats)
    heads = head_type.select(score, stats)
    assert not heads, (
        f"a random model has {head_type.name} heads: {heads} (max score {float(score.max()):.3f})"
    )


def check_causal(
    head_type: HeadType,
    model: TransformerBridge,
    options: ProbeOptions | None = None,
    n_random: int = 5,
) -> TypeValidation:
    """On a real model: ablating the labelled heads hurts more than random heads (the set
    and its controls; no head is ablated alone: ``alone=(0, 0)``, each would be a pass of
    the task that nothing here reads)."""
    from headmech.classification.classify import classify

    options = options or ProbeOptions()
    cat = classify(
        model, [head_type], validate=True, n_random=n_random, alone=(0, 0), **vars(options)
    )
    v = cat[head_type.name].validation
    assert v is not None, f"{head_type.name} was not validated"
    c, note = v.primary, v.controls.note
    assert c.n_heads > 0, f"no {head_type.name} heads labelled on this model: nothing to validate"
    assert c.effect is not None, f"{head_type.name}: {note}"
    mean = c.random_mean
    assert mean is not None, (
        f"{head_type.name}: nothing to compare the {c.n_heads} labelled heads with ({note})"
    )
    if head_type.expected() == "little":  # inactive heads: zeroing them costs little
        rel, tol = c.extra["relative_effect"], c.extra["tolerance"]
        assert c.effect < mean and rel <= tol, (
            f"zeroing the {c.n_heads} {head_type.name} heads changes {c.metric} by "
            f"{c.effect:.4f} ({rel:+.2%} of clean), random heads by {mean:.4f} (expected: "
            f"less, within {tol:.0%})"
        )
        return v
    sign = 1.0 if head_type.helps_task else -1.0  # heads against the task should lower it
    assert sign * c.effect > sign * mean, (
        f"ablating the {c.n_heads} {head_type.name} heads changes {c.metric} by {c.effect:.4f}, "
        f"random heads by {mean:.4f} on average (expected: {c.expected} it more)"
    )
    return v


CHECKS: list[Callable[..., Any]] = [
    check_metadata,
    check_score_shape_and_finite,
    check_deterministic,
    check_inputs_not_mutated,
    check_blocks_add_up,
    check_positive_control,
    check_negative_control,
]


def _blockwise(r: Any) -> bool:
    return bool(r.blockwise and r.hook == "hook_pattern")


def applies(check: Callable[..., Any], head_type: HeadType) -> bool:
    """Whether ``check`` can test ``head_type``: the blockwise check needs a blockwise
    pattern reducer (copy suppression and successor heads are scored from weights, the
    syntactic reducer reads whole rows); every other check applies to every type."""
    if check is check_blocks_add_up:
        return any(_blockwise(r) for r in head_type.reducers())
    return True


def head_type_checks(types: list[type[HeadType]] | None = None) -> Iterator[Any]:
    """``pytest.param(type, check, id="name-check")`` for every type and every check that
    :func:`applies` to it (no causal check: it needs a real model)."""
    import pytest

    for cls in types or list(head_types().values()):
        for check in CHECKS:
            if applies(check, cls()):
                yield pytest.param(cls, check, id=f"{cls.name}-{check.__name__}")


def check_head_type(
    head_type: HeadType | type[HeadType], model: TransformerBridge | None = None
) -> None:
    """Run every control check on a head type (raises ``AssertionError`` naming the check)."""
    t = head_type() if isinstance(head_type, type) else head_type
    for check in (c for c in CHECKS if applies(c, t)):
        try:
            check(t) if check is check_metadata else check(t, model)
        except AssertionError as e:
            raise AssertionError(f"{t.name}: {check.__name__}: {e}") from None
