"""Which KV heads a long context needs, measured: the exact change of the task loss when
one KV head alone is restricted to its sinks and window, or alone given its whole cache.

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

Two choices decide whether the ranking finds the heads a long context needs; both are
measured on Qwen2.5-Coder-0.5B (benchmarks/bench_kv_peers.py, issue 48), whose catalog
labels eight retrieval KV heads (L9, L11, L13, L15, L17, L22 KV head 1 and both of L16)
that keep every needle at 8,192 and 16,384 tokens up to 5x compression.

* **How the tasks are combined.** The needle and prose losses have different scales and
  point at different heads. Summed (``ranking(by="sum")``, :attr:`KVImportance.score`),
  the prose decides: windowing one retrieval head alone barely moves the needle loss
  (0.002 nats with the full cache; the others cover for it) while the prose loss moves by
  up to 0.018 nats and for the retrieval heads *falls* (L9 KV head 1: -0.018), so four
  of the eight rank 38th-47th of 48 and a plan from the sum recalls no needle at 8,192
  tokens even with 35 of 48 KV heads full. ``ranking(by="task")`` takes each task's own
  order in turn: the eight rank 1st-30th (six in the first nine) and the plan keeps
  every needle at every ratio up to 5x, with perplexity -0.7% / +0.0% / +2.7% at 1.33x /
  2x / 3x (both criteria hold to 2x, where the sum held nothing). On SmolLM2-135M at
  8,192 tokens, whose needle loss is not saturated, the sum does slightly better (+0.0%
  against +1.2% at 2x), so the default stays ``by="sum"``.
* **Which regime is measured.** ``mode="windowed"`` (the default) measures each head
  alone windowed among full ones; ``mode="restored"`` each head alone full among windowed
  ones, the regime a plan at a high ratio runs in, scored as the share of the
  all-windowed loss gap (per task) the head closes. On Qwen the restored measurement
  finds L16 KV head 0 alone closing 24% of the needle gap, but it is no better overall:
  summed it ranks L9 KV head 1 47th (recall 0.33 at 20% and 33% of a 2,048-token cache,
  1.00 at 50%; 0 at 5x of 8,192), and by task it loses more perplexity than the windowed
  measurement at 3x (+58% against +2.7%).

Neither ranking matches the catalog's beyond 3x (at 4x and 5x of 8,192 tokens the task
rankings' plans keep every needle but lose +88% / +108% perplexity where the catalog's
loses +11% / +17%): the calibration prose at 2,048 tokens does not repeat, the held-out
prose at 8,192 does (the corpus twice), and the catalog's heads are the ones labelled
for copying; the task rankings spend half their few full heads on the calibration
prose's heads instead. Measure on data shaped like the use, read
:attr:`KVImportance.needle` and :attr:`KVImportance.prose` apart before trusting a
ranking, and compare with the catalog's (:func:`headmech.kv.kv_ranking`).
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


MODES = ("windowed", "restored")
RANK_BY = ("sum", "task")


def _order(pairs: list[tuple[int, int]], value: Tensor) -> list[tuple[int, int]]:
    """``pairs`` by ``value``, largest first (NaN last, ties by position)."""
    v = torch.nan_to_num(value, nan=-math.inf)
    return sorted(pairs, key=lambda p: (-float(v[p[0], p[1]]), p[0], p[1]))


@dataclass
class KVImportance:
    """Per KV head, what its whole cache is worth, measured with ``sinks`` + ``window``.

    Attributes:
        needle: ``[n_layers, n_kv_heads]``, nats per needle answer token. ``"windowed"``:
            how much restricting the head alone raises the loss over the full cache's;
            ``"restored"``: how much giving the head alone its whole cache lowers the loss
            of every head windowed. NaN for a layer with its own sliding window (not
            measured: a plan leaves it as it is).
        prose: the same for the prose's mean next-token NLL.
        base_needle, base_prose: the full cache's values.
        sinks, window: the restriction measured.
        seconds: time of the measurement.
        mode: ``"windowed"`` (each head alone windowed) or ``"restored"`` (each head alone
            full, every other windowed).
        windowed_needle, windowed_prose: every head windowed (``"restored"`` mode; NaN
            otherwise).
    """

    needle: Float[Tensor, "n_layers n_kv_heads"]
    prose: Float[Tensor, "n_layers n_kv_heads"]
    base_needle: float
    base_prose: float
    sinks: int
    window: int
    seconds: float = 0.0
    mode: str = "windowed"
    windowed_needle: float = float("nan")
    windowed_prose: float = float("nan")

    @property
    def score(self) -> Float[Tensor, "n_layers n_kv_heads"]:
        """The value the ranking uses (a task left out counts 0).

        ``"windowed"``: needle answer NLL plus prose NLL increases (nats per token).
        ``"restored"``: per task, the share of the all-windowed gap (windowed minus full
        cache) the head alone closes, summed over the tasks; a task whose gap is not
        positive counts 0.
        """
        if self.mode == "windowed":
            return torch.nan_to_num(self.needle, nan=0.0) + torch.nan_to_num(self.prose, nan=0.0)
        total = torch.zeros_like(self.needle)
        for gain, gap in [(self.needle, self.windowed_needle - self.base_needle),
                          (self.prose, self.windowed_prose - self.base_prose)]:  # fmt: skip
            if gap > 0:  # False for NaN
                total += torch.nan_to_num(gain, nan=0.0) / gap
        return total

    def ranking(self, by: str = "sum") -> list[tuple[int, int]]:
        """Measured ``(layer, kv_head)`` pairs, most needed first (ties by position).

        ``by="sum"``: by :attr:`score`. ``by="task"``: each task's own order (needle
        values, prose values), taken in turn — the needle's most needed head, the prose's,
        the needle's second, ... (a head already taken is skipped) — so each task's most
        needed heads come first whatever the scales of the two losses.
        """
        if by not in RANK_BY:
            raise InputError(f"unknown ranking {by!r}; known: {', '.join(RANK_BY)}")
        measured = torch.isfinite(self.needle) | torch.isfinite(self.prose)
        pairs = [(la, k) for la, k in measured.nonzero().tolist()]
        if by == "sum":
            return _order(pairs, self.score)
        orders = [_order(pairs, v) for v in (self.needle, self.prose) if torch.isfinite(v).any()]
        merged = [p for step in zip(*orders, strict=True) for p in step]
        return list(dict.fromkeys(merged))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVImportance:
        """Read back :meth:`to_json`'s output.

        Raises:
            InputError: a record without the per-head values (e.g. a copied ranking).
        """
        try:
            needle, prose = (torch.tensor([[math.nan if v is None else v for v in r]
                                           for r in data[k]]) for k in ("needle", "prose"))  # fmt: skip
            extra = {k: float(data[k]) for k in ("windowed_needle", "windowed_prose") if k in data}
            return cls(needle, prose, float(data["base_needle"]), float(data["base_prose"]),
                       int(data["sinks"]), int(data["window"]), float(data.get("seconds", 0.0)),
                       data.get("mode", "windowed"), **extra)  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"not a KV importance record: {type(e).__name__}: {e}") from None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: the per-head values (None where not measured)."""

        def rows(x: Tensor) -> list[list[float | None]]:
            return [[None if math.isnan(v) else round(v, 6) for v in r] for r in x.tolist()]

        out = {
            "needle": rows(self.needle),
            "prose": rows(self.prose),
            "base_needle": self.base_needle,
            "base_prose": self.base_prose,
            "sinks": self.sinks,
            "window": self.window,
            "ranking": [list(p) for p in self.ranking()],
            "seconds": round(self.seconds, 2),
        }
        if self.mode != "windowed":
            out |= {"mode": self.mode, "windowed_needle": self.windowed_needle,
                    "windowed_prose": self.windowed_prose}  # fmt: skip
        return out


