"""What each page of the site shows, read from the published files of ``catalog/<model>/``
(``catalog.json``, ``run.json``, ``examples.json``, ``heatmaps/*.png``) and from the
registered head-type classes (definition, citation, threshold). No model is loaded."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headmech.classification.readings import HeadReading, reading_of
from headmech.classification.records import validation_of
from headmech.core.errors import HeadmechError, InputError
from headmech.publish.attention_view import top_attended, top_pairs, view_html
from headmech.publish.examples import ORDINARY, own_types
from headmech.publish.site.writes_view import writes_html

__all__ = [
    "Model",
    "head_page",
    "load_models",
    "rejected_heads",
    "verdict",
    "verdict_counts",
]


@dataclass
class Model:
    """One published catalog: its files, parsed."""

    name: str
    folder: Path
    catalog: dict[str, Any]
    run: dict[str, Any]
    examples: dict[str, Any] | None
    heads: list[str] = field(default_factory=list)  # every head of the model, "L1H0"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.catalog["model"]["n_layers"]), int(self.catalog["model"]["n_heads"])

    @property
    def types(self) -> dict[str, Any]:
        return self.catalog["types"]


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None


def _key(head: list[int] | tuple[int, int]) -> tuple[int, int]:
    return int(head[0]), int(head[1])


def _name(head: list[int] | tuple[int, int]) -> str:
    return f"L{head[0]}H{head[1]}"


def load_models(catalog_dir: Path) -> list[Model]:
    """Every ``catalog_dir/<model>/`` that holds a ``catalog.json`` (the published layout,
    ``catalog/<model>/catalog.json``), sorted by name; or, where ``catalog_dir`` holds a
    ``catalog.json`` itself (a ``headmech classify --out DIR`` folder), that one model,
    named as its catalog names it."""
    catalog_dir = Path(catalog_dir)
    if (catalog_dir / "catalog.json").is_file():
        catalog = _read(catalog_dir / "catalog.json")
        return [_model(catalog_dir, catalog, _page_name(catalog, catalog_dir))]
    models = []
    for path in sorted(catalog_dir.glob("*/catalog.json")):
        models.append(_model(path.parent, _read(path), path.parent.name))
    if not models:
        raise InputError(
            f"no published catalog (*/catalog.json) under {catalog_dir}, nor a catalog.json "
            "in it (a `headmech classify --out` folder)"
        )
    return models


def _model(folder: Path, catalog: Any, name: str) -> Model:
    """The model of ``folder``'s ``catalog.json`` (read as ``catalog``), with its files."""
    if not isinstance(catalog, dict) or not isinstance(catalog.get("types"), dict):
        raise InputError(f"{folder / 'catalog.json'} is not a headmech catalog (no types)")
    examples = folder / "examples.json"
    n_layers = int((catalog.get("model") or {}).get("n_layers", 0))
    n_heads = int((catalog.get("model") or {}).get("n_heads", 0))
    heads = {(la, h) for la in range(n_layers) for h in range(n_heads)}  # every head a page
    heads |= {_key(h) for t in catalog["types"].values() for h in t["heads"]}
    heads |= {_key(_parse(e["head"])) for t in catalog["types"].values() for e in rejected_heads(t)}
    return Model(
        name,
        folder,
        catalog,
        _read(folder / "run.json") if (folder / "run.json").exists() else {},
        _read(examples) if examples.exists() else None,
        [_name(h) for h in sorted(heads)],
    )


def _page_name(catalog: dict[str, Any], folder: Path) -> str:
    """A file name for the model of a ``classify --out`` folder: its catalog's model name
    (the last part of a path; characters other than letters, digits, ``.``, ``_`` and
    ``-`` as ``-``), else the folder's name."""
    raw = str((catalog.get("model") or {}).get("name") or "")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(raw).name).strip(".-")
    return name or folder.resolve().name


def _parse(name: str) -> tuple[int, int]:
    layer, head = str(name).upper().lstrip("L").split("H")
    return int(layer), int(head)


def rejected_heads(t: dict[str, Any]) -> list[dict[str, Any]]:
    """A type's heads at or above the threshold that a further criterion rejected."""
    return list(t.get("not_labelled") or [])


def _own(t: dict[str, Any], head: tuple[int, int]) -> HeadReading:
    """A head's ``per_head`` reading of type ``t`` (its own effect, broad share; an empty
    one where the head has none)."""
    return reading_of(t, _name(head)) or HeadReading()


