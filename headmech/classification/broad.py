"""Behaviour beyond the probe: how much of a head's attention on ordinary text its type
explains.

A probe makes one behaviour visible, and a head that scores high on it may do something
else most of the time: HeadVis (Anthropic, Transformer Circuits Thread, 2026) reports that
"a head's behavior on the full distribution rarely matches what a narrow task suggests".
:func:`broad_behaviour` reads every head's attention on windows of prose of several
domains (:mod:`headmech.probes.broad`) at two lengths, :data:`LENGTHS` (the repeated-random
probe's length, BOS + 2 x 32 tokens, and 4x it), and for each type with a pattern on
ordinary text (``HeadType.broad_targets``) records per head:

* ``broad_share``: the share of the head's attention that lands on the type's pattern,
  summed over every query, out of the attention it does not park on the first position
  (a sink's no-op; for the sink type itself, out of all of it), at the first length;
  ``broad_share_4x`` at the second;
* ``broad_score``: the type's own score there: the mean mass on the pattern over the
  queries that have one (``broad_score_4x``);
* ``narrow``: the share below :data:`NARROW` at both lengths: the type explains less than
  half of what the head does on ordinary text.

One set of forward passes per length serves every type. A type without a pattern on
ordinary text (name movers, function vectors, ...) gets none, and the record says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from headmech.classification.readings import BroadReading, HeadReading
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["LENGTHS", "NARROW", "PER_DOMAIN", "broad_behaviour"]

LENGTHS = (64, 256)
"""Tokens per window: the repeated-random probe's length (BOS + 2 x 32) and 4x it."""
PER_DOMAIN = {64: 4, 256: 2}
"""Windows per domain at each length (about 1,300 and 2,600 tokens over five domains)."""
NARROW = 0.5
"""A head whose type's pattern takes less than this share of its (non-sink) attention on
ordinary text is marked narrow."""


def _first(batch: Any) -> torch.Tensor:
    """Every real query's first key (position 0)."""
    pos = torch.zeros_like(batch.input_ids)
    return pos.masked_fill(~batch.attention_mask.bool(), -1)


def _pattern(t: HeadType, batch: Any) -> torch.Tensor:
    """``t``'s pattern on ``batch``, without the first position (which the share leaves
    out of the head's attention) unless the pattern is the first position."""
    targets = t.broad_targets(batch)
    assert targets is not None  # only types with a pattern are read
    if t.broad_on_first:
        return targets
    if targets.dtype == torch.bool:
        targets = targets.clone()
        targets[..., 0] = False
        return targets
    return targets.masked_fill(targets == 0, -1)


def _grids(model: TransformerBridge, types: Sequence[HeadType], length: int) -> dict[str, Any]:
    """Per type: share and score grids ``[n_layers, n_heads]`` at ``length``."""
    from headmech.probes.broad import broad_batches
    from headmech.stream.engine import stream_statistics
    from headmech.stream.reducers import target_reducer

    batches, counts = broad_batches(model, length, PER_DOMAIN.get(length, 2))
    reducers = [target_reducer("broad.first", _first, hits=False)]
    reducers += [target_reducer(f"broad.{t.name}", partial(_pattern, t), hits=False) for t in types]
    stats = stream_statistics(model, batches, reducers)
    first = stats.mean("broad.first.rows")
    out: dict[str, Any] = {"windows": counts}
    for t in types:
        rows = stats.mean(f"broad.{t.name}.rows")
        share = rows if t.broad_on_first else rows / (1 - first).clamp(min=1e-6)
        out[t.name] = (share, stats.mean(f"broad.{t.name}.mass"))
    return out


def broad_behaviour(
    model: TransformerBridge,
    types: Sequence[HeadType],
    heads: Mapping[str, Sequence[HeadIndex]],
) -> dict[str, dict[str, Any]]:
    """For each type of ``types`` and each of its ``heads[type]``, the record described
    in the module docstring; a type without a pattern on ordinary text gets
    ``{"note": ...}`` instead. Returns ``{type: {"heads": {"L18H6": record}, "lengths",
    "windows"} | {"note"}}``."""
    have = [t for t in types if t.broad_targets.__func__ is not HeadType.broad_targets]  # type: ignore[attr-defined]
    out: dict[str, dict[str, Any]] = {
        t.name: {"note": f"'{t.name}' has no pattern on ordinary text (its probe's task only)"}
        for t in types
        if t not in have
    }
    wanted = [t for t in have if heads.get(t.name)]
    if not wanted:
        return out
    short, long = (_grids(model, wanted, n) for n in LENGTHS)
    for t in wanted:
        (s1, c1), (s4, c4) = short[t.name], long[t.name]
        per: dict[str, Any] = {}
        for h in heads[t.name]:
            share = _num(s1[h])
            per[str(h)] = {
                "broad_share": share,
                "broad_share_4x": _num(s4[h]),
                "broad_score": _num(c1[h]),
                "broad_score_4x": _num(c4[h]),
                "narrow": max(share or 0.0, _num(s4[h]) or 0.0) < NARROW,
            }
        out[t.name] = {"heads": per, "lengths": list(LENGTHS), "windows": short["windows"]}
    return out


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else round(v, 6)


def merge(
    per_head: dict[str, HeadReading], record: dict[str, Any], labelled: Any = ()
) -> dict[str, Any]:
    """A type's :func:`broad_behaviour` record into its ``per_head`` readings (a head
    without one gets one, saying whether it is ``labelled``, a head of ``labelled``);
    returns what goes to ``details["broad"]`` (the lengths and windows, or the note)."""
    names = {str(h) for h in labelled}
    for h, values in record.get("heads", {}).items():
        per_head.setdefault(h, HeadReading(h in names)).broad = BroadReading(**values)
    return {k: v for k, v in record.items() if k != "heads"}


def heads_to_read(result: Any) -> list[HeadIndex]:
    """A type's labelled heads and those at or above its threshold but not labelled."""
    rejected = [HeadIndex.parse(e["head"]) for e in result.not_labelled]
    return list(dict.fromkeys([*result.heads, *rejected]))