def _needle_nll(ev: KVEval) -> float:
    return sum(t["nll"] for t in ev.trials) / len(ev.trials) if ev.trials else float("nan")


def _prose_nll(ev: KVEval) -> float:
    return ev.nll_sum / ev.n_tokens if ev.n_tokens else float("nan")


def _measured_heads(model: Any) -> tuple[list[tuple[int, int]], tuple[str, int, int, int]]:
    """Every KV head outside the model's own sliding-window layers, as ``(layer, kv_head)``,
    and the model's shape as :func:`~headmech.kv.budget.model_shape` gives it (name, layers,
    query heads, KV heads)."""
    shape = model_shape(model)
    n_layers, n_kv = shape[1], shape[3]
    windows = model_windows(model) or (0,) * n_layers
    heads = [(la, k) for la in range(n_layers) if not windows[la] for k in range(n_kv)]
    return heads, shape


def one_windowed_plans(
    model: Any, sinks: int = 4, window: int = 256
) -> tuple[list[tuple[int, int]], list[KVPlan]]:
    """``(heads, plans)``: every KV head outside the model's own sliding-window layers, as
    ``(layer, kv_head)``, and for each the plan that windows it alone."""
    heads, (name, n_layers, n_heads, n_kv) = _measured_heads(model)
    plans = []
    for la, k in heads:
        full = torch.ones(n_layers, n_kv, dtype=torch.bool)
        full[la, k] = False
        plans.append(KVPlan(full, n_heads, sinks, window, name, {"kind": "one_windowed"}))
    return heads, plans


