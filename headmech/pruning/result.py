"""The result every pruning method returns: a trajectory of kept heads and the metric."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headmech.runs.files import FileSchema, ResultFile
from headmech.runs.provenance import SCHEMA_VERSION

__all__ = ["PruningResult"]

# pruning.json (docs/architecture.md): its header names no headmech version
PRUNING_FILE = FileSchema(
    "pruning result", "pruning.json", SCHEMA_VERSION, required=("method", "task", "steps"),
    headmech_version=False,
)  # fmt: skip
# the keys of pruning.json that are not method-specific extras
_KNOWN = {"schema_version", "method", "task", "steps", "survival", "model", "n_heads_total",
          "metric_description", "removable_at_5pct", "provenance"}  # fmt: skip


@dataclass(eq=False)
class PruningResult(ResultFile):
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

    SCHEMA = PRUNING_FILE

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

    def _body(self) -> dict[str, Any]:
        steps = []
        for s in self.steps:
            row = {
                "n_kept": int(s["n_kept"]),
                "heads_kept": [[int(a), int(b)] for a, b in s["heads_kept"]],
                "metric": round(float(s["metric"]), 6),
            }
            row.update({k: v for k, v in s.items() if k not in row})
            steps.append(row)
        return {
            "method": self.method,
            "task": self.task,
            "steps": steps,
            "survival": self.survival,
            "model": self.model,
            "n_heads_total": self.n_heads_total,
            "metric_description": self.metric,
            "removable_at_5pct": self.removable_fraction(0.05),
            **self.extra,
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``pruning.json`` contents (:meth:`to_json`)."""
        return self.to_json()

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> PruningResult:
        return cls(
            d["method"], d["task"], d["steps"], d.get("survival", {}),
            int(d.get("n_heads_total", 0)), d.get("metric_description", ""),
            d.get("model", ""), {k: v for k, v in d.items() if k not in _KNOWN},
            d.get("provenance", {}),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | os.PathLike) -> PruningResult:
        """Read a ``pruning.json`` (or its folder); a one-line error if it is not one."""
        return super().load(path)

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/pruning.json`` and, when there are steps, ``out/pruning.png``
        (``out`` ending in ``.json``: that file alone); returns the JSON path."""
        return super().save(out)

    def _figures(self, folder: Path) -> None:
        if self.steps:
            from headmech.core.plot import pruning_curve

            pruning_curve(self, folder / "pruning.png")
