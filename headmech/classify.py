"""Classify every head of a model into catalog head types.

:func:`classify` groups the requested types by probe, builds each probe once, streams
all of that probe's statistics in one set of forward passes, then lets each type score
and label the heads. The result, :class:`HeadCatalog`, round-trips through
``catalog.json`` (schema in docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.errors import CatalogFileError, HeadmechError
from headmech.heads import HeadIndex, HeadType, collect_statistics, resolve_types
from headmech.models import ModelInfo, model_info
from headmech.probes import ProbeOptions, build_probe

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["HeadCatalog", "TypeResult", "classify", "validate_heads"]

SCHEMA_VERSION = "0.1.0"


@dataclass
class TypeResult:
    """One head type's verdict on a model."""

    name: str
    reference: str
    threshold: float
    score: Float[Tensor, "n_layers n_heads"]
    heads: list[HeadIndex]
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """This type's entry in ``catalog.json``."""
        score = [
            [None if v != v else round(float(v), 6) for v in row] for row in self.score.tolist()
        ]
        return {
            "reference": self.reference,
            "threshold": self.threshold,
            "score": score,
            "heads": [[h.layer, h.head] for h in self.heads],
            "details": self.details,
        }


@dataclass
class HeadCatalog:
    """Scores and labels of every head for several head types.

    Attributes:
        model: name and shape of the model.
        types: results by head type name.
        meta: how it was computed (probe sizes, seconds); not part of the JSON contract.
    """

    model: ModelInfo
    types: dict[str, TypeResult]
    meta: dict[str, Any] = field(default_factory=dict)

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

    # --- JSON -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The ``catalog.json`` contents (schema in docs/architecture.md)."""
        from headmech._version import __version__

        return {
            "headmech_version": __version__,
            "model": {
                "name": self.model.name,
                "n_layers": self.model.n_layers,
                "n_heads": self.model.n_heads,
            },
            "types": {name: r.to_json() for name, r in self.types.items()},
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write what ``headmech classify`` writes: a directory gets ``catalog.json`` and
        ``heatmap.png``; a path ending in ``.json`` gets the JSON alone. Returns the JSON
        path."""
        p = Path(path)
        if p.suffix == ".json":
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(self.to_json(), indent=1) + "\n")
            return p
        p.mkdir(parents=True, exist_ok=True)
        (p / "catalog.json").write_text(json.dumps(self.to_json(), indent=1) + "\n")
        if self.types:
            self.heatmap(p / "heatmap.png")
        return p / "catalog.json"

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadCatalog:
        """Read a ``catalog.json``; a one-line :class:`CatalogFileError` if it is corrupt."""
        p = Path(path)
        if p.is_dir():
            p = p / "catalog.json"
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise CatalogFileError(f"no catalog file at {p}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CatalogFileError(f"{p} is not valid JSON: {e}") from None
        try:
            m = data["model"]
            n_layers, n_heads = int(m["n_layers"]), int(m["n_heads"])
            types = {}
            for name, t in data["types"].items():
                score = torch.tensor(
                    [[float("nan") if v is None else float(v) for v in row] for row in t["score"]]
                )
                if tuple(score.shape) != (n_layers, n_heads):
                    raise ValueError(
                        f"type '{name}' has a score of shape {tuple(score.shape)}, expected {(n_layers, n_heads)}"
                    )
                heads = [HeadIndex(int(lh[0]), int(lh[1])) for lh in t["heads"]]
                for h in heads:
                    if not (0 <= h.layer < n_layers and 0 <= h.head < n_heads):
                        raise ValueError(f"type '{name}' labels head {list(h)} outside the model")
                types[name] = TypeResult(
                    name,
                    str(t.get("reference", "")),
                    float(t["threshold"]),
                    score,
                    heads,
                    dict(t.get("details", {})),
                )
            info = ModelInfo(str(m["name"]), n_layers, n_heads, n_heads, 0, 0, True)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise CatalogFileError(f"{p} is not a headmech catalog: {e!s}") from None
        return cls(info, types)

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
            rows.append((name, r.reference, f"{r.threshold:g}", str(len(r.heads)), top))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = []
        for k, row in enumerate(rows):
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
            )
            if k == 0:
                lines.append("-" * (sum(widths) + 8 + len(row[4])))
        return "\n".join(lines)

    def heatmap(self, path: str | os.PathLike | None = None) -> Any:
        """A seaborn layer x head heatmap per type; saved to ``path`` if given."""
        from headmech.plot import catalog_heatmap

        return catalog_heatmap(self, path)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}: {len(v.heads)}" for k, v in self.types.items())
        return (
            f"HeadCatalog({self.model.name}, {self.model.n_layers}x{self.model.n_heads}; {counts})"
        )


def validate_heads(
    model: TransformerBridge,
    head_type: HeadType,
    heads: Sequence[HeadIndex],
    options: ProbeOptions,
    *,
    n_random: int = 5,
    mode: str | None = None,
    control: str = "same_layers",
) -> dict[str, Any]:
    """Ablate the labelled heads, and ``n_random`` draws of as many other heads, and
    measure the type's task metric (higher is worse) each time.

    All sets ride in the same batched forward passes
    (:func:`headmech.interventions.run_variants`).

    Args:
        control: ``"same_layers"`` draws each random set from the labelled heads' layers
            (depth alone changes ablation effects a lot); ``"any"`` from every layer.

    Returns:
        ``{"metric", "mode", "control", "clean", "ablated", "effect", "random_effects",
        "random_mean", "n_heads"}``; ``effect`` is ablated minus clean.
    """
    if control not in ("same_layers", "any"):
        raise ValueError(f"control must be 'same_layers' or 'any', got {control!r}")
    from headmech.ablation import random_heads
    from headmech.attribution.ablation import ablate_sets
    from headmech.tasks import get_task

    mode = mode or head_type.ablation
    info = model_info(model)
    task = get_task(head_type.task, model)
    batches = task.batches(model, options)
    g = torch.Generator().manual_seed(options.seed)
    controls = [
        random_heads(info.n_layers, info.n_heads, len(heads), exclude=heads, generator=g)
        for _ in range(n_random if heads else 0)
    ]
    sets = [list(heads), *controls] if heads else []
    values, clean = ablate_sets(model, task, batches, sets, mode)  # type: ignore[arg-type]
    ablated = float(values[0]) if heads else clean
    rand = [float(v) - clean for v in values[1:]]
    return {
        "metric": task.description,
        "mode": mode,
        "control": control,
        "clean": round(clean, 6),
        "ablated": round(ablated, 6),
        "effect": round(ablated - clean, 6),
        "random_effects": [round(r, 6) for r in rand],
        "random_mean": round(sum(rand) / len(rand), 6) if rand else None,
        "n_heads": len(heads),
    }


def _runnable(
    types: Sequence[str | HeadType | type[HeadType]] | str | None, info: ModelInfo
) -> tuple[list[HeadType], dict[str, str]]:
    """The requested types that fit the model; a type the user named that does not fit is
    an error, a default type that does not fit is skipped with its reason."""
    runnable: list[HeadType] = []
    skipped: dict[str, str] = {}
    for t in resolve_types(types):
        reason = t.check_model(info)
        if reason is None:
            runnable.append(t)
        elif types is not None:
            raise HeadmechError(reason)
        else:
            skipped[t.name] = reason
    return runnable, skipped


def _classify_probe(
    model: TransformerBridge,
    probe_name: str,
    group: list[HeadType],
    options: ProbeOptions,
    progress: bool,
) -> tuple[dict[str, tuple[Tensor, list[HeadIndex], dict[str, Any]]], dict[str, Any]]:
    """Build one probe, stream its types' statistics in one set of passes, score and label."""
    t0 = time.perf_counter()
    probe = build_probe(probe_name, model, options)
    t1 = time.perf_counter()
    desc = f"{probe_name} ({', '.join(t.name for t in group)})" if progress else False
    stats = collect_statistics(group, model, probe.batches, progress=desc)
    meta = {
        "n_sequences": probe.n_sequences,
        "n_tokens": probe.n_tokens,
        "build_seconds": round(t1 - t0, 3),
        "stream_seconds": round(time.perf_counter() - t1, 3),
        **probe.info,
    }
    out = {}
    for t in group:
        score = t.score(stats)
        heads = t.select(score, stats)
        out[t.name] = (score, heads, t.details(stats, score, heads))
    return out, meta


def classify(
    model: TransformerBridge,
    types: Sequence[str | HeadType | type[HeadType]] | str | None = None,
    *,
    validate: bool = False,
    n_random: int = 5,
    progress: bool = False,
    **probe_options: Any,
) -> HeadCatalog:
    """Score and label every head of ``model`` for each head type.

    Args:
        model: a bridge from :func:`headmech.load_model`.
        types: names, classes or instances (default: every registered type that can run
            on this model; types needing a decoder are skipped on encoders).
        validate: also ablate each type's labelled heads and ``n_random`` sets of as
            many random heads, and record the effects on the type's task metric in
            ``details["validation"]`` (see :func:`validate_heads`).
        n_random: random draws for validation.
        progress: show progress bars.
        **probe_options: fields of :class:`headmech.probes.ProbeOptions` (``corpus``,
            ``n_sentences``, ``n_sequences``, ``half_len``, ``batch_size``, ``seed``).

    Returns:
        A :class:`HeadCatalog`.

    Examples:
        >>> cat = headmech.classify(model, ["previous_token"], n_sentences=32)  # doctest: +SKIP
        >>> cat.heads("previous_token")  # doctest: +SKIP
        [HeadIndex(layer=0, head=3)]
    """
    try:
        options = ProbeOptions(**probe_options)
    except TypeError as e:
        raise HeadmechError(f"unknown probe option: {e}") from None
    info = model_info(model)
    runnable, skipped = _runnable(types, info)
    by_probe: dict[str, list[HeadType]] = {}
    for t in runnable:
        by_probe.setdefault(t.probe, []).append(t)
    results: dict[str, TypeResult] = {}
    meta: dict[str, Any] = {"skipped": skipped, "probes": {}}
    for probe_name, group in by_probe.items():
        found, meta["probes"][probe_name] = _classify_probe(
            model, probe_name, group, options, progress
        )
        for t in group:
            score, heads, details = found[t.name]
            if validate:
                details["validation"] = validate_heads(model, t, heads, options, n_random=n_random)
            results[t.name] = TypeResult(t.name, t.reference, t.threshold, score, heads, details)
    ordered = {t.name: results[t.name] for t in runnable}
    return HeadCatalog(info, ordered, meta)