def one_restored_plans(
    model: Any, sinks: int = 4, window: int = 256
) -> tuple[list[tuple[int, int]], list[KVPlan]]:
    """``(heads, plans)``: as :func:`one_windowed_plans`, the plans keeping the whole cache
    for that head alone, with every other measured head windowed; last, the plan with
    every measured head windowed (its head: ``(-1, -1)``)."""
    heads, (name, n_layers, n_heads, n_kv) = _measured_heads(model)
    none = torch.ones(n_layers, n_kv, dtype=torch.bool)
    for la, k in heads:
        none[la, k] = False
    plans = []
    for la, k in heads:
        full = none.clone()
        full[la, k] = True
        plans.append(KVPlan(full, n_heads, sinks, window, name, {"kind": "one_restored"}))
    plans.append(KVPlan(none, n_heads, sinks, window, name, {"kind": "all_windowed"}))
    return [*heads, (-1, -1)], plans


def kv_importance(
    model: Any,
    needle: Sequence[ProbeBatch] = (),
    prose: Sequence[ProbeBatch] = (),
    *,
    sinks: int = 4,
    window: int = 256,
    mode: str = "windowed",
    progress: bool = False,
) -> KVImportance:
    """Measure what each KV head's whole cache is worth against ``sinks`` + ``window``.

    ``mode="windowed"``: restrict each KV head alone and measure the loss it adds over the
    full cache. ``mode="restored"``: window every KV head, give each head alone its whole
    cache back and measure the loss it removes (one more run: every head windowed). One
    masked run of the model per KV head outside the model's own sliding-window layers, on
    every needle trial and prose sequence given; the runs share the layers before their
    head's (:func:`~headmech.kv.shared.evaluate_many`, equal to
    :func:`headmech.kv.evaluate` of each plan).

    Raises:
        InputError: no needle trials and no prose, or an unknown mode.
    """
    if not needle and not prose:
        raise InputError("kv_importance needs needle trials or prose to measure on")
    if mode not in MODES:
        raise InputError(f"unknown importance mode {mode!r}; known: {', '.join(MODES)}")
    t0 = time.perf_counter()
    _, n_layers, _, n_kv = model_shape(model)
    make = one_windowed_plans if mode == "windowed" else one_restored_plans
    heads, plans = make(model, sinks, window)
    base, *evals = evaluate_many(model, [None, *plans], needle, prose, progress=progress)
    ref = base if mode == "windowed" else evals[-1]
    sign = 1.0 if mode == "windowed" else -1.0  # both: larger = the whole cache matters more
    out_needle = torch.full((n_layers, n_kv), float("nan"))
    out_prose = torch.full((n_layers, n_kv), float("nan"))
    for (la, k), ev in zip(heads, evals, strict=True):
        if la >= 0:
            out_needle[la, k] = sign * (_needle_nll(ev) - _needle_nll(ref))
            out_prose[la, k] = sign * (_prose_nll(ev) - _prose_nll(ref))
    extra = {} if mode == "windowed" else {
        "windowed_needle": _needle_nll(evals[-1]), "windowed_prose": _prose_nll(evals[-1])
    }  # fmt: skip
    return KVImportance(
        out_needle, out_prose, _needle_nll(base), _prose_nll(base), sinks, window,
        time.perf_counter() - t0, mode, **extra,
    )  # fmt: skip
