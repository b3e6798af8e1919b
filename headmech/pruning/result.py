"""The result every pruning method returns: a trajectory of kept heads and the metric."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headmech.core.errors import HeadmechError
from headmech.runs.provenance import SCHEMA_VERSION, dumps

__all__ = ["PruningResult"]


@dataclass
class PruningResult:
    """A pruning trajectory; ``save(dir)`` writes ``pruning.json`` (docs/architecture.md) and a curve.

    Attributes:
        method, task: names.
        steps: ``{"n_kept", "heads_kept", "metric"}`` per step (plus method-specific keys
            such as ``lambda``); step 0 is the full model.
        survival: head type → fraction of its labelled heads kept at each step.
        n_heads_total: heads in the model.
        metric: what ``metric`` measures (a loss: higher is worse).
        model: the model's short name.
        extra: method-specific results written at the top level of ``pruning.json``
            (MAE: ``comparison``).
        provenance: weights, probe data, versions, settings (:mod:`headmech.runs.provenance`).
    """

    method: str
    task: str
    steps: list[dict[str, Any]]
    survival: dict[str, list[float]] = field(default_factory=dict)
    n_heads_total: int = 0
    metric: str = ""
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def removable_fraction(self, tolerance: float = 0.05) -> float:
        """Fraction of heads removed at the last step before the metric first exceeds
        ``clean * (1 + tolerance)``.

        A metric that is 0 on the clean model (the encoder ``lm`` task's ``1 - cos``
        against the clean embedding; ``|clean| < 1e-4``) has no relative scale, so the
        bound is then ``tolerance`` itself (cosine to the clean embedding >= 0.95).
        """
        if not self.steps:
            return 0.0
        clean = float(self.steps[0]["metric"])
        bound = clean * (1.0 + tolerance) if abs(clean) >= 1e-4 else tolerance
        best = self.n_heads_total
        for s in self.steps:
            if float(s["metric"]) > bound:
                break
            best = int(s["n_kept"])
        return 1.0 - best / max(self.n_heads_total, 1)

    def to_dict(self) -> dict[str, Any]:
        """The ``pruning.json`` contents."""
        steps = []
        for s in self.steps:
            row = {
                "n_kept": int(s["n_kept"]),
                "heads_kept": [[int(a), int(b)] for a, b in s["heads_kept"]],
                "metric": round(float(s["metric"]), 6),
            }
            row.update({k: v for k, v in s.items() if k not in row})
            steps.append(row)
        return json.loads(
            dumps(
                {
                    "schema_version": SCHEMA_VERSION,
                    "method": self.method,
                    "task": self.task,
                    "steps": steps,
                    "survival": self.survival,
                    "model": self.model,
                    "n_heads_total": self.n_heads_total,
                    "metric_description": self.metric,
                    "removable_at_5pct": self.removable_fraction(0.05),
                    "provenance": self.provenance,
                    **self.extra,
                }
            )
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> PruningResult:
        """Read a ``pruning.json`` (a one-line error if it is not one)."""
        p = Path(path)
        p = p / "pruning.json" if p.is_dir() else p
        known = {"schema_version", "method", "task", "steps", "survival", "model",
                 "n_heads_total", "metric_description", "removable_at_5pct", "provenance"}  # fmt: skip
        try:
            d = json.loads(p.read_text())
            return cls(
                d["method"], d["task"], d["steps"], d.get("survival", {}),
                int(d.get("n_heads_total", 0)), d.get("metric_description", ""),
                d.get("model", ""), {k: v for k, v in d.items() if k not in known},
                d.get("provenance", {}),
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HeadmechError(f"{p} is not a pruning.json: {e}") from None

    def __eq__(self, other: object) -> bool:
        """Equal when they write the same ``pruning.json``."""
        return isinstance(other, PruningResult) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/pruning.json`` and, when there are steps, ``out/pruning.png``;
        returns the JSON path."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "pruning.json"
        path.write_text(dumps(self.to_dict()))
        if self.steps:
            from headmech.core.plot import pruning_curve

            pruning_curve(self, out / "pruning.png")
        return path
