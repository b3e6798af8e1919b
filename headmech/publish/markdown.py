"""``catalog/README.md``: the published catalogs as Markdown, from their files alone.

Per model (:func:`readme`): how it was made (the command, versions, weights hash,
seconds) and a table of every type: threshold, labelled heads with scores, the validation
effect with its interval against the controls' median and range, the metric; then the
cross-model section of :mod:`headmech.publish.compare`. ``make catalog`` (:mod:`headmech.publish`)
writes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headmech.classification.readings import HeadReading, reading_of, readings_of
from headmech.classification.records import ClaimRecord, validation_of

__all__ = [
    "quote",
    "readme",
    "type_verdict",
]


def _heads_cell(t: dict[str, Any], most: int = 12) -> str:
    """Labelled heads, best first, with scores (the best unlabelled head when none)."""
    score = t["score"]
    heads = [(la, h, score[la][h]) for la, h in t["heads"]]
    if not heads:
        cells = [(la, h, v) for la, row in enumerate(score) for h, v in enumerate(row)]
        la, h, v = max(cells, key=lambda c: float("-inf") if c[2] is None else c[2])
        return "none" if v is None else f"none (best L{la}H{h} {v:.2f})"
    text = ", ".join(f"L{la}H{h} {v:.2f}" for la, h, v in heads[:most])
    return text + (f", … (+{len(heads) - most})" if len(heads) > most else "")


def _validation_cell(c: ClaimRecord | None, control: str = "", note: str = "") -> tuple[str, str]:
    """``(labelled effect [interval], controls: median (range))`` of one claim (``control``:
    how its control sets were drawn; ``note``: the accounting's note, the primary's)."""
    if c is None:
        return "not validated", ""
    if not c.n_heads:
        return "no labelled heads", ""
    if c.effect is None:
        return "—", note
    effect = f"{c.effect:+.3g}"
    if c.expected in ("lower", "little"):  # little: inactive heads, a pruning claim
        effect += f" (expected: {c.expected})"
    if c.effect_interval:
        effect += " [{:+.3g}, {:+.3g}]".format(*c.effect_interval)
    if c.random_median is None or c.random_range is None:
        return effect, note or "no control"
    lo, hi = c.random_range
    where = {"same_layers": "same layers", "any_layer": "any layer"}.get(control, "")
    if control.startswith("layers_within_"):
        where = f"within {control.rsplit('_', 1)[1]} layer(s)"
    n = len(c.random_effects)
    what = "set" if c.kind != "sink_dose" else "lowest-bin set"
    return (
        effect,
        f"{c.random_median:+.3g} ({lo:+.3g} … {hi:+.3g}; {n} {what}{'s' if n != 1 else ''}"
        + (f", {where}" if where else "")
        + ")",
    )


def type_verdict(t: dict[str, Any], n_layers: int = 0, n_heads: int = 0) -> str:
    """A catalog entry's verdict: its primary claim's, as validation recorded it (a
    Monte Carlo test decided on Benjamini-Hochberg's q:
    :mod:`headmech.classification.montecarlo`); ``not run`` without validation."""
    v = validation_of(t)
    return v.verdict if v is not None else "not run"


def quote(root: Path, model: str, name: str, part: str = "") -> str:
    """How the project's README quotes a type's published validation:
    ``catalog <model>/<type>: <effect [CI]> vs controls <median (range)>; <p, q, n>:
    <verdict>`` (``part``: another claim of the type than its primary, e.g.
    ``ablation`` for previous-token heads, quoted as ``catalog <model>/<type> <part>:
    ...``); tests/test_claims.py checks every such quote against
    ``root/<model>/catalog.json``."""
    from headmech.classification.montecarlo import describe_test

    data = json.loads((root / model / "catalog.json").read_text())
    v = validation_of(data["types"][name])
    c = None if v is None else dict(v.parts())[part] if part else v.primary
    note = v.controls.note if v is not None and not part else ""
    effect, control = _validation_cell(c, v.controls.kind if v else "", note)
    text = f"{effect} vs controls {control}" if control else effect
    test = describe_test(c.test) if c is not None else ""
    text += f"; {test}" if test else ""
    said = c.verdict if c is not None else "not run"
    return f"catalog {model}/{name}{' ' + part if part else ''}: {text}: {said}"


def _verdict_rows(data: dict[str, Any]) -> list[str]:
    """Per type and claim (the primary first): which metric, the effect [interval]
    against the controls' median (range), the test (p, q, n) and the verdict; then one
    line per type whose claim could not be tested."""
    from headmech.classification.montecarlo import describe_test

    m = data["model"]
    lines = [
        "",
        f"Validation verdicts ({m['name']}): each claim is a Monte Carlo test of the labelled "
        "set against up to 99 random control sets (random relabellings of the labelled heads' "
        "layers, never a head of the type or its circuit), stopped after 5 controls at least "
        "as extreme; p = (1 + exceedances) / (1 + n), q by Benjamini-Hochberg across every "
        "claim of the catalog. *validated*: q <= 0.05 and the effect's 95% interval excludes "
        "0; *inconclusive*: fewer control sets were drawn than p <= 0.05 needs; *untestable "
        "here*: the model holds too few distinct control sets. The primary claim (the "
        "paper's own) comes first.",
        "",
        "| type | claim | validated on | effect [95% CI] | controls: median (range) | test | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, t in data["types"].items():
        v = validation_of(t)
        if v is None:
            continue
        for i, (kind, c) in enumerate(v.parts()):
            note = v.controls.note if i == 0 else ""
            effect, control = _validation_cell(c, v.controls.kind, note)
            how = c.metric
            if kind == "ablation" and c.mode:
                how += f" ({c.mode} ablation)"
            label = f"`{name}`" if i == 0 else f"`{name}` (also)"
            lines.append(
                f"| {label} | {kind} | {how} | {effect} | {control} | "
                f"{describe_test(c.test) or '–'} | **{c.verdict}** |"
            )
        for kind, why in v.unavailable.items():
            notes.append(f"- `{name}`: its primary claim ({kind}) could not be tested here: {why}.")
        untested = v.verdict in ("untestable here", "inconclusive")
        if untested and v.primary.effect is not None and v.controls.note:
            notes.append(f"- `{name}`: {v.verdict}: {v.controls.note}.")
    return [*lines, *([""] + notes if notes else [])]


def _own(e: HeadReading | None) -> str:
    if e is None or e.alone is None:
        return "–"
    text = f"{e.alone.effect:+.3g}"
    interval = e.alone.interval
    return text + (" [{:+.3g}, {:+.3g}]".format(*interval) if interval else "")


def _not_labelled_rows(data: dict[str, Any]) -> list[str]:
    """Every head at or above a threshold that is not labelled, with the criterion it
    failed and its own effect on the type's task."""
    rows = [
        f"| `{name}` | {e['head']} | {e['score']:.3f} | {e['reason']} | "
        f"{_own(reading_of(t, e['head']))} |"
        for name, t in data["types"].items()
        for e in t.get("not_labelled") or []
    ]
    if not rows:
        return ["", "Every head at or above a threshold is labelled."]
    return [
        "",
        "Heads at or above a threshold that are not labelled (the type's further criterion "
        "rejected them), with their own effect on the type's task (ablated alone):",
        "",
        "| type | head | score | why not labelled | own effect [95% CI] |",
        "|---|---|---|---|---|",
        *rows,
    ]


