"""Causal validation of head labels: do the labelled heads matter for their type's task?

:func:`validate_heads` ablates a type's labelled heads, and random control sets of as many
unlabelled heads drawn from the same layers, and measures the type's task metric (higher
is worse) each time; :func:`headmech.classify` runs it for every type with
``validate=True`` (``details["validation"]`` of ``catalog.json``). Not to be confused with
:mod:`headmech.core.checks`, the checks of user input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from headmech.classification.control_sets import draw_controls
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.models import model_info
from headmech.probes import ProbeOptions

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["validate_heads"]


MAX_PER_HEAD = 24  # labelled heads ablated one at a time (the highest scores first)
MAX_REJECTED = 8  # heads at or above the threshold but not labelled, ablated one at a time


def validate_heads(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    *,
    n_random: int = 5,
    mode: str | None = None,
    task: str | None = None,
    excluded: Collection[HeadIndex] = (),
    one_by_one: Sequence[HeadIndex] | None = None,
) -> dict[str, Any]:
    """Ablate the labelled heads, and ``n_random`` control sets of as many heads not of
    the type (neither labelled nor in ``excluded``) from the same layers (per-layer counts
    matched), and measure the type's task metric (higher is worse) each time (``task``:
    another task than the type's). Each head of ``one_by_one`` (default: the labelled
    heads, at most :data:`MAX_PER_HEAD`) is also ablated alone: its own effect, with a
    bootstrap interval (``per_head``), and the set's effect against the sum of its heads'
    own (``redundancy``).

    All sets ride in the same batched forward passes
    (:func:`headmech.interventions.run_variants`). The effect of the labelled heads is
    reported against the median and the range of the control effects, with the drawn
    control sets; a bootstrap interval over probe examples accompanies the labelled
    effect.

    Returns:
        ``{"metric", "mode", "control", "control_note", "clean", "ablated", "effect",
        "effect_interval", "control_sets", "random_effects", "random_mean",
        "random_median", "random_range", "n_heads", "expected"}``; ``effect`` is ablated
        minus clean; ``expected``: ``raise`` (the type serves the task), ``lower``, or ``little``
        (inactive heads; then also ``relative_effect``, effect / clean, and ``tolerance``);
        ``control`` is ``same_layers``, ``any_layer`` (fallback) or ``none``;
        ``per_head``: ``{"L18H6": {"effect", "interval", "labelled"}}``; ``redundancy``.
    """
    from headmech.core.head_index import check_heads
    from headmech.core.progress import active
    from headmech.interventions import run_variants
    from headmech.interventions.ablation import ablation_variants
    from headmech.stream.uncertainty import UnitValues
    from headmech.tasks import get_task

    heads = check_heads(heads, None, None, "heads")  # pairs or "L18H6"
    excluded = check_heads(excluded, None, None, "excluded")
    if one_by_one is not None:
        one_by_one = check_heads(one_by_one, None, None, "one_by_one")
    mode = mode or head_type.ablation
    info = model_info(model)
    t = get_task(task or head_type.task, model)
    batches = t.batches(model, options)
    controls, kind, note = draw_controls(info, heads, n_random, options.seed, excluded)
    alone = _one_by_one(heads, one_by_one)
    base = [list(heads), *controls] if heads else []
    sets = [*base, *[[h] for h in alone]]
    variants = ablation_variants(model, batches, sets, mode)
    desc = f"validate {head_type.name} (labelled + {len(controls)} control sets"
    desc += f" + {len(alone)} heads alone)" if alone else ")"
    values, clean, sums, counts = run_variants(
        model, t, batches, variants, per_unit=True, progress=desc if active() else False
    )

    def interval(i: int) -> list[float] | None:  # of variant i (0: the labelled set)
        paired = UnitValues(sums[1 + i] - sums[0], counts[0]).interval(seed=options.seed)
        out = None if paired is None else [float(paired[0]), float(paired[1])]
        return None if out is None or out[0] != out[0] else out  # NaN: no unit scored

    record: dict[str, Any] = {"metric": t.description, "mode": mode, "control": kind}
    record["control_note"] = note
    record |= _asked(controls, n_random) | _excluded(excluded, heads)
    n = len(base)
    out = _effects(head_type, heads, controls, values[:n], clean, interval(0) if heads else None)
    own = [(h, float(values[n + i]) - clean, interval(n + i)) for i, h in enumerate(alone)]
    return {**record, **out, **_per_head(heads, own, out["effect"])}


def _one_by_one(
    heads: Sequence[HeadIndex], one_by_one: Sequence[HeadIndex] | None
) -> list[HeadIndex]:
    """The heads ablated alone: ``one_by_one`` as given, else the labelled heads (at most
    :data:`MAX_PER_HEAD`, the first, i.e. highest-scoring, ones)."""
    return list(dict.fromkeys(one_by_one if one_by_one is not None else heads[:MAX_PER_HEAD]))


def _excluded(excluded: Collection[HeadIndex], heads: Sequence[HeadIndex]) -> dict[str, Any]:
    """The record of the heads kept out of the controls beyond the labelled ones."""
    extra = sorted(set(excluded) - set(heads))
    return {"excluded_from_controls": [[h.layer, h.head] for h in extra]} if extra else {}


def _per_head(
    heads: Sequence[HeadIndex],
    own: list[tuple[HeadIndex, float, list[float] | None]],
    set_effect: float | None,
) -> dict[str, Any]:
    """``per_head`` (each head's own effect, ablated alone, with its interval) and
    ``redundancy``: the labelled set's effect against the sum of its heads' own effects,
    where every labelled head was measured (ratio > 1: removed together they cost more
    than one by one, so they back each other up, one compensating for another; < 1:
    their effects overlap; None where the set and the sum differ in sign)."""
    if not own:
        return {}
    labelled = set(heads)
    per = {str(h): {"effect": e, "interval": iv, "labelled": h in labelled} for h, e, iv in own}
    out: dict[str, Any] = {"per_head": per}
    measured = {h for h, _, _ in own} & labelled
    if len(measured) < len(labelled):
        out["per_head_note"] = (
            f"{len(measured)} of {len(labelled)} labelled heads ablated alone (the highest scores)"
        )
    elif set_effect is not None:
        total = sum(e for h, e, _ in own if h in labelled)
        same_sign = total != 0 and (total > 0) == (set_effect > 0)
        out["redundancy"] = {
            "set_effect": set_effect,
            "sum_of_own_effects": total,
            "ratio": set_effect / total if same_sign else None,  # opposite signs: no ratio
        }
    return out


def _asked(controls: Sequence[Any], n_random: int) -> dict[str, int]:
    """``n_controls_asked`` where fewer distinct control sets exist than were asked for."""
    return {"n_controls_asked": n_random} if controls and len(controls) < n_random else {}


def _effects(
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    controls: list[list[HeadIndex]],
    values: torch.Tensor,
    clean: float,
    interval: list[float] | None,
) -> dict[str, Any]:
    """:func:`validate_heads`' effects: the labelled set's (``values[0]``, where there are
    labelled heads) and the control sets' (the rest), each minus the clean metric."""
    ablated = float(values[0]) if heads else clean
    rand = sorted(float(v) - clean for v in values[1:])
    little = {}
    if head_type.expected() == "little":  # a pruning claim: the effect relative to clean
        little["relative_effect"] = (ablated - clean) / abs(clean) if clean else None
        little["tolerance"] = head_type.effect_tolerance
    return {
        "clean": clean,
        "ablated": ablated,
        "effect": ablated - clean,
        "effect_interval": interval,
        "control_sets": [[[h.layer, h.head] for h in c] for c in controls],
        "random_effects": [float(v) - clean for v in values[1:]],
        "random_mean": sum(rand) / len(rand) if rand else None,
        "random_median": float(torch.tensor(rand).median()) if rand else None,
        "random_range": [rand[0], rand[-1]] if rand else None,
        "n_heads": len(heads),
        "expected": head_type.expected(),
        **little,
    }


def _task_validation(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    n_random: int,
    excluded: Collection[HeadIndex] = (),
    one_by_one: Sequence[HeadIndex] | None = None,
) -> dict[str, Any]:
    """:func:`validate_heads`, or, where the type's task cannot run on the model (the
    induction task's next-token loss for ``duplicate_token`` on an encoder), a record that
    says so: ``effect`` None and the reason in ``control_note``."""
    from headmech.core.registry import TASKS
    from headmech.tasks import is_causal

    task = TASKS.get(str(head_type.task))(model)
    if not (task.causal_only and not is_causal(model)):
        return validate_heads(
            model, head_type, heads, options, n_random=n_random, excluded=excluded,
            one_by_one=one_by_one,
        )  # fmt: skip
    none = dict.fromkeys(("clean", "ablated", "effect", "effect_interval", "random_mean"))
    none.update(dict.fromkeys(("random_median", "random_range")))
    return {
        **none,
        "metric": task.description,
        "mode": head_type.ablation,
        "control": "none",
        "control_note": f"not validated: task '{task.name}' needs a causal (decoder) model",
        "control_sets": [],
        "random_effects": [],
        "n_heads": len(heads),
        "expected": head_type.expected(),
    }


def type_validation(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    n_random: int,
    labelled: dict[str, list[HeadIndex]] | None = None,
    excluded: Collection[HeadIndex] = (),
    rejected: Sequence[HeadIndex] = (),
    *,
    alone: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The type's validation (``head_type.validation``, :mod:`headmech.classification.claims`): the
    ablation on its task, or the direct path to the logits (with the backup heads), or
    the ablation plus K-composition into the induction heads (``labelled["induction"]``,
    the catalog's); then the record's claim, the control sets' accounting and the verdict.

    Controls are drawn from heads not of the type (``excluded``: those that may be,
    :meth:`headmech.classification.results.TypeResult.not_controls`). The labelled heads (at most
    :data:`MAX_PER_HEAD`) and the heads ``rejected`` above the threshold by a further
    criterion (at most :data:`MAX_REJECTED`; other caps: ``alone``) are each ablated
    alone too: their own effects decide whether the criterion was right (``per_head``)."""
    from headmech.tasks import is_causal

    n_labelled, n_rejected = alone or (MAX_PER_HEAD, MAX_REJECTED)
    extra = [h for h in rejected if h not in heads][:n_rejected]
    alone_heads = [*heads[:n_labelled], *extra]
    method = getattr(head_type, "validation", "ablation")
    if method == "k_composition":  # the induction task: repeated halves that fit the context
        fit = (int(model.cfg.n_ctx) - 2) // 2  # a BOS before, a separator after
        options = dataclasses.replace(options, half_len=max(2, min(options.half_len, fit)))
    if method == "direct_path" and is_causal(model):
        record = _direct_path(model, head_type, heads, options, n_random, excluded, alone_heads)
    elif method == "k_composition" and not is_causal(model):  # no induction task: the lm
        record = validate_heads(
            model, head_type, heads, options, n_random=n_random, task="lm", excluded=excluded,
            one_by_one=alone_heads,
        )  # fmt: skip
    else:
        record = _task_validation(model, head_type, heads, options, n_random, excluded, alone_heads)
    if method == "k_composition" and is_causal(model) and record.get("effect") is not None:
        receivers = list((labelled or {}).get("induction", []))
        record["k_composition"] = _k_record(model, heads, record, receivers, options)
    return _accounted(model, head_type, heads, record, method)


def _direct_path(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    n_random: int,
    excluded: Collection[HeadIndex] = (),
    alone: Sequence[HeadIndex] = (),
) -> dict[str, Any]:
    """Path patching to the logits: the labelled set and the control sets, each patched
    from the corrupted prompts (:func:`headmech.classification.claims.direct_path_values`), and each
    head of ``alone`` patched alone (its own direct effect)."""
    from headmech.classification.claims import backup_heads, direct_path_values
    from headmech.stream.uncertainty import UnitValues
    from headmech.tasks import get_task

    task: Any = get_task(head_type.task, model)
    batches = task.batches(model, options)
    controls, kind, note = draw_controls(model_info(model), heads, n_random, options.seed, excluded)
    base = [list(heads), *controls] if heads else []
    sets = [*base, *[[h] for h in alone]]
    clean = 0.0
    values, per = torch.zeros(0), torch.zeros(0, 0)
    if sets:
        values, clean, per = direct_path_values(model, task, batches, sets, options.seed)

    def interval(i: int) -> list[float] | None:
        paired = UnitValues(per[i], torch.ones(per.shape[1])).interval(seed=options.seed)
        return None if paired is None else [float(paired[0]), float(paired[1])]

    record = (
        {
            "metric": f"direct effect on the logits (path patching from the corrupted prompts): "
            f"{task.description}",
            "mode": "path patching to the logits",
            "control": kind,
            "control_note": note,
        }
        | _asked(controls, n_random)
        | _excluded(excluded, heads)
    )
    n = len(base)
    first = interval(0) if heads else None
    out = {**record, **_effects(head_type, heads, controls, values[:n], clean, first)}
    own = [(h, float(values[n + i]) - clean, interval(n + i)) for i, h in enumerate(alone)]
    out |= _per_head(heads, own, out["effect"])
    if heads and head_type.expected() == "raise":
        out["backup"] = backup_heads(model, task, batches, list(heads), options.seed)
    return out


def _k_record(
    model: TransformerBridge,
    heads: Sequence[HeadIndex],
    record: dict[str, Any],
    receivers: list[HeadIndex],
    options: ProbeOptions,
) -> dict[str, Any]:
    """The labelled heads' and the control sets' writes patched into the induction heads'
    keys (:func:`headmech.classification.claims.k_composition`), as a record."""
    from headmech.classification.claims import control_space, k_composition, verdict
    from headmech.tasks import get_task

    controls = [[HeadIndex(la, h) for la, h in s] for s in record.get("control_sets", [])]
    senders = [list(heads), *controls]
    usable = [r for r in receivers if any(h.layer < r.layer for h in heads)]
    if not heads or not usable:
        why = "no labelled heads" if not heads else "no induction head after a labelled head"
        return {"receivers": [[r.layer, r.head] for r in receivers], "note": why}
    task = get_task("induction", model)
    batches = task.batches(model, options)
    effects, interval = k_composition(model, senders, usable, batches, task, options.seed)
    rand = sorted(effects[1:])
    out = {
        "receivers": [[r.layer, r.head] for r in usable],
        "metric": f"{task.description}, with the senders' corrupted writes patched into the "
        "receivers' keys only (first halves replaced)",
        "effect": effects[0],
        "effect_interval": interval,
        "random_effects": effects[1:],
        "random_median": float(torch.tensor(rand).median()) if rand else None,
        "random_range": [rand[0], rand[-1]] if rand else None,
        "n_heads": len(heads),
        "expected": "raise",
    }
    info = model_info(model)
    banned = record.get("excluded_from_controls", [])
    _, possible = control_space(heads, info.n_layers, info.n_heads, record["control"], banned)
    return {**out, "verdict": verdict(out, possible)}


def _accounted(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    record: dict[str, Any],
    method: str,
) -> dict[str, Any]:
    """The record with its claim, the control sets' pool, the distinct sets drawn and
    possible, and the verdict (:func:`headmech.classification.claims.verdict`); degenerate controls are
    said in ``control_note``."""
    from headmech.classification.claims import control_space, n_distinct, verdict

    info = model_info(model)
    banned = record.get("excluded_from_controls", [])
    pool, possible = control_space(heads, info.n_layers, info.n_heads, record["control"], banned)
    drawn = len(record.get("random_effects") or [])
    asked = int(record.get("n_controls_asked", drawn))
    record.update(
        validation=method,
        claim=head_type.claim
        or f"ablating the labelled heads changes the '{head_type.task}' "
        f"task's metric ({record['metric']}) more than ablating as many random heads",
        control_pool=pool,
        n_possible_sets=possible,
        n_distinct_controls=n_distinct(record.get("control_sets") or []),
    )
    if drawn and possible < asked:
        degenerate = (
            f"controls degenerate: {possible} distinct set(s) of {len(heads)} exist in a pool "
            f"of {pool} eligible heads (not of the type), {asked} asked for, {drawn} drawn: not judged "
            "against them"
        )
        record["control_note"] = "; ".join(x for x in (record["control_note"], degenerate) if x)
    record["verdict"] = verdict(record)
    return record
