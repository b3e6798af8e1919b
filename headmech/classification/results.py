"""The catalog a classification produces: per type, scores, intervals, labels, evidence.

:class:`HeadCatalog` round-trips through ``catalog.json`` (``load(save(x)) == x``; schema
in docs/architecture.md). Every type's score comes with a bootstrap interval over probe
examples (:mod:`headmech.stream.uncertainty`), and a head whose interval straddles the type's
threshold is listed as *borderline*. The ``provenance`` record names the weights, probe
data, versions and settings (:mod:`headmech.runs.provenance`); applying a catalog to a model
with other weights is refused unless forced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.classification.readings import HeadReading, readings_of
from headmech.classification.records import TypeValidation
from headmech.core.errors import CatalogFileError
from headmech.core.head_index import HeadIndex
from headmech.headtypes.base import at_or_above
from headmech.models import ModelInfo, model_info
from headmech.runs.files import FileSchema, ResultFile
from headmech.runs.provenance import SCHEMA_VERSION, check_weights

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["HeadCatalog", "TypeResult", "score_ranges"]


# catalog.json (schema in docs/architecture.md); CatalogFileError when it cannot be read
CATALOG_FILE = FileSchema(
    "catalog", "catalog.json", SCHEMA_VERSION, required=("model", "types"), error=CatalogFileError
)


def _grid(t: Tensor) -> list[list[float | None]]:
    return [[None if v != v else round(float(v), 6) for v in row] for row in t.tolist()]


def _tensor(rows: Any, shape: tuple[int, int], what: str) -> Tensor:
    t = torch.tensor([[float("nan") if v is None else float(v) for v in row] for row in rows])
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {shape}")
    return t


def _heads(pairs: Any, shape: tuple[int, int], what: str) -> list[HeadIndex]:
    heads = [HeadIndex(int(lh[0]), int(lh[1])) for lh in pairs]
    for h in heads:
        if not (0 <= h.layer < shape[0] and 0 <= h.head < shape[1]):
            raise ValueError(f"{what} names head {list(h)} outside the model")
    return heads


def _not_labelled(entries: Any, shape: tuple[int, int], name: str) -> list[dict[str, Any]]:
    """``not_labelled`` of a type's entry: each a head inside the model, with a reason."""
    out = []
    for e in entries:
        head = HeadIndex.parse(str(e["head"]))
        _heads([head], shape, f"type '{name}' not_labelled")
        out.append({"head": str(head), "score": float(e["score"]), "reason": str(e["reason"])})
    return out


def _per_head_record(entries: Any, shape: tuple[int, int], name: str) -> dict[str, HeadReading]:
    """``per_head`` of a type's entry: keyed by heads inside the model."""
    if not isinstance(entries, dict):
        raise ValueError(f"type '{name}' per_head is not an object")
    for key in entries:
        _heads([HeadIndex.parse(key)], shape, f"type '{name}' per_head")
    try:
        return readings_of({"per_head": entries})
    except ValueError as e:
        raise ValueError(f"type '{name}' per_head: {e}") from None


def score_ranges(names: Any) -> dict[str, tuple[float, float]]:
    """The fixed range each of ``names`` is drawn on: its registered type's
    ``HeadType.score_range``; (0, 1) for a name no type is registered under."""
    from headmech.headtypes.registry import head_types

    known = head_types()
    return {n: tuple(known[n].score_range) if n in known else (0.0, 1.0) for n in names}  # type: ignore[misc]