def _per_head_rows(data: dict[str, Any], most: int = 8) -> list[str]:
    """Each labelled head's own effect and its attention on ordinary text, per type (the
    first ``most``; catalog.json has every measured head), and the set against the sum."""
    rows = []
    for name, t in data["types"].items():
        per = readings_of(t)
        if not per:
            continue
        v = validation_of(t)
        red = v.redundancy if v is not None else None
        ratio = f"{red.ratio:.2f}" if red is not None and red.ratio is not None else "–"
        cells = []
        for la, h in t["heads"][:most]:
            e = per.get(f"L{la}H{h}")
            b = e.broad if e is not None else None
            share = None if b is None else b.broad_share
            broad = "–" if share is None else f"{share:.2f} / {b.broad_share_4x or 0:.2f}"  # type: ignore[union-attr]
            narrow = " **narrow**" if b is not None and b.narrow else ""
            cells.append(f"L{la}H{h} {_own(e)}, {broad}{narrow}")
        if cells:
            more = f"; … (+{len(t['heads']) - most})" if len(t["heads"]) > most else ""
            rows.append(f"| `{name}` | {'; '.join(cells)}{more} | {ratio} |")
    if not rows:
        return []
    return [
        "",
        "Each labelled head alone: its own effect on the type's task [95% CI], and the share "
        "of its attention on ordinary text (five domains, 64 / 256 tokens) that the type's "
        "pattern takes (**narrow**: under half at both lengths; – : the type has no pattern "
        "outside its probe). Redundancy: the set's effect over the sum of its heads' own "
        "(> 1: they back each other up).",
        "",
        "| type | head: own effect, share on ordinary text | redundancy |",
        "|---|---|---|",
        *rows,
    ]


