"""Positional heads: the maximum attention goes to one fixed relative position."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream import blockwise
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer

if TYPE_CHECKING:
    from headmech.stream.points import Points
    from headmech.stream.rows import RowBlock

# Offsets with their own histogram bin; 0 (the token itself) is binned but never a
# positional offset, see PositionalHead.
MAX_OFFSET = 4
OFFSETS: tuple[int, ...] = tuple(range(-MAX_OFFSET, MAX_OFFSET + 1))


def _offset_stat(k: int) -> str:
    return f"offset_{k:+d}"  # "offset_-1", "offset_+0", "offset_+1"


class PositionalHead(HeadType):
    """The head's maximum attention goes to one relative position (in practice -1 or +1).

    For every real, non-special query token the engine records where the head's argmax
    over keys falls, as an offset histogram (``-4..+4`` plus ``other``: further away, or on
    a special token). The fraction at offset ``k`` is the number of queries whose argmax
    is ``i + k`` divided by the number of queries for which ``i + k`` is an ordinary token
    (so a perfect previous-token head scores 1.0, not ``1 - 1/length``). Score: the
    fraction at the head's most frequent non-zero offset; a head is positional when it is
    at least ``threshold`` (Voita et al.: 90% of the time).

    Offset 0 (attending to oneself) is binned as evidence but is not a positional offset:
    Voita et al. name -1/+1 heads, and Clark et al. report attention to self separately.

    Special tokens are never queries, nor argmax targets by default
    (``exclude_special_keys=True``): Voita et al. exclude EOS, and in BERT many heads park
    part of their attention on ``[SEP]``/``[CLS]`` as a no-op (Clark et al. 2019). MiniLM's
    next-token head L1H8, for one, has its maximum on a special token for 23% of the
    queries and on ``i + 1`` for 99% of the rest. How often a head's overall maximum is a
    special token is recorded as evidence (``special_argmax``).
    ``exclude_special_keys=False`` takes the argmax over every real key instead, so a
    maximum on a special token counts against the head.

    Args:
        threshold: fraction at the top offset needed to label a head (default 0.9).
        exclude_special_keys: take the argmax over ordinary tokens only.

    References:
        Voita et al. 2019, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the
        Heavy Lifting, the Rest Can Be Pruned", ACL (positional heads).
        Clark et al. 2019, "What Does BERT Look At? An Analysis of BERT's Attention",
        BlackboxNLP (attention to previous/next token and to [SEP]).
    """

    name = "positional"
    reference = "Voita et al. 2019"
    citation = (
        "Voita, Talbot, Moiseev, Sennrich, Titov 2019, Analyzing Multi-Head Self-Attention: "
        "Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned, ACL"
    )
    description = "puts its maximum attention on one fixed relative position (e.g. -1 or +1)"
    probe = "prose"
    default_threshold = 0.9  # Voita et al.: "at least 90% of the time"
    threshold_note = "share of queries whose maximum attention falls on one fixed offset (-1 or +1) ≥ 0.9: Voita et al.'s 'at least 90% of the time'; null: the share at that offset of a head attending anywhere, about 1/position"

    def __init__(
        self,
        threshold: float | None = None,
        exclude_special_keys: bool = True,
        *,
        probe: str | None = None,
    ) -> None:
        super().__init__(threshold, probe=probe)
        self.exclude_special_keys = exclude_special_keys

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(threshold={self.threshold}, "
            f"exclude_special_keys={self.exclude_special_keys})"
        )

    def broad_targets(self, batch: ProbeBatch) -> Tensor:
        """The neighbours (-1 and +1, Voita et al.'s positional offsets) in any text."""
        real = ~batch.special
        n = real.shape[1]
        eye = torch.eye(n, dtype=torch.bool, device=real.device)
        near = eye.roll(-1, 1) | eye.roll(1, 1)  # keys q - 1 and q + 1
        near[0, -1] = near[-1, 0] = False  # no wrap-around
        return near[None] & real[:, :, None] & real[:, None, :]

    # --- engine -------------------------------------------------------------------
    def _prepare(self, batch: ProbeBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ordinary = ~batch.special  # [batch, pos]; padding is special too
        n = ordinary.shape[1]
        pos = torch.arange(n, device=ordinary.device)
        # valid[b, k, i]: the token at i + OFFSETS[k] exists and is ordinary
        tgt = pos[None, :] + torch.tensor(OFFSETS, device=pos.device)[:, None]  # [n_off, pos]
        inside = (tgt >= 0) & (tgt < n)
        valid = ordinary[:, tgt.clamp(0, n - 1)] & inside[None]  # [batch, n_off, pos]
        valid &= ordinary[:, None, :]
        keys = ordinary if self.exclude_special_keys else batch.attention_mask.bool()
        return ordinary, keys, valid, pos

    def _reduce(
        self,
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
        batch: ProbeBatch,
        prepared: tuple[Tensor, Tensor, Tensor, Tensor],
        layer: int,
        rows: slice,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        # masked_fill, not in place: the engine's activation must stay untouched
        return self._sums(lambda keys=None: blockwise.top1(pattern, keys)[1], batch, prepared, rows)

    def _from_rows(
        self,
        view: RowBlock,
        batch: ProbeBatch,
        prepared: tuple[Tensor, Tensor, Tensor, Tensor],
        layer: int,
        rows: slice,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        # the argmax of the scores is the pattern's: no softmax needed
        return self._sums(lambda keys=None: view.top(keys)[1], batch, prepared, rows)

    def _from_maxima(
        self,
        view: Points,
        batch: ProbeBatch,
        prepared: tuple[Tensor, Tensor, Tensor, Tensor],
        layer: int,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """The same counts from the rows' maxima: the argmax is at offset ``k`` where the
        score of key ``i + k`` is the row's maximum (offsets in key order, so that a tie
        goes to the first key, as in ``torch.max``), on a special token where the maximum
        over the special keys (from points where they are few) is the maximum over every
        key."""
        ordinary, keys, valid, pos = prepared
        n_seqs, n = ordinary.shape
        out: dict[str, tuple[Tensor, Tensor]] = {}
        binned = torch.zeros(n_seqs, view.n_heads, n, dtype=torch.bool, device=pos.device)
        for k, off in enumerate(OFFSETS):
            v: Bool[Tensor, "batch query_pos"] = valid[:, k]
            if view.offset == 0:  # the key off positions away: slices, no gather
                score = view.scores_shifted(off)
            else:
                score = view.scores_at((pos + off).clamp(0, n - 1).expand(n_seqs, -1))
            hit = view.is_max(score, keys) & v[:, None] & ~binned
            binned |= hit
            out[_offset_stat(off)] = (hit.sum(2).double(), v.sum(1).double())
        n_queries = ordinary.sum(1).double()
        out["other"] = ((~binned & ordinary[:, None]).sum(2).double(), n_queries)
        sink = view.is_max(view.max_score(batch.special.bool())) & ordinary[:, None]
        out["special_argmax"] = (sink.sum(2).double(), n_queries)
        return out

    def _sums(
        self,
        argmax: Callable[..., Int[Tensor, "batch head_index query_pos"]],
        batch: ProbeBatch,
        prepared: tuple[Tensor, Tensor, Tensor, Tensor],
        rows: slice,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """The offsets' counts from each row's argmax over ``keys`` (``argmax(keys)``;
        over every key without one)."""
        ordinary_keys, keys, valid, pos = prepared
        # this block's queries: rows of the pattern (the keys stay whole)
        ordinary, valid, pos = ordinary_keys[:, rows], valid[:, :, rows], pos[rows]
        top: Int[Tensor, "batch head_index query_pos"] = argmax(keys)
        offset = top - pos  # [batch, head_index, query_pos]
        out: dict[str, tuple[Tensor, Tensor]] = {}
        binned = torch.zeros_like(ordinary[:, None].expand_as(top))
        for k, off in enumerate(OFFSETS):
            v: Bool[Tensor, "batch query_pos"] = valid[:, k]
            # v says i + off is an ordinary token, so a hit never lands on a special one
            hit = (offset == off) & v[:, None]
            binned |= hit
            out[_offset_stat(off)] = (hit.sum(2).double(), v.sum(1).double())  # per sequence
        n_queries = ordinary.sum(1).double()
        other = ~binned & ordinary[:, None]
        out["other"] = (other.sum(2).double(), n_queries)
        # evidence: queries whose maximum over all real keys is a special token
        # (padding keys carry no weight: the argmax over every key is over the real ones)
        top_all = argmax()
        sink = batch.special.gather(1, top_all.flatten(1)).view_as(top_all)  # key lookup
        out["special_argmax"] = ((sink & ordinary[:, None]).sum(2).double(), n_queries)
        return out

    def reducers(self) -> list[Reducer]:
        return [
            Reducer(
                self.name,
                self._reduce,
                self._prepare,
                blockwise=True,
                from_rows=self._from_rows,
                from_maxima=self._from_maxima,
            )
        ]

    # --- decision -----------------------------------------------------------------
    def _fractions(self, stats: HeadStats) -> Float[Tensor, "n_off n_layers n_heads"]:
        """Fraction of queries at each non-zero offset (0 where an offset never occurs)."""
        return torch.stack(
            [stats.mean(f"{self.name}.{_offset_stat(k)}") for k in OFFSETS if k != 0]
        ).nan_to_num(0.0)

    def _best_offsets(self, stats: HeadStats) -> tuple[Tensor, Tensor]:
        frac = self._fractions(stats)
        best, idx = frac.max(0)  # [n_layers, n_heads] each
        nonzero = torch.tensor([k for k in OFFSETS if k != 0])
        return best, nonzero[idx]

    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return self._best_offsets(stats)[0]

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        _, offset = self._best_offsets(stats)
        sink = stats.mean(f"{self.name}.special_argmax")
        return {
            "offset": {str(h): int(offset[h]) for h in heads},
            "fraction": {str(h): round(float(score[h]), 4) for h in heads},
            "special_argmax": {str(h): round(float(sink[h]), 4) for h in heads},
            "exclude_special_keys": self.exclude_special_keys,
            "n_queries": int(stats.counts[f"{self.name}.other"].max()),
        }
