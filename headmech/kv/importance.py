"""Which KV heads a long context needs, measured: the exact increase of the task loss
when one KV head alone is restricted to its sinks and window.

DuoAttention (Xiao et al. 2024) learns a gate per KV head that mixes full and streaming
attention, optimised so that the streaming heads change the model's outputs least on a
synthetic passkey task. :func:`kv_importance` measures the quantity those gates stand
for directly: for every KV head, the whole model is run with that head alone windowed
(:func:`~headmech.kv.masks.evaluate`, an exact mask inside the model's attention) and
the answer NLL of needle trials and the per-token NLL of long prose are compared with
the full cache. A plan then keeps the whole cache for the heads whose restriction costs
most (:meth:`KVImportance.ranking`, :meth:`~headmech.kv.plan.KVPlan.from_ranking`).

Measure on calibration trials and prose, and judge the plans on other ones: the ranking
is fitted to the data it is measured on.

One head at a time cannot see heads that back each other up. On Qwen2.5-Coder-0.5B at
2,048 tokens (benchmarks/bench_kv_peers.py, issue 48) windowing any one retrieval KV head
barely moves the needle loss (the full cache's is 0.002 nats; the others cover for it)
while the prose loss *falls* (L9 KV head 1: -0.018 nats), so :attr:`KVImportance.score`
ranks four of the catalog's eight retrieval KV heads 38th-47th of 48, and a plan from this
ranking recalls no needle at 8,192 tokens even with 35 of 48 KV heads full, where the
catalog's retrieval ranking keeps every needle with 8. Read :attr:`KVImportance.needle`
and :attr:`KVImportance.prose` apart before trusting the sum, and compare with the
catalog's ranking (:func:`headmech.kv.kv_ranking`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.errors import InputError
from headmech.kv.budget import model_shape, model_windows
from headmech.kv.masks import KVEval
from headmech.kv.plan import KVPlan
from headmech.kv.shared import evaluate_many
from headmech.stream.engine import ProbeBatch

__all__ = ["KVImportance", "kv_importance"]


@dataclass
class KVImportance:
    """Per KV head, what restricting it alone to ``sinks`` + ``window`` costs.

    Attributes:
        needle: ``[n_layers, n_kv_heads]``: increase of the needle answers' mean NLL (nats
            per answer token); NaN for a layer with its own sliding window (not measured:
            a plan leaves it as it is).
        prose: the same for the prose's mean next-token NLL.
        base_needle, base_prose: the full cache's values.
        sinks, window: the restriction measured.
        seconds: time of the measurement.
    """

    needle: Float[Tensor, "n_layers n_kv_heads"]
    prose: Float[Tensor, "n_layers n_kv_heads"]
    base_needle: float
    base_prose: float
    sinks: int
    window: int
    seconds: float = 0.0

    @property
    def score(self) -> Float[Tensor, "n_layers n_kv_heads"]:
        """The loss the ranking uses: needle answer NLL plus prose NLL, both increases
        (nats per token; a task left out counts 0)."""
        return torch.nan_to_num(self.needle, nan=0.0) + torch.nan_to_num(self.prose, nan=0.0)

    def ranking(self) -> list[tuple[int, int]]:
        """Measured ``(layer, kv_head)`` pairs, costliest first (ties by position)."""
        measured = torch.isfinite(self.needle) | torch.isfinite(self.prose)
        score = self.score
        pairs = [(la, k) for la, k in measured.nonzero().tolist()]
        return sorted(pairs, key=lambda p: (-float(score[p[0], p[1]]), p[0], p[1]))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: the per-head increases (None where not measured)."""

        def rows(x: Tensor) -> list[list[float | None]]:
            return [[None if math.isnan(v) else round(v, 6) for v in r] for r in x.tolist()]

        return {
            "needle": rows(self.needle),
            "prose": rows(self.prose),
            "base_needle": self.base_needle,
            "base_prose": self.base_prose,
            "sinks": self.sinks,
            "window": self.window,
            "ranking": [list(p) for p in self.ranking()],
            "seconds": round(self.seconds, 2),
        }


def _needle_nll(ev: KVEval) -> float:
    return sum(t["nll"] for t in ev.trials) / len(ev.trials) if ev.trials else float("nan")


def _prose_nll(ev: KVEval) -> float:
    return ev.nll_sum / ev.n_tokens if ev.n_tokens else float("nan")


def one_windowed_plans(
    model: Any, sinks: int = 4, window: int = 256
) -> tuple[list[tuple[int, int]], list[KVPlan]]:
    """``(heads, plans)``: every KV head outside the model's own sliding-window layers, as
    ``(layer, kv_head)``, and for each the plan that windows it alone."""
    name, n_layers, n_heads, n_kv = model_shape(model)
    windows = model_windows(model) or (0,) * n_layers
    heads = [(la, k) for la in range(n_layers) if not windows[la] for k in range(n_kv)]
    plans = []
    for la, k in heads:
        full = torch.ones(n_layers, n_kv, dtype=torch.bool)
        full[la, k] = False
        plans.append(KVPlan(full, n_heads, sinks, window, name, {"kind": "one_windowed"}))
    return heads, plans


def kv_importance(
    model: Any,
    needle: Sequence[ProbeBatch] = (),
    prose: Sequence[ProbeBatch] = (),
    *,
    sinks: int = 4,
    window: int = 256,
    progress: bool = False,
) -> KVImportance:
    """Restrict each KV head alone to ``sinks`` + ``window`` and measure the loss it adds.

    One masked run of the model per KV head outside the model's own sliding-window
    layers, on every needle trial and prose sequence given; the runs share the layers
    before their head's (:func:`~headmech.kv.shared.evaluate_many`, equal to
    :func:`headmech.kv.evaluate` of each plan).

    Raises:
        InputError: no needle trials and no prose.
    """
    if not needle and not prose:
        raise InputError("kv_importance needs needle trials or prose to measure on")
    t0 = time.perf_counter()
    _, n_layers, _, n_kv = model_shape(model)
    heads, plans = one_windowed_plans(model, sinks, window)
    base, *evals = evaluate_many(model, [None, *plans], needle, prose, progress=progress)
    out_needle = torch.full((n_layers, n_kv), float("nan"))
    out_prose = torch.full((n_layers, n_kv), float("nan"))
    for (la, k), ev in zip(heads, evals, strict=True):
        out_needle[la, k] = _needle_nll(ev) - _needle_nll(base)
        out_prose[la, k] = _prose_nll(ev) - _prose_nll(base)
    return KVImportance(
        out_needle, out_prose, _needle_nll(base), _prose_nll(base), sinks, window,
        time.perf_counter() - t0,
    )  # fmt: skip
