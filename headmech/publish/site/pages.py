"""What each page of the site shows, read from the published files of ``catalog/<model>/``
(``catalog.json``, ``run.json``, ``examples.json``, ``heatmaps/*.png``) and from the
registered head-type classes (definition, citation, threshold). No model is loaded."""

from __future__ import annotations

import inspect
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headmech.core.errors import InputError
from headmech.publish.attention_view import top_attended, view_html

__all__ = ["Model", "head_page", "load_models", "type_info", "verdict_counts"]


@dataclass
class Model:
    """One published catalog: its files, parsed."""

    name: str
    folder: Path
    catalog: dict[str, Any]
    run: dict[str, Any]
    examples: dict[str, Any] | None
    heads: list[str] = field(default_factory=list)  # labelled or rejected heads, "L1H0"

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
    """Every ``catalog_dir/<model>/`` that holds a ``catalog.json``, sorted by name."""
    models = []
    for path in sorted(catalog_dir.glob("*/catalog.json")):
        folder = path.parent
        examples = folder / "examples.json"
        catalog = _read(path)
        heads = {_key(h) for t in catalog["types"].values() for h in t["heads"]}
        heads |= {_key(_parse(e["head"])) for t in catalog["types"].values() for e in _rejected(t)}
        ordered = sorted(heads)
        models.append(
            Model(
                folder.name,
                folder,
                catalog,
                _read(folder / "run.json") if (folder / "run.json").exists() else {},
                _read(examples) if examples.exists() else None,
                [_name(h) for h in ordered],
            )
        )
    if not models:
        raise InputError(f"no published catalog (*/catalog.json) under {catalog_dir}")
    return models


def _parse(name: str) -> tuple[int, int]:
    layer, head = str(name).upper().lstrip("L").split("H")
    return int(layer), int(head)


def _rejected(t: dict[str, Any]) -> list[dict[str, Any]]:
    """A type's heads at or above the threshold that a further criterion rejected."""
    return list(t.get("not_labelled") or [])


def _own(t: dict[str, Any], head: tuple[int, int]) -> dict[str, Any]:
    """A head's ``per_head`` record of type ``t`` (its own effect, broad share), or {}."""
    return dict((t.get("per_head") or {}).get(_name(head), {}))


def verdict_counts(models: list[Model]) -> dict[str, int]:
    """How many (model, type) validations came out each way, for the index."""
    counts: dict[str, int] = {}
    for m in models:
        for t in m.types.values():
            v = validation(t, m.shape)
            said = v["verdict"] if v else "not run"
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
        "effect": own.get("effect"),
        "effect_interval": own.get("interval"),
        "broad_share": own.get("broad_share"),
        "broad_share_4x": own.get("broad_share_4x"),
        "narrow": own.get("narrow"),
    }


def validation(t: dict[str, Any], shape: tuple[int, int] | None = None) -> dict[str, Any] | None:
    """The labelled set's ablation effect, its controls and the verdict
    (:func:`headmech.classification.claims.verdict`; for a record written before verdicts were, the
    distinct control sets possible are counted from the model's ``shape``), or None if not
    validated."""
    from headmech.classification.claims import control_space, verdict

    v = t.get("details", {}).get("validation")
    if not v:
        return None
    said = v.get("verdict")
    if said is None:
        possible = None
        if shape is not None:
            _, possible = control_space(
                t["heads"], *shape, v.get("control", "none"), v.get("excluded_from_controls", [])
            )
        said = verdict(v, possible)
    k = v.get("k_composition") or {}
    return {
        "verdict": said,
        "k_verdict": k.get("verdict"),
        "k_effect": k.get("effect"),
        "k_receivers": [_name(r) for r in k.get("receivers", [])] if k.get("verdict") else [],
        "effect": v.get("effect"),
        "interval": v.get("effect_interval"),
        "median": v.get("random_median"),
        "range": v.get("random_range"),
        "control": v.get("control"),
        "note": v.get("control_note") or "",
        "metric": v.get("metric", ""),
        "expected": v.get("expected", ""),
        "n_heads": v.get("n_heads"),
        "mode": v.get("mode", ""),
    }


def model_types(m: Model, page_dir: Path) -> list[dict[str, Any]]:
    """Per type of ``m``: threshold, labelled and borderline heads, validation, heatmap."""
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
                    head_row(t, _parse(e["head"])) | {"reason": e["reason"]} for e in _rejected(t)
                ],
                "narrow": [r["name"] for r in heads if r["narrow"]],
                "validation": validation(t, (n_layers, n_heads)),
                "heatmap": os.path.relpath(png, page_dir).replace(os.sep, "/")
                if png.exists()
                else None,
                "share": len(heads) / (n_layers * n_heads),
                "depth": _depth([r["layer"] for r in heads], n_layers),
            }
        )
    return out


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


def _threshold_why(cls: type) -> list[str]:
    """The docstring paragraphs about the threshold, and the comment on the line that sets
    ``default_threshold`` in the class's source."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    why = [p.replace("\n", " ") for p in doc.split("\n\n") if "threshold" in p.lower()]
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    comment = re.search(r"default_threshold\s*=\s*[^#\n]*#\s*(.+)", source)
    return ([comment[1].strip()] if comment else []) + why


def type_info(name: str) -> dict[str, Any]:
    """A registered type's definition, citation and default threshold (empty fields when
    the type is no longer registered)."""
    from headmech.headtypes.registry import head_types

    cls = head_types().get(name)
    if cls is None:
        return {"name": name, "description": "", "definition": [], "citation": "", "why": []}
    doc = inspect.cleandoc(cls.__doc__ or "").split("References:")[0]
    return {
        "name": name,
        "description": cls.description,
        "definition": [p.replace("\n", " ") for p in doc.split("\n\n") if p.strip()],
        "citation": cls.citation or cls.reference,
        "reference": cls.reference,
        "default_threshold": cls.default_threshold,
        "threshold_note": getattr(cls, "threshold_note", ""),
        "probe": cls.probe,
        "task": cls.task,
        "why": _threshold_why(cls),
    }


def head_page(m: Model, head: str) -> dict[str, Any]:
    """One labelled head: its score on every type, its views, top tokens, ablation."""
    layer, index = (int(x) for x in head[1:].split("H"))
    h = (layer, index)
    scores, effects = [], []
    for name, t in sorted(m.types.items()):
        labelled = [_key(x) for x in t["heads"]]
        row = head_row(t, h) | {"type": name, "threshold": t.get("threshold")}
        row["labelled"] = h in labelled
        row["borderline"] = h in [_key(x) for x in t.get("borderline", [])]
        why = [e["reason"] for e in _rejected(t) if _parse(e["head"]) == h]
        row["rejected"] = why[0] if why else None
        scores.append(row)
        if (row["labelled"] or why) and (v := validation(t, m.shape)):
            effects.append(v | {"type": name, "own": row, "labelled": row["labelled"]})
    views, tops = [], []
    ex = m.examples or {}
    patterns = ex.get("heads", {}).get(head, [])  # none: examples.json predates the head
    for i, (text, rows) in enumerate(zip(ex.get("texts", []), patterns, strict=False)):
        title = f"{head} on {text['probe']} ({len(text['tokens'])} tokens)"
        views.append(view_html(text["tokens"], rows, title=title, view_id=f"view-{i}"))
        tops.append({"probe": text["probe"], "top": top_attended(text["tokens"], rows)})
    return {"name": head, "scores": scores, "effects": effects, "views": views, "tops": tops}
