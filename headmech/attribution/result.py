"""The result of an importance run: ``importance.json`` and its heatmap.

:class:`ImportanceResult` holds a per-head score (higher: the head matters more for the
task), how it was obtained and its provenance; ``save`` writes ``importance.json`` (the
public contract: ``{"method", "task", "metric_clean", "score"}`` plus the metric each
method used and its cost) and ``importance.png``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.runs.files import FileSchema, ResultFile
from headmech.runs.provenance import SCHEMA_VERSION

__all__ = ["IMPORTANCE_FILE", "ImportanceResult"]

# importance.json: its header names no headmech version
IMPORTANCE_FILE = FileSchema(
    "importance result", "importance.json", SCHEMA_VERSION, required=("method", "task", "score"),
    headmech_version=False,
)  # fmt: skip


@dataclass(eq=False)
class ImportanceResult(ResultFile):
    """A per-head importance score and how it was obtained.

    Attributes:
        method, task: names.
        score: ``[n_layers, n_heads]``, higher = more important.
        metric_clean: the task's metric on the unmodified model (for patching, on the
            unpatched base run); None for methods that measure no metric.
        metric_description: what was measured.
        seconds: wall time of the method (probe building excluded; not written to JSON,
            so a rerun writes the same bytes).
        forward_equivalents: compute in passes over the probe (a backward pass counts as
            two forward passes).
        model: the model's short name.
        details: method-specific extras (its options, the probe size).
        low, high: the bootstrap interval of ``score`` over probe examples (None where the
            method gives no per-example values).
        provenance: weights, probe data, versions, settings (:mod:`headmech.runs.provenance`).
    """

    method: str
    task: str
    score: Float[Tensor, "n_layers n_heads"]
    metric_clean: float | None
    metric_description: str
    seconds: float
    forward_equivalents: float
    model: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    low: Float[Tensor, "n_layers n_heads"] | None = None
    high: Float[Tensor, "n_layers n_heads"] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    SCHEMA = IMPORTANCE_FILE

    def _body(self) -> dict[str, Any]:
        out = {
            "method": self.method,
            "task": self.task,
            "metric_clean": self.metric_clean,
            "score": self.score.tolist(),
            "metric_description": self.metric_description,
            "model": self.model,
            "forward_equivalents": self.forward_equivalents,
            "details": self.details,
        }
        if self.low is not None and self.high is not None:
            out["interval"] = {"low": self.low.tolist(), "high": self.high.tolist()}
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``importance.json`` contents (:meth:`to_json`)."""
        return self.to_json()

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``out/importance.json`` and ``out/importance.png`` (``out`` ending in
        ``.json``: that file alone); returns the JSON path."""
        return super().save(out)

    def _figures(self, folder: Path) -> None:
        from headmech.core.plot import score_heatmap

        title = f"{self.model} {self.method} / {self.task}"
        score_heatmap(self.score, title=title, path=folder / "importance.png")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ImportanceResult:
        """Read an ``importance.json`` (or its folder); a one-line error if it is not one."""
        return super().load(path)

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> ImportanceResult:
        interval = d.get("interval") or {}
        return cls(
            d["method"], d["task"], torch.tensor(d["score"]), d["metric_clean"],
            d["metric_description"], 0.0, float(d["forward_equivalents"]), d["model"],
            d["details"],
            torch.tensor(interval["low"]) if interval else None,
            torch.tensor(interval["high"]) if interval else None,
            d.get("provenance", {}),
        )  # fmt: skip

    def top(self, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` highest-scoring heads as ``(layer, head)``."""
        from headmech.core.head_index import top_k

        return [(h.layer, h.head) for h in top_k(self.score, k)]
