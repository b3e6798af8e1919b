"""What the command line prints beside the files it writes: each head type's evidence
(its own lines: :mod:`headmech.cli.evidence`) and validation, and a pruning run's survival
table.

Every shape of validation record that :mod:`headmech.classification.classify` writes gets its own line:
labelled heads against same-layer controls, against controls from every layer (the
fallback), with no control possible (most heads labelled, or ``n_random`` 0), with no
labelled heads, and not applicable (the type's task cannot run on the model).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from headmech.cli.evidence import evidence_lines

if TYPE_CHECKING:
    from headmech.classification.readings import HeadReading
    from headmech.classification.records import ClaimRecord, TypeValidation

__all__ = ["evidence", "pruning", "validation_line"]

_CONTROL = {"same_layers": "from the same layers", "any_layer": "from any layer"}


def control_words(kind: str) -> str:
    """Where a record's control sets were drawn from, in words."""
    if kind.startswith("layers_within_"):
        return f"from within {kind.rsplit('_', 1)[1]} layer(s) of the labelled ones"
    return _CONTROL.get(kind, kind)


def _effect(c: ClaimRecord) -> str:
    """The labelled heads' effect and its bootstrap interval, where there is one."""
    text = f"labelled heads {c.effect:+.4f}"
    if c.effect_interval:
        lo, hi = c.effect_interval
        text += f" (95% interval {lo:+.4f} to {hi:+.4f})"
    return text


def validation_line(v: TypeValidation | None) -> str | None:
    """One line on a type's validation record (``TypeResult.validation``), or None when
    the type was not validated."""
    if v is None:
        return None
    c, note = v.primary, v.controls.note
    if c.effect is None and (c.n_heads or note.startswith("not validated")):
        return f"validation: {note or 'not validated'}"  # the task cannot run on this model
    how = f"{c.mode} ablation" if c.kind == "ablation" else f"{c.kind}, {c.mode}"
    head = f"validation ({how}, {c.metric}): "
    if not c.n_heads:
        return head + "no labelled heads, nothing to ablate"
    k = len(c.random_effects)
    if c.random_mean is None or not k:  # every head labelled, or no draw asked for
        why = note if note.startswith("no control possible") else f"no control possible ({note})"
        said = f"; verdict: {c.verdict}" if c.verdict != "not run" else ""
        return f"{head}{_effect(c)}; {why}{said}"
    kind = v.controls.kind
    text = (
        f"{head}{_effect(c)}; {k} random set{'s' if k != 1 else ''} of {c.n_heads} "
        f"{control_words(kind)}: {c.random_mean:+.4f} on average"
    )
    if c.random_median is not None and c.random_range:
        lo, hi = c.random_range
        text += f" (median {c.random_median:+.4f}, range {lo:+.4f} to {hi:+.4f})"
    if (kind == "any_layer" or kind.startswith("layers_")) and note:
        text += f"; {note}"
    elif "controls degenerate" in note:  # fewer distinct control sets than drawn
        text += "; " + note[note.index("controls degenerate") :]
    if c.test is not None:
        from headmech.classification.montecarlo import describe_test

        text += f"; {describe_test(c.test)}"
    if c.verdict != "not run":
        text += f"; verdict: {c.verdict}"
    for other, o in v.secondary.items():
        text += f"; also {other}: {o.verdict}"
    return text


def _own(e: HeadReading | None) -> str:
    """A head's own effect (ablated alone), with its interval."""
    if e is None or e.alone is None:
        return "not measured alone"
    text = f"{e.alone.effect:+.4f}"
    if e.alone.interval:
        text += f" [{e.alone.interval[0]:+.4f}, {e.alone.interval[1]:+.4f}]"
    return text


def not_labelled_lines(
    entries: list[dict[str, Any]], per_head: dict[str, HeadReading]
) -> list[str]:
    """One line per head at or above the threshold that is not labelled: its score, the
    criterion it failed and, where validated, its own effect."""
    groups: dict[str, list[str]] = {}  # heads failing the same criterion share a line
    for e in entries:
        own = f"; own effect {_own(per_head[e['head']])}" if e["head"] in per_head else ""
        reason, detail = _split_detail(e["reason"])
        head = f"{e['head']} {e['score']:.3f}" + (f" ({detail})" if detail else "")
        groups.setdefault(reason + own, []).append(head)
    return [f"not labelled {', '.join(heads)}: {reason}" for reason, heads in groups.items()]


