"""Rare-word heads: the maximum attention goes to the least frequent token of the sentence."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream import blockwise
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer

if TYPE_CHECKING:
    from headmech.stream.rows import RowBlock


class RareWordHead(HeadType):
    """The head's maximum attention goes to the rarest token of the sentence.

    Rarity is token-level: each model token is ranked by how often its id occurs in the
    reference corpus (the whole corpus the probe sentences come from; by default the
    ~730-sentence CPython-documentation corpus). Token-level rarity is what the model
    sees and matches Voita et al., whose model worked on BPE tokens; for a word split
    into pieces, the rare piece is the target, not its common continuation pieces. With a
    small reference corpus several tokens often share the lowest count: all of them are
    targets (the chance rate accounts for it).

    Per sentence, the targets are the ordinary tokens with the lowest count; the queries
    are the other ordinary tokens. A query is a hit when the head's argmax over the
    sentence's ordinary tokens (special tokens excluded, as Voita et al. exclude EOS; in
    BERT the [SEP]/[CLS] maximum is a no-op) is a target. Chance for a query is the share
    of targets among those keys. Only what the query can see counts: a key the layer's
    attention gives exactly 0 (a later token in a decoder, a token outside a sliding
    window) is neither a target nor a key for it, and a query that sees no target is not
    counted. Without this a decoder's queries before the sentence's rarest token could
    never hit, and every decoder head's rate would be bounded well below 1. Score: the
    hit rate; a head is labelled when the rate is at least ``threshold`` and at least
    ``min_ratio`` times the chance rate.

    Defaults: ``threshold=0.3`` and ``min_ratio=3``. Voita et al. give no cut-off; their
    one rare-word head picks the rarest token 66% (OpenSubtitles) and over 50% (WMT) of the
    time on sentences with a clearly rare token. On all sentences, with ties and a small
    reference corpus, a real rare-word head scores lower, so the absolute bar is 0.3; the
    ratio keeps short sentences or many ties (chance near 0.1-0.2) from passing a head
    that attends to a random ordinary token. Both are constructor arguments.

    Args:
        threshold: hit rate needed (default 0.3).
        min_ratio: hit rate / chance rate needed (default 3.0).

    References:
        Voita et al. 2019, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the
        Heavy Lifting, the Rest Can Be Pruned", ACL (rare-word heads).
    """

    name = "rare_word"
    reference = "Voita et al. 2019"
    citation = (
        "Voita, Talbot, Moiseev, Sennrich, Titov 2019, Analyzing Multi-Head Self-Attention: "
        "Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned, ACL"
    )
    description = "puts its maximum attention on the least frequent token of the sentence"
    probe = "prose"
    default_threshold = 0.3  # headmech's choice (Voita et al. give none): see the docstring
    threshold_note = "share of sentences whose maximum attention goes to the rarest token ≥ 0.3 and at least 3x the chance rate (Voita et al. give no cut); null: the chance rate, 1/sentence length"

    def __init__(
        self, threshold: float | None = None, min_ratio: float = 3.0, *, probe: str | None = None
    ) -> None:
        super().__init__(threshold, probe=probe)
        self.min_ratio = float(min_ratio)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self.threshold}, min_ratio={self.min_ratio})"

    def targets(self, batch: ProbeBatch) -> Bool[Tensor, "batch query_pos key_pos"]:
        """For every ordinary query that is not itself a rarest token, the rarest tokens."""
        count = batch.extras["token_count"]  # [batch, pos], -1 at special tokens and padding
        ordinary = ~batch.special & (count >= 0)
        big = torch.iinfo(count.dtype).max
        lowest = count.masked_fill(~ordinary, big).min(-1, keepdim=True).values  # [batch, 1]
        rare = ordinary & (count == lowest)  # [batch, key_pos]
        query = ordinary & ~rare
        return query[:, :, None] & rare[:, None, :]

    # --- engine -------------------------------------------------------------------
    def _prepare(self, batch: ProbeBatch) -> tuple[Tensor, Tensor]:
        keys = ~batch.special & (batch.extras["token_count"] >= 0)  # [batch, key_pos]
        return self.targets(batch), keys

    def _reduce(
        self,
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
        batch: ProbeBatch,
        prepared: tuple[Tensor, Tensor],
        layer: int,
        rows: slice,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        visible = pattern.amax(1) > 0  # [batch, query, key]: what the layer can attend to
        return self._sums(lambda keys: blockwise.top1(pattern, keys)[1], visible, prepared, rows)

    def _from_rows(
        self,
        view: RowBlock,
        batch: ProbeBatch,
        prepared: tuple[Tensor, Tensor],
        layer: int,
        rows: slice,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        # what the layer can attend to (the argmax of the scores is the pattern's: no softmax)
        visible = view.visible()
        return self._sums(lambda keys: view.top(keys)[1], visible, prepared, rows)

    def _sums(
        self,
        argmax: Callable[[Tensor], Tensor],
        visible: Bool[Tensor, "batch query_pos key_pos"],
        prepared: tuple[Tensor, Tensor],
        rows: slice,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """Hits of each row's argmax over the ordinary keys (``argmax(keys)``) on a
        rarest token, and the chance of one, over the queries that see a rarest token."""
        target, keys = prepared
        width = visible.shape[-1]  # keys after the block's last query are left out
        target = target[:, rows, :width] & visible  # [batch, query, key]
        seen = keys[:, None, :width] & visible
        query = target.any(-1)  # [batch, query]: queries that see a target
        chance = target.sum(-1) / seen.sum(-1).clamp(min=1)  # [batch, query]
        top = argmax(keys)[..., None]  # [batch, head_index, query_pos, 1]
        n_heads = top.shape[1]
        sets = target[:, None].expand(-1, n_heads, -1, -1)
        hit = sets.gather(-1, top)[..., 0]  # [batch, head, query]
        hit = hit & query[:, None]
        n = query.sum(1).double()  # per sequence
        return {
            "hit": (hit.sum(2).double(), n),
            "chance": ((chance * query).sum(1).double()[:, None].expand(-1, n_heads), n),
        }

    def reducers(self) -> list[Reducer]:
        return [
            Reducer(
                self.name, self._reduce, self._prepare, blockwise=True, from_rows=self._from_rows
            )
        ]

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        # no query at all (an empty probe) is no evidence: 0, not NaN
        return stats.mean(f"{self.name}.hit").nan_to_num(0.0)

    def chance(self, stats: HeadStats) -> float:
        """The chance hit rate on the probe's sentences (the same for every head)."""
        return float(stats.mean(f"{self.name}.chance").nan_to_num(0.0).max())

    def rejected(
        self, score: Float[Tensor, "n_layers n_heads"], stats: HeadStats
    ) -> dict[HeadIndex, str]:
        """Heads whose hit rate is below ``min_ratio`` times the chance rate (labelled:
        a hit rate of at least ``threshold`` and of that bar)."""
        chance = self.chance(stats)
        bar = self.min_ratio * chance
        return {
            HeadIndex(a, b): f"hit rate {float(score[a, b]):.2f} < {self.min_ratio:g} x the "
            f"chance rate {chance:.2f}"
            for a, b in (~(score >= bar)).nonzero().tolist()
        }

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        chance = self.chance(stats)
        best = int(score.flatten().argmax())
        top = HeadIndex(best // score.shape[1], best % score.shape[1])
        return {
            "rate": {str(h): round(float(score[h]), 4) for h in heads},
            "chance": round(chance, 4),
            "best_head": [top.layer, top.head],
            "best_rate": round(float(score[top]), 4),
            "n_queries": int(stats.counts[f"{self.name}.hit"].max()),
        }
