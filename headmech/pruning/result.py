"""The result every pruning method returns: a trajectory of kept heads and the metric."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    """

    method: str
    task: str
    steps: list[dict[str, Any]]
    survival: dict[str, list[float]] = field(default_factory=dict)
    n_heads_total: int = 0
    metric: str = ""
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

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
        return {
            "method": self.method,
            "task": self.task,
            "steps": steps,
            "survival": {k: [round(float(v), 6) for v in vs] for k, vs in self.survival.items()},
            "model": self.model,
            "metric_description": self.metric,
            "removable_at_5pct": round(self.removable_fraction(0.05), 6),
            **self.extra,
        }

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/pruning.json`` and, when there are steps, ``out/pruning.png``;
        returns the JSON path."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "pruning.json"
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        if self.steps:
            from headmech.plot import pruning_curve

            pruning_curve(self, out / "pruning.png")
        return path