def verdict_counts(models: list[Model]) -> dict[str, int]:
    """How many (model, type) validations came out each way, for the index."""
    counts: dict[str, int] = {}
    for m in models:
        for t in m.types.values():
            v = validation_of(t)
            said = v.verdict if v is not None else "not run"
            counts[said] = counts.get(said, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _cell(grid: Any, head: tuple[int, int]) -> float | None:
    if not grid:
        return None
    value = grid[head[0]][head[1]]
    return None if value is None else float(value)


def head_row(t: dict[str, Any], head: list[int] | tuple[int, int]) -> dict[str, Any]:
    """A head's score on type ``t`` with its 95% interval (None where not recorded)."""
    h = _key(head)
    interval = t.get("interval") or {}
    own = _own(t, h)
    return {
        "name": _name(h),
        "layer": h[0],
        "score": _cell(t.get("score"), h),
        "low": _cell(interval.get("low"), h),
        "high": _cell(interval.get("high"), h),
        "effect": own.effect,
        "effect_interval": own.interval,
        "broad_share": None if own.broad is None else own.broad.broad_share,
        "broad_share_4x": None if own.broad is None else own.broad.broad_share_4x,
        "narrow": None if own.broad is None else own.broad.narrow,
    }


def validation(t: dict[str, Any], shape: tuple[int, int] | None = None) -> dict[str, Any] | None:
    """The primary claim's effect, its controls, its test and verdict, the other claims'
    verdicts, the backups, and the test drawn as a strip
    (:func:`headmech.publish.site.strips.strip_svg`), or None if not validated."""
    from headmech.classification.montecarlo import describe_test
    from headmech.publish.site.strips import strip_svg

    v = validation_of(t)
    if v is None:
        return None
    c, test = v.primary, v.primary.test
    dose = c.kind == "sink_dose"
    strip = strip_svg(
        c.random_effects if dose else test.controls if test is not None else [],
        c.effect if dose else test.statistic if test is not None else None,
        "lowest sink-score bin sets" if dose else "control sets",
    )
    return {
        "verdict": c.verdict,
        "kind": c.kind,
        "test": describe_test(test),
        "units": test.units if test is not None else "",
        "strip": strip,
        "others": [
            {"kind": k, "verdict": o.verdict, "effect": o.effect, "test": describe_test(o.test)}
            for k, o in v.secondary.items()
        ],
        "unavailable": dict(v.unavailable),
        "backups": [_name(h) for h in v.backup_heads()],
        "effect": c.effect,
        "interval": c.effect_interval,
        "median": c.random_median,
        "range": c.random_range,
        "control": v.controls.kind,
        "note": v.controls.note,
        "metric": c.metric,
        "expected": c.expected,
        "n_heads": c.n_heads,
        "mode": c.mode,
    }


def model_types(m: Model, page_dir: Path) -> list[dict[str, Any]]:
    """Per type of ``m``: threshold, labelled and borderline heads, validation, heatmap; the
    types that label the fewest heads first."""
    n_layers, n_heads = m.shape
    out = []
    for name, t in sorted(m.types.items()):
        png = m.folder / "heatmaps" / f"{name}.png"
        heads = [head_row(t, h) for h in t["heads"]]
        out.append(
            {
                "name": name,
                "reference": t.get("reference", ""),
                "threshold": t.get("threshold"),
                "heads": sorted(heads, key=lambda r: -(r["score"] or 0.0)),
                "borderline": [head_row(t, h) for h in t.get("borderline", [])],
                "not_labelled": [
                    head_row(t, _parse(e["head"])) | {"reason": e["reason"]}
                    for e in rejected_heads(t)
                ],
                "narrow": [r["name"] for r in heads if r["narrow"]],
                "validation": validation(t, (n_layers, n_heads)),
                "heatmap": f"../data/{m.name}/heatmaps/{name}.png" if png.exists() else None,
                "share": len(heads) / (n_layers * n_heads),
                "depth": _depth([r["layer"] for r in heads], n_layers),
            }
        )
    # the specific types first (the fewest heads labelled), those that label none last: a
    # type labelling most heads (attention sinks) no longer opens the page
    return sorted(out, key=lambda r: (not r["heads"], len(r["heads"]), r["name"]))


def _depth(layers: list[int], n_layers: int) -> float | None:
    """Mean relative depth of the layers (0 = first layer, 1 = last)."""
    if not layers:
        return None
    return sum(la / max(n_layers - 1, 1) for la in layers) / len(layers)


def provenance(m: Model) -> dict[str, Any]:
    """Versions, weights hash, probe hashes, git commit and the command behind ``m``."""
    p = m.catalog.get("provenance", {})
    return {
        "versions": p.get("versions", {}),
        "weights": p.get("model", {}).get("weights_sha256", ""),
        "dtype": p.get("model", {}).get("dtype", ""),
        "probes": {k: v.get("data_sha256", "") for k, v in sorted(p.get("probes", {}).items())},
        "n_tokens": {k: v.get("n_tokens") for k, v in p.get("probes", {}).items()},
        "git": p.get("git") or p.get("git_commit"),
        "command": m.run.get("command", ""),
        "seconds": m.run.get("seconds", {}),
        "skipped": p.get("settings", {}).get("skipped", {}),
        "headmech": m.catalog.get("headmech_version", ""),
    }


def _own_details(t: dict[str, Any], head: str) -> list[tuple[str, Any]]:
    """A head's own entries in the type's ``details`` (those keyed by head name, e.g.
    induction's ``copying_effect``: effect and 95% interval), as ``(key, value)``."""
    out = []
    for key, value in sorted((t.get("details") or {}).items()):
        if isinstance(value, dict) and head in value and key != "validation":
            v = value[head]
            if isinstance(v, (int, float, str)) or (
                isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
            ):
                out.append((key, v))
    return out


def verdict(t: dict[str, Any], head: tuple[int, int]) -> tuple[str, str]:
    """What type ``t`` says of ``head``: ``(kind, text)``; kind is ``labelled``,
    ``rejected`` (at or above the threshold, not labelled: the reason), ``borderline``,
    ``above`` (at or above, not labelled, no reason recorded) or ``below``."""
    if head in [_key(x) for x in t["heads"]]:
        return "labelled", "labelled"
    why = [e["reason"] for e in rejected_heads(t) if _parse(e["head"]) == head]
    if why and head in [_key(x) for x in t.get("backups", [])]:
        return "rejected", (
            "at or above the threshold, not labelled: a backup (alone it restores the "
            "type's metric with every other candidate ablated); rejected as: " + why[0]
        )
    if why:
        return "rejected", "at or above the threshold, not labelled: " + why[0]
    if head in [_key(x) for x in t.get("borderline", [])]:
        return "borderline", "borderline: the 95% interval straddles the threshold"
    score, threshold = _cell(t.get("score"), head), t.get("threshold")
    if score is not None and threshold is not None and score >= threshold:
        return "above", "at or above the threshold, not labelled (a further criterion)"
    return "below", "below the threshold"


def _head_type(name: str) -> type | None:
    from headmech.headtypes import get_head_type

    try:
        return get_head_type(name)
    except HeadmechError:  # a plug-in type not installed here
        return None


def head_page(m: Model, head: str) -> dict[str, Any]:
    """One head (labelled or not): its score and verdict on every type, its own effects,
    its views, top tokens, ablation."""
    layer, index = (int(x) for x in head[1:].split("H"))
    h = (layer, index)
    scores, effects = _head_scores(m, head, h)
    own = own_types(m.catalog, h)
    views, tops = _head_views(m, head, own)
    n_layers, n_heads = m.shape
    return {
        "name": head,
        "layer": layer,
        "index": index,
        "scores": scores,
        "effects": effects,
        "views": views,
        "tops": tops,
        "writes_note": (m.examples or {}).get("writes_note"),
        "own": own,
        "own_labelled": bool(own) and all(h in {_key(x) for x in m.types[n]["heads"]} for n in own),
        "prev": f"L{layer}H{index - 1}" if index > 0 else None,
        "next": f"L{layer}H{index + 1}" if index + 1 < n_heads else None,
        "up": f"L{layer - 1}H{index}" if layer > 0 else None,
        "down": f"L{layer + 1}H{index}" if layer + 1 < n_layers else None,
    }


def _head_scores(
    m: Model, head: str, h: tuple[int, int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A head's row on every type (score, verdict, why rejected) and the validations of the
    types that labelled or rejected it."""
    scores, effects = [], []
    for name, t in sorted(m.types.items()):
        row = head_row(t, h) | {"type": name, "threshold": t.get("threshold")}
        kind, said = verdict(t, h)
        row["labelled"] = kind == "labelled"
        row["borderline"] = kind == "borderline"
        row["rejected"] = said.split(": ", 1)[1] if kind == "rejected" else None
        row["verdict"], row["verdict_text"] = kind, said
        row["details"] = _own_details(t, head)
        scores.append(row)
        if (row["labelled"] or row["rejected"]) and (v := validation(t, m.shape)):
            effects.append(v | {"type": name, "own": row, "labelled": row["labelled"]})
    return scores, effects


def _head_views(m: Model, head: str, own: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """A head's attention views and top attended tokens on the example texts: its own
    types' probes first (an IOI prompt for a name mover, the needle for a retrieval head),
    then the ordinary texts."""
    views, tops = [], []
    ex = m.examples or {}
    patterns = ex.get("heads", {}).get(head, [])  # none: examples.json predates the head
    writes = ex.get("writes", {}).get(head, [])
    probes = {name: str(getattr(_head_type(name), "probe", "")) for name in own}
    shown = [
        (i, text, rows)
        for i, (text, rows) in enumerate(zip(ex.get("texts", []), patterns, strict=False))
        if rows is not None
    ]
    wrote = dict(enumerate(writes))
    shown.sort(
        key=lambda x: (x[1]["probe"] not in probes.values(), x[1]["probe"] in ORDINARY, x[0])
    )
    for i, text, rows in shown:
        of = [name for name, probe in probes.items() if probe == text["probe"]]
        title = f"{head} on {text['probe']} ({len(text['tokens'])} tokens)"
        if of:
            title += f": the probe of {', '.join(of)}"
        views.append(
            view_html(
                text["tokens"],
                rows,
                title=title,
                view_id=f"view-{i}",
                ids=text.get("ids"),
                text_ref=f"{m.name}/{i}",  # assets/texts.js: one copy of each text
            )
            + writes_html(text["tokens"], wrote.get(i))
        )
        tops.append(
            {
                "probe": text["probe"],
                "top": top_attended(text["tokens"], rows),
                "pairs": top_pairs(text["tokens"], rows) if of else [],  # on its own probe
            }
        )
    return views, tops
