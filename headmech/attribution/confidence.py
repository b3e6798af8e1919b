"""Confidence (Voita et al. 2019): how peaked a head's attention is.

A head's confidence is its maximum attention weight at a query, averaged over the real
query tokens of a probe; special tokens (BOS/CLS/SEP/EOS, padding) are excluded as
queries and as keys (Voita et al. excluded EOS, where heads park attention). Confident
heads put most of their mass on one token; Voita et al. found that the heads LRP ranks
important tend to be confident. It needs no task metric: one streaming pass over the probe
(a :class:`headmech.stream.engine.Reducer`, no cache).

References:
    Voita, Talbot, Moiseev, Sennrich, Titov 2019, "Analyzing Multi-Head Self-Attention:
    Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned", ACL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from headmech.stream import blockwise
from headmech.stream.engine import ProbeBatch, Reducer, stream_statistics

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.stream.points import Points
    from headmech.stream.rows import RowBlock

__all__ = ["confidence", "confidence_reducer"]


def confidence_reducer(name: str = "confidence") -> Reducer:
    """Sum over real, non-special queries of the maximum weight on a non-special key."""

    def prepare(batch: ProbeBatch) -> tuple[Tensor, Tensor]:
        ordinary = ~batch.special  # [batch, pos]
        return ordinary, ordinary

    def fn(pattern: Tensor, batch: ProbeBatch, prepared: Any, layer: int, rows: slice) -> dict:
        queries, keys = prepared
        queries = queries[:, rows]
        # pattern: [batch, head_index, query rows, key_pos]
        # the largest weight on an ordinary key (none visible: 0; weights are >= 0)
        top = blockwise.top1(pattern, keys)[0].clamp(min=0)  # [batch, head, query]
        w = queries[:, None, :].to(pattern.dtype)
        return {"max": ((top * w).sum(2), queries.sum(1))}  # per sequence

    def from_rows(
        view: RowBlock, batch: ProbeBatch, prepared: Any, layer: int, rows: slice
    ) -> dict:
        queries, keys = prepared
        queries = queries[:, rows]
        top = view.top(keys)[0]  # exp(max score - LSE): no softmax of the row
        w = queries[:, None, :].to(top.dtype)
        return {"max": ((top * w).sum(2), queries.sum(1))}

    def from_maxima(view: Points, batch: ProbeBatch, prepared: Any, layer: int) -> dict:
        queries, keys = prepared
        top = view.top(keys)  # exp(max score - LSE), the max from the kernel
        w = queries[:, None, :].to(top.dtype)
        return {"max": ((top * w).sum(2), queries.sum(1))}

    return Reducer(name, fn, prepare, blockwise=True, from_rows=from_rows, from_maxima=from_maxima)


def confidence(
    model: TransformerBridge,
    batches: Sequence[ProbeBatch],
    *,
    progress: bool | str = False,
    return_units: bool = False,
) -> Any:
    """Mean maximum attention weight per head (Voita et al. 2019); with ``return_units``
    also the per-sequence values (:class:`~headmech.stream.uncertainty.UnitValues`)."""
    from headmech.stream.uncertainty import UnitValues

    stats = stream_statistics(
        model, batches, [confidence_reducer()], progress=progress, total=len(batches)
    )
    score = stats.mean("confidence.max")
    if not return_units:
        return score
    units = stats.units("confidence.max")
    assert units is not None
    return score, UnitValues(units[0], units[1])