@dataclass
class TypeResult:
    """One head type's verdict on a model.

    Attributes:
        name, reference: the type and its citation.
        threshold: the decision threshold on ``score``.
        score: ``[n_layers, n_heads]``.
        heads: labelled heads, best first.
        details: type-specific evidence (written with ``validation`` inside it).
        low, high: the bootstrap interval of ``score`` over probe examples (None when the
            probe kept no per-example statistics).
        borderline: heads whose interval contains the threshold and that no further
            criterion of the type rejects.
        not_labelled: every head at or above the threshold that is not labelled, best
            first, as ``{"head": "L5H1", "score": ..., "reason": ...}``: the further
            criterion it failed, with its value (:meth:`HeadType.rejected`).
        per_head: with validation, each labelled head's own effect (ablated alone) and
            each not-labelled head's, and their readings on ordinary text, by head name
            (:class:`~headmech.classification.readings.HeadReading`: ``per_head["L18H6"].effect``).
        backups: with validation, heads at or above the threshold, not labelled, whose
            own effect is within noise but which alone restore the type's metric when
            every other candidate is ablated, beyond random heads (the role *backup*:
            :mod:`headmech.classification.backups`).
        validation: the causal validation, when validated
            (:class:`~headmech.classification.records.TypeValidation`).
    """

    name: str
    reference: str
    threshold: float
    score: Float[Tensor, "n_layers n_heads"]
    heads: list[HeadIndex]
    details: dict[str, Any] = field(default_factory=dict)
    low: Float[Tensor, "n_layers n_heads"] | None = None
    high: Float[Tensor, "n_layers n_heads"] | None = None
    borderline: list[HeadIndex] = field(default_factory=list)
    not_labelled: list[dict[str, Any]] = field(default_factory=list)
    per_head: dict[str, HeadReading] = field(default_factory=dict)
    backups: list[HeadIndex] = field(default_factory=list)
    validation: TypeValidation | None = None

    def set_validation(self, v: TypeValidation) -> None:
        """Keep a validation: the record, each head measured alone (``per_head``, where
        the broad readings join it) and the backups it found."""
        self.validation = v
        self.per_head = {k: HeadReading(e.labelled, e) for k, e in v.per_head.items()}
        self.backups = [HeadIndex(a, b) for a, b in v.backup_heads()]

    def not_controls(self) -> set[HeadIndex]:
        """Heads that may be of this type, which no control set may hold: the labelled,
        those at or above the threshold (labelled or not), and those whose interval
        reaches it."""
        reach = self.score if self.high is None else torch.maximum(self.score, self.high)
        reach = torch.nan_to_num(reach, nan=float("-inf"))
        at = at_or_above(reach, self.threshold).nonzero().tolist()
        out = {HeadIndex(int(a), int(b)) for a, b in at}
        return out | set(self.heads) | {HeadIndex.parse(str(r["head"])) for r in self.not_labelled}

    def to_json(self) -> dict[str, Any]:
        """This type's entry in ``catalog.json``."""
        out: dict[str, Any] = {
            "reference": self.reference,
            "threshold": self.threshold,
            "score": _grid(self.score),
            "heads": [[h.layer, h.head] for h in self.heads],
            "borderline": [[h.layer, h.head] for h in self.borderline],
            "not_labelled": self.not_labelled,
            "per_head": {k: r.to_json() for k, r in self.per_head.items()},
            "details": dict(self.details),
        }
        if self.validation is not None:
            out["details"]["validation"] = self.validation.to_json()
        if self.backups:  # heads found to back the type up (validation's sufficiency test)
            out["backups"] = [[h.layer, h.head] for h in self.backups]
        if self.low is not None and self.high is not None:
            out["interval"] = {"low": _grid(self.low), "high": _grid(self.high)}
        return out

    @classmethod
    def from_json(cls, name: str, t: dict[str, Any], shape: tuple[int, int]) -> TypeResult:
        """Parse one type's entry (``ValueError``/``KeyError`` on a malformed one)."""
        if not isinstance(t, dict):
            raise ValueError(f"type '{name}' is not an object")
        score = _tensor(t["score"], shape, f"type '{name}' score")
        interval = t.get("interval")
        low = high = None
        details = dict(t.get("details", {}))
        v = details.pop("validation", None)
        validation = None if v is None else TypeValidation.from_json(v)
        if interval is not None:
            low = _tensor(interval["low"], shape, f"type '{name}' interval")
            high = _tensor(interval["high"], shape, f"type '{name}' interval")
        return cls(
            name,
            str(t.get("reference", "")),
            float(t["threshold"]),
            score,
            _heads(t["heads"], shape, f"type '{name}'"),
            details,
            low,
            high,
            _heads(t.get("borderline", []), shape, f"type '{name}' borderline"),
            _not_labelled(t.get("not_labelled", []), shape, name),
            _per_head_record(t.get("per_head", {}), shape, name),
            _heads(t.get("backups", []), shape, f"type '{name}' backups"),
            validation,
        )