def _model_section(folder: Path) -> list[str]:
    """One model's part of ``catalog/README.md``: how it was made, then the table."""
    data = json.loads((folder / "catalog.json").read_text())
    run = json.loads((folder / "run.json").read_text())
    prov, m = data["provenance"], data["model"]
    s = run["seconds"]
    lines = [
        f"## {m['name']} ({m['n_layers']} layers x {m['n_heads']} heads)",
        "",
        f"`{run['command']}` (headmech {data['headmech_version']}, weights SHA-256 "
        f"`{prov['model']['weights_sha256'][:16]}…`): load {s['load']:.0f} s, classify and "
        f"validate {s['classify']:.0f} s, check size {s['check']:.0f} s of wall time; "
        f"{run['cpu_seconds']:.0f} CPU seconds on {run['threads']} threads. "
        f"[catalog.json]({m['name']}/catalog.json), [heatmaps]({m['name']}/heatmaps/).",
        "",
        "| type | threshold | heads | labelled heads (score), best first | primary claim: effect "
        "[95% CI] | controls: median (range) | test | verdict | metric |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    from headmech.classification.montecarlo import describe_test

    for name, t in data["types"].items():
        v = validation_of(t)
        c = v.primary if v is not None else None
        effect, control = _validation_cell(c, *((v.controls.kind, v.controls.note) if v else ()))
        metric = f"{c.metric} ({c.mode})" if c is not None else ""
        said = type_verdict(t) if t["heads"] else ""
        test = describe_test(c.test) if c is not None and t["heads"] else ""
        lines.append(
            f"| [`{name}`]({m['name']}/heatmaps/{name}.png) | {t['threshold']:g} | "
            f"{len(t['heads'])} | {_heads_cell(t)} | {effect} | {control} | {test} | {said} | "
            f"{metric} |"
        )
    lines += _verdict_rows(data)
    lines += _not_labelled_rows(data)
    lines += _per_head_rows(data)
    by_reason: dict[str, list[str]] = {}
    for k, reason in run["skipped"].items():  # the same reason once, its types together
        by_reason.setdefault(reason.replace(f"head type '{k}' ", ""), []).append(f"`{k}`")
    if by_reason:
        lines += ["", "Not applicable:", ""]
        lines += [f"- {', '.join(ks)}: {r}." for r, ks in by_reason.items()]
    return [*lines, ""]


_INTRO = """\
# Published head catalogs

Which heads of each bundled model do what, computed by `make catalog`
(`python -m headmech.publish`; about {minutes:.0f} minutes on 2 CPU cores) and committed,
so nothing has to run to look them up. Per model, `<model>/catalog.json` is exactly what
the command shown writes (scores with bootstrap intervals for every head, labels,
type-specific evidence, provenance: versions, weights and probe-data SHA-256);
`<model>/heatmaps/<type>.png` shows each type's score on a fixed scale (0-1; a signed
score diverging from 0), the threshold marked on the colour bar, labelled heads outlined
solid, borderline heads (95% interval containing the threshold) dashed.

**Validation** (`details.validation` in catalog.json): each type names its claims, the
paper's own first (its *primary* claim, whose verdict the tables show; the others are in
`validation.secondary`). Most are ablations: the labelled heads are ablated together (zero,
mean or uniform attention) and the type's task metric (a loss: higher is worse) is
measured, the effect being ablated minus clean with a 95% bootstrap interval over probe
examples. Name movers and negative name movers are tested by path patching to the logits
(Wang et al.), previous-token heads by their writes patched into the induction heads' keys
(Olsson et al.'s K-composition; the ablation is their second claim), attention sinks by a
dose-response over sink-score bins (the first position removed from the heads' attention;
no equal-sized set of non-sinks exists). The same measurement is made on up to 99 random
control sets: relabellings of the labelled heads' layers, never holding a head of the
type, nor of its circuit (the IOI roles together; `validation.circuit_excluded`), nor the
labelled set itself. The test stops once 5 controls are at least as extreme (Besag &
Clifford 1991); p = (1 + exceedances) / (1 + n) (North et al. 2002), and q corrects it by
Benjamini-Hochberg across every claim of the catalog. *validated* means q <= 0.05 and the
effect's interval excludes 0. Each labelled head, and each head above the threshold that
the type's further criterion rejected (`not_labelled`, with the reason), is also ablated
alone (`per_head`); a rejected head whose own effect is within noise is tested for
sufficiency (it alone kept, every other candidate ablated, against one more random head:
`validation.backups`; a backup when its q <= 0.05), and each head is read on ordinary text
of five domains (`per_head[h].broad_share`; HeadVis, Anthropic 2026).

`<model>/check.json` is the same classification at a small size (no validation); the
test suite (`tests/test_published_catalog.py`) regenerates it and compares it (labels
exactly, numbers to 1e-4), and
checks that every registered head type has an entry and a heatmap here, so a change in
the code's results or a new head type fails CI until `make catalog` is run again
(`make catalog CATALOG_MODELS=minilm-l6` redoes one model).
"""


def _across(root: Path, models: Sequence[str]) -> list[str]:
    """The cross-model section: the table of :mod:`headmech.publish.compare` and the types every
    published decoder labels."""
    from headmech.publish.compare import DECODERS, cross_model_rows, cross_model_table, shared_types

    decoders = [m for m in DECODERS if (root / m / "catalog.json").is_file()]
    every = shared_types(cross_model_rows(root, list(models)), decoders)
    return [
        "## Across models",
        "",
        "Per type and model: labelled heads (share of all heads), the median relative depth "
        "of the labelled heads (0 first layer, 1 last), and the validation effect against "
        "the controls' median (n/a: the type does not apply to the model).",
        "",
        cross_model_table(root, [m for m in models if m != "toy-induction"]),
        f"Types with labelled heads in every decoder ({', '.join(decoders)}): "
        f"{', '.join(f'`{n}`' for n in every) or 'none'}.",
    ]


def readme(root: Path, models: Sequence[str]) -> str:
    """``catalog/README.md`` from the published folders of ``models`` under ``root``."""
    folders = [root / m for m in models if (root / m / "catalog.json").is_file()]
    runs = [json.loads((f / "run.json").read_text())["seconds"] for f in folders]
    minutes = sum(sum(s.values()) for s in runs) / 60
    lines = [_INTRO.format(minutes=max(minutes, 1)), *_across(root, models), ""]
    for f in folders:
        lines += _model_section(f)
    return "\n".join(lines)