def _split_detail(reason: str) -> tuple[str, str]:
    """A reason and its trailing per-head value in brackets ("... (best q 0.053)")."""
    m = re.match(r"^(.*\S)\s+\(([a-zA-Z][\w ]*?[ =]\s*[-+]?\d[\d.]*(?:e[-+]?\d+)?)\)$", reason)
    return (m.group(1), m.group(2)) if m else (reason, "")


def skipped_lines(skipped: dict[str, str]) -> list[str]:
    """``skipped TYPE: reason`` lines, types skipped for the same reason on one line."""
    groups: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        groups.setdefault(reason.replace(f"head type '{name}' ", ""), []).append(name)
    return [
        f"skipped {names[0]}: {skipped[names[0]]}"
        if len(names) == 1
        else f"skipped {len(names)} types ({', '.join(names)}): {reason}"
        for reason, names in groups.items()
    ]


def per_head_lines(per_head: dict[str, HeadReading], v: TypeValidation | None) -> list[str]:
    """The labelled heads' own effects in one line, and the set's against their sum."""
    own = [f"{h} {_own(e)}" for h, e in per_head.items() if e.labelled]
    if not own:
        return []
    lines = [f"each labelled head ablated alone: {', '.join(own)}"]
    if v is not None and v.per_head_note:
        lines[0] += f" ({v.per_head_note})"
    red = v.redundancy if v is not None else None
    if red is not None:
        ratio = red.ratio
        how = (
            "no ratio: opposite signs"
            if ratio is None
            else f"ratio {ratio:.2f}: "
            + ("> 1, they back each other up" if ratio > 1 else "<= 1, their effects overlap")
        )
        lines.append(
            f"set {red.set_effect:+.4f} vs the sum of its heads' own "
            f"{red.sum_of_own_effects:+.4f} ({how})"
        )
    return lines


def evidence(catalog: Any) -> None:
    """Each type's own evidence (:func:`headmech.cli.evidence.evidence_lines`, e.g.
    syntactic: per relation, best head vs baseline) and its validation
    (:func:`validation_line`)."""
    from headmech.headtypes.registry import head_types

    head_types()  # loads the catalog: a plug-in type's file registers its lines on import
    for name, r in catalog.types.items():
        lines = evidence_lines(name, r.details)
        lines += not_labelled_lines(r.not_labelled, r.per_head)
        line = validation_line(r.validation)
        if line is not None:
            lines.append(line)
        lines += per_head_lines(r.per_head, r.validation)
        if lines:
            print(f"\n{name}:")
            for line in lines:
                print(f"  {line}")


def pruning(result: Any, catalog: Any) -> None:
    """Survival by type (with a catalog), the metric per step, and the headline."""
    if catalog is not None and result.steps:
        from headmech.pruning.survival import enrichment, removal_order

        n_kept = [st["n_kept"] for st in result.steps]
        rows = removal_order(result.survival, n_kept)
        if rows:
            print("types by when pruning removed half their heads (heads kept then):")
        else:
            print("no catalogued type has labelled heads: no survival to report")
        for row in rows:
            at = row["half_removed_at_n_kept"]
            print(f"  {row['type']}: {'kept at least half to the end' if at is None else at}")
        half = min(result.steps, key=lambda st: abs(st["n_kept"] - n_kept[0] / 2))
        e = enrichment(half["heads_kept"], catalog)
        shown = "none (no catalogued or no kept heads)" if e is None else f"{e:g}"
        print(f"enrichment of catalogued heads among the {half['n_kept']} kept: {shown}")
    for st in result.steps:
        lam = f"  (lambda {st['lambda']:g})" if "lambda" in st else ""
        print(f"  {st['n_kept']:4d} heads kept: {st['metric']:.4f}{lam}")
    if "comparison" in result.extra:
        c = result.extra["comparison"]
        print(
            f"mae / {result.task} (held out, lower is better): base {c['base']:.4f}, "
            f"MAE gates + {c['model_steps']} model steps {c['mae']:.4f}, fine-tuned alone {c['finetuned']:.4f}"
        )
    else:
        print(
            f"{result.method} / {result.task}: {result.removable_fraction(0.05):.0%} of heads "
            "removable at <= 5% metric loss"
        )
