"""What the positive control plants for a head type scored from attention: a perfect head's
attention pattern (:func:`ideal_pattern`) and the values of its weight, model and candidate
statistics (:func:`ideal_values`), which :func:`headmech.testing.planted_statistics` puts
in head ``PLANTED`` of a tiny model.

By default a perfect head attends uniformly to the type's ``targets()`` and has no
statistics of its own to plant. A type whose perfect head is something else registers it
here, by the type's ``name``: its pattern in :data:`IDEAL_PATTERNS` (a function
``(head_type, batch) -> [batch, query_pos, key_pos]``), the values of its statistics in
:data:`IDEAL_WEIGHT_STATISTICS` (``{statistic: value}``), as positional, syntactic,
induction and the IOI types do below (docs/contributing-head-types.md). A built-in type
(``headmech/headtypes/``, which may not import this package) gets its entry in these
dicts; a type kept in a folder or package of its own may add it from its file. A type
scored from weights or from runs of the model alone gets a hand-built model instead
(:data:`headmech.testing.controls.POSITIVE_CONTROLS`), never planted values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headmech.headtypes.registry import HeadType
from headmech.stream.engine import ProbeBatch

__all__ = [
    "IDEAL_PATTERNS",
    "IDEAL_WEIGHT_STATISTICS",
    "ideal_pattern",
    "ideal_values",
    "positional_pattern",
    "syntactic_pattern",
]


def positional_pattern(
    head_type: HeadType, batch: ProbeBatch
) -> Float[Tensor, "batch query_pos key_pos"]:
    """A previous-token head: every ordinary token puts all its attention on ``i - 1``
    when that is an ordinary token, else on itself."""
    ordinary = ~batch.special
    n = ordinary.shape[1]
    pos = torch.arange(n, device=ordinary.device)
    prev_ok = torch.zeros_like(ordinary)
    prev_ok[:, 1:] = ordinary[:, 1:] & ordinary[:, :-1]
    target = torch.where(prev_ok, pos - 1, pos)  # [batch, query_pos]
    return torch.nn.functional.one_hot(target, n).float()


def syntactic_pattern(
    head_type: HeadType, batch: ProbeBatch
) -> Float[Tensor, "batch query_pos key_pos"]:
    """Every token of a word attends uniformly to the tokens of the word's syntactic head;
    roots, special tokens and padding attend to themselves."""
    word_ids: Int[Tensor, "batch pos"] = batch.extras["word_ids"]
    heads: Int[Tensor, "batch pos"] = batch.extras["word_heads"]
    n = word_ids.shape[1]
    head_word = heads.gather(1, word_ids.clamp(min=0))  # [batch, pos]: head of own word
    head_word = head_word.masked_fill((word_ids < 0) | (head_word == word_ids), -2)
    target = word_ids[:, None, :] == head_word[:, :, None]  # [batch, query_pos, key_pos]
    eye = torch.eye(n, dtype=torch.bool, device=target.device).expand_as(target)
    target = torch.where(target.any(-1, keepdim=True), target, eye)
    p = target.float()
    return p / p.sum(-1, keepdim=True)


IDEAL_PATTERNS: dict[str, Callable[[HeadType, ProbeBatch], Tensor]] = {
    "positional": positional_pattern,
    "syntactic": syntactic_pattern,
}
"""A type's own perfect pattern, by its name, where uniform over its targets is not it."""

IDEAL_WEIGHT_STATISTICS: dict[str, dict[str, float]] = {
    # a perfect induction head's removal costs the repeated half what it predicts
    "induction": {"own_effect": 1.0, "own_effect_low": 1.0, "own_effect_high": 1.0},
    # the statistic named by each name mover type's copy_key
    "name_mover": {"copy": 1.0},
    "negative_name_mover": {"negative_copy": 1.0},
    "s_inhibition": {"below_name_movers": 1.0},
    "semantic_induction": {"tail_gain": 3.0},
}
"""A perfect head's values of a type's weight, model and candidate statistics, by the
type's name (statistic key as the type returns it, without the ``name.`` prefix)."""


def ideal_pattern(head_type: HeadType, batch: ProbeBatch) -> Tensor:
    """The attention pattern ``[batch, query_pos, key_pos]`` of a perfect head of
    ``head_type`` (used to plant the role in positive controls): the type's own from
    :data:`IDEAL_PATTERNS`, else uniform over the targets; queries without a target keep
    attending to themselves."""
    own = IDEAL_PATTERNS.get(head_type.name)
    if own is not None:
        return own(head_type, batch)
    t = head_type.targets(batch)
    n = batch.input_ids.shape[1]
    if t.dtype != torch.bool:
        has = t >= 0
        t = torch.nn.functional.one_hot(t.clamp(min=0), n).bool() & has[..., None]
    t = t & batch.attention_mask.bool()[:, None, :]
    eye = torch.eye(n, dtype=torch.bool, device=t.device).expand_as(t)
    t = torch.where(t.any(-1, keepdim=True), t, eye)
    p = t.float()
    return p / p.sum(-1, keepdim=True)


def ideal_values(head_type: HeadType) -> dict[str, float]:
    """Values of ``head_type``'s ``weight_statistics``, ``model_statistics`` and
    ``candidate_statistics`` for a perfect head, planted beside the pattern by the positive
    control of a type scored from attention (:data:`IDEAL_WEIGHT_STATISTICS`; default:
    none)."""
    return dict(IDEAL_WEIGHT_STATISTICS.get(head_type.name, {}))