@dataclass(eq=False)
class HeadCatalog(ResultFile):
    """Scores and labels of every head for several head types.

    Attributes:
        model: name and shape of the model.
        types: results by head type name.
        meta: how it was computed (probe sizes, seconds); not written to JSON.
        provenance: weights, probe data, versions and settings (written to JSON).
    """

    model: ModelInfo
    types: dict[str, TypeResult]
    meta: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    SCHEMA = CATALOG_FILE

    def __getitem__(self, name: str) -> TypeResult:
        return self.types[name]

    def heads(self, type_name: str) -> list[HeadIndex]:
        """The heads labelled with ``type_name``, best first."""
        return self.types[type_name].heads

    def labels(self) -> dict[HeadIndex, list[str]]:
        """Head → the types it is labelled with."""
        out: dict[HeadIndex, list[str]] = {}
        for name, r in self.types.items():
            for h in r.heads:
                out.setdefault(h, []).append(name)
        return dict(sorted(out.items()))

    def check_model(self, model: TransformerBridge, *, force: bool = False) -> None:
        """Refuse a model of another shape, or (unless ``force``) with other weights than
        the catalog was computed on (one-line :class:`~headmech.core.errors.HeadmechError`)."""
        from headmech.core.errors import HeadmechError

        shape = (int(model.cfg.n_layers), int(model.cfg.n_heads))
        if shape != (self.model.n_layers, self.model.n_heads):
            raise HeadmechError(
                f"the catalog describes a model of {self.model.n_layers}x{self.model.n_heads} "
                f"heads, this one has {shape[0]}x{shape[1]}"
            )
        if force:
            return
        check_weights(self.provenance, model, f"the catalog of {self.model.name}")
        name = model_info(model).name
        if (
            not (self.provenance.get("model") or {}).get("weights_sha256")
            and name != self.model.name
        ):
            from headmech.core.checks import warn

            warn(
                f"the catalog was made for model '{self.model.name}', this is '{name}' (same "
                f"{shape[0]}x{shape[1]} heads) and it records no weights hash to tell them "
                "apart: applied all the same (--force / force=True: no warning)"
            )

    # --- JSON (headmech.runs.files: the header, save, load, equality) -----------
    def _body(self) -> dict[str, Any]:
        """The ``catalog.json`` contents but for the header (schema in docs/architecture.md)."""
        return {
            "model": {
                "name": self.model.name,
                "n_layers": self.model.n_layers,
                "n_heads": self.model.n_heads,
            },
            "types": {name: r.to_json() for name, r in self.types.items()},
            # a stopped run's finished part: why it stopped (absent when whole)
            **({"incomplete": self.meta["incomplete"]} if "incomplete" in self.meta else {}),
        }

    def _figures(self, folder: Path) -> None:
        if self.types:
            self.heatmap(folder / "heatmap.png")

    def save(self, path: str | os.PathLike) -> Path:
        """Write what ``headmech classify`` writes: a directory gets ``catalog.json`` and
        ``heatmap.png``; a path ending in ``.json`` gets the JSON alone. Returns the JSON
        path. The same catalog always gives the same bytes."""
        return super().save(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadCatalog:
        """Read a ``catalog.json``; a one-line :class:`CatalogFileError` if it is corrupt."""
        return super().load(path)

    @classmethod
    def _from_json(cls, data: dict[str, Any]) -> HeadCatalog:
        m = data["model"]
        shape = (int(m["n_layers"]), int(m["n_heads"]))
        if min(shape) < 1:
            raise ValueError(f"a model of {shape[0]}x{shape[1]} heads")
        types = {n: TypeResult.from_json(n, t, shape) for n, t in data["types"].items()}
        info = ModelInfo(str(m["name"]), shape[0], shape[1], shape[1], 0, 0, True)
        prov = data.get("provenance", {})
        if not isinstance(prov, dict):
            raise ValueError("provenance is not an object")
        return cls(info, types, provenance=prov)

    # --- display ----------------------------------------------------------------
    def table(self, max_heads: int = 8) -> str:
        """A plain-text table: per type, its labelled heads with scores."""
        rows = [("type", "reference", "thr", "#heads", "top heads (score)")]
        for name, r in self.types.items():
            top = ", ".join(f"{h} {float(r.score[h]):.2f}" for h in r.heads[:max_heads])
            if len(r.heads) > max_heads:
                top += f", ... (+{len(r.heads) - max_heads})"
            if not r.heads:
                best = torch.nan_to_num(r.score, nan=float("-inf"))
                flat = int(best.argmax())
                h = HeadIndex(flat // r.score.shape[1], flat % r.score.shape[1])
                top = f"none (best {h} {float(r.score[h]):.2f})"
            if r.borderline:
                top += f"; borderline: {', '.join(map(str, r.borderline[:4]))}"
            if r.not_labelled:  # at or above the threshold, rejected by a further criterion
                why = ", ".join(
                    f"{e['head']} {e['score']:.2f} ({e['reason'].split(' (')[0]})"
                    for e in r.not_labelled[:3]
                )
                more = f", ... (+{len(r.not_labelled) - 3})" if len(r.not_labelled) > 3 else ""
                top += f"; not labelled: {why}{more}"
            rows.append((name, r.reference, f"{r.threshold:g}", str(len(r.heads)), top))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = []
        for k, row in enumerate(rows):
            cells = "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True))
            lines.append(cells + "  " + row[4])
            if k == 0:
                lines.append("-" * (sum(widths) + 8 + len(row[4])))
        return "\n".join(lines)

    def heatmap(self, path: str | os.PathLike | None = None) -> Any:
        """A seaborn layer x head heatmap per type on a fixed scale, the threshold marked
        (:func:`headmech.core.plot.type_heatmap`); saved to ``path`` if given."""
        from headmech.core.plot import catalog_heatmap

        return catalog_heatmap(self, path, ranges=score_ranges(self.types))

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}: {len(v.heads)}" for k, v in self.types.items())
        return (
            f"HeadCatalog({self.model.name}, {self.model.n_layers}x{self.model.n_heads}; {counts})"
        )
