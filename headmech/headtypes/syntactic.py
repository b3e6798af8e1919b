"""Syntactic heads: words attend to their dependency partners more than position explains."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.base import at_or_above
from headmech.headtypes.registry import HeadType
from headmech.probes.relations import RELATIONS
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer

DIRECTIONS: tuple[str, ...] = ("dep_to_head", "head_to_dep")
# Word offsets the positional baseline may pick; a relation whose partners are further apart
# has a weaker baseline than any in-range offset would give, never a stronger one.
MAX_OFFSET = 5
OFFSETS: tuple[int, ...] = tuple(range(-MAX_OFFSET, MAX_OFFSET + 1))


def sign_test(acc: Tensor, both: Tensor, baseline: Tensor, cases: Tensor) -> Tensor:
    """One-sided p of a head beating the positional baseline on the same cases (shapes
    broadcast): ``acc`` its accuracy, ``both`` the share both get right, ``baseline`` the
    baseline's accuracy, ``cases`` how many. The exact sign test (McNemar's, conditional on
    the discordant cases): ``n10`` right where the baseline is wrong against ``n01`` the
    reverse, p = P(Bin(n10 + n01, 1/2) >= n10); 1 where no case is discordant."""
    from scipy.stats import binom

    cases = cases.double()
    n11 = (both.double() * cases).round()
    n10 = (acc.double() * cases).round() - n11
    n01 = (baseline.double() * cases).round() - n11
    n10, n01 = torch.broadcast_tensors(n10, n01)
    p = torch.from_numpy(binom.sf(n10.numpy() - 1, (n10 + n01).numpy(), 0.5))
    return torch.where(n10 + n01 > 0, p, torch.ones_like(p))


@dataclass(frozen=True)
class _Cases:
    """One batch's word pooling matrices and (relation, direction) cases."""

    pool_from: Float[Tensor, "batch n_words pos"]  # mean over a word's pieces (queries)
    pool_to: Float[Tensor, "batch n_words pos"]  # sum over a word's pieces (keys)
    blocked: Bool[Tensor, "batch n_words n_words"]  # self, and words with no token
    seq: Int[Tensor, " n_cases"]  # batch row of each case
    query: Int[Tensor, " n_cases"]  # word whose partner is predicted
    partner: Int[Tensor, " n_cases"]  # its true dependency partner
    pair: Int[Tensor, " n_cases"]  # index into SyntacticHead.pairs
    offset: Int[Tensor, " n_cases"]  # partner - query, in words
    counts: Float[Tensor, "batch n_pairs"]  # cases per sequence and pair
    offset_hist: Float[Tensor, "batch n_pairs n_offsets"]  # cases with partner - query == offset


class SyntacticHead(HeadType):
    """A word's most-attended other word is its dependency partner, beyond what position gives.

    On the ``prose`` probe (spaCy parses aligned with the model's tokens), each
    head's token attention is pooled to words as Clark et al. do: attention *from* a
    word split into several tokens is the mean of its tokens' rows, attention *to* it the
    sum of its tokens' columns. A word's predicted partner is its most-attended other word
    (itself and special tokens excluded). For each relation (nsubj, dobj, amod, advmod,
    det, pobj, poss, aux, mark) and direction (dependent -> head, head -> dependent),
    accuracy is the fraction of cases whose predicted partner is the true one, and the
    positional baseline is the accuracy of always predicting the most frequent word offset
    (within -5..+5) for that relation and direction on the same sentences.

    Score: per head, the largest ``accuracy - baseline`` over the (relation, direction)
    pairs with at least ``min_cases`` cases (0 when no pair has that many). A head is
    syntactic when it beats the baseline by ``threshold`` (10 points, Voita et al.) on a
    pair where the gain is also significant: an exact sign test of the head against the
    baseline on the same cases, Benjamini-Hochberg across every (relation, direction)
    pair and head at ``alpha`` (:meth:`significance`), since 9 relations x 2 directions x
    every head is hundreds to thousands of tests.

    Args:
        threshold: accuracy above the positional baseline needed (default 0.10).
        min_cases: cases a (relation, direction) pair needs to count (default 20).
        relations: spaCy dependency labels to test.
        alpha: the false discovery rate (default 0.05).

    References:
        Voita et al. 2019, "Analyzing Multi-Head Self-Attention: Specialized Heads Do the
        Heavy Lifting, the Rest Can Be Pruned", ACL (syntactic heads, positional baseline).
        Clark et al. 2019, "What Does BERT Look At? An Analysis of BERT's Attention",
        BlackboxNLP (word-level attention, most-attended other word, both directions).
    """

    name = "syntactic"
    reference = "Voita et al. 2019"
    citation = (
        "Voita, Talbot, Moiseev, Sennrich, Titov 2019, Analyzing Multi-Head Self-Attention: "
        "Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned, ACL; Clark, "
        "Khandelwal, Levy, Manning 2019, What Does BERT Look At? An Analysis of BERT's "
        "Attention, BlackboxNLP"
    )
    description = (
        "attends from words to their dependency partners more often than position explains"
    )
    probe = "prose"
    default_threshold = 0.10  # Voita et al.: at least 10 points above the positional baseline
    threshold_note = "dependency accuracy ≥ 0.10 above the best positional baseline for a relation: Voita et al.'s ten points; null: the positional baseline (and a shuffled-parse null with Benjamini-Hochberg across relations, directions and heads)"
    score_range = (-1.0, 1.0)  # accuracy minus the positional baseline

    def __init__(
        self,
        threshold: float | None = None,
        min_cases: int = 20,
        relations: Sequence[str] = RELATIONS,
        alpha: float = 0.05,
        *,
        probe: str | None = None,
    ) -> None:
        super().__init__(threshold, probe=probe)
        self.min_cases = int(min_cases)
        self.alpha = float(alpha)
        self.relations = tuple(relations)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(threshold={self.threshold}, min_cases={self.min_cases}, "
            f"relations={self.relations}, alpha={self.alpha})"
        )

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """``(relation, direction)`` in a fixed order."""
        return [(r, d) for r in self.relations for d in DIRECTIONS]

    def _stat(self, relation: str, direction: str, what: str) -> str:
        return f"{self.name}.{relation}.{direction}.{what}"

    # --- engine -------------------------------------------------------------------
    def _prepare(self, batch: ProbeBatch) -> _Cases:
        word_ids: Int[Tensor, "batch pos"] = batch.extras["word_ids"]
        heads: Int[Tensor, "batch pos"] = batch.extras["word_heads"]  # per word, -1 padded
        deps: Int[Tensor, "batch pos"] = batch.extras["word_deps"]
        labels: tuple[str, ...] = batch.extras["dep_labels"]
        n_words = max(int(word_ids.max()) + 1, 1)
        has_word = word_ids >= 0
        # [batch, pos, n_words] -> [batch, n_words, pos]
        pool_to = (
            torch.nn.functional.one_hot(word_ids.clamp(min=0), n_words) * has_word[..., None]
        ).transpose(1, 2)
        pool_to = pool_to.float()
        n_pieces = pool_to.sum(-1, keepdim=True)  # [batch, n_words, 1]
        pool_from = pool_to / n_pieces.clamp(min=1)
        eye = torch.eye(n_words, dtype=torch.bool, device=word_ids.device)
        blocked = (n_pieces[..., 0] == 0)[:, None, :] | eye  # [batch, n_words, n_words]

        seq, query, partner, pair = [], [], [], []
        for r, rel in enumerate(self.relations):
            if rel not in labels:
                continue
            b, dep = (deps[:, :n_words] == labels.index(rel)).nonzero(as_tuple=True)
            head = heads[b, dep]
            keep = head != dep  # a root points to itself: no partner
            b, dep, head = b[keep], dep[keep], head[keep]
            for d, (q, p) in enumerate(((dep, head), (head, dep))):  # DIRECTIONS order
                seq.append(b)
                query.append(q)
                partner.append(p)
                pair.append(torch.full_like(b, 2 * r + d))
        n_pairs = len(self.pairs)
        if seq:
            s, q, p, k = (torch.cat(x) for x in (seq, query, partner, pair))
        else:
            s = q = p = k = torch.zeros(0, dtype=torch.long, device=word_ids.device)
        n_batch = int(word_ids.shape[0])
        unit = s * n_pairs + k  # (sequence, pair): statistics are kept per sequence
        counts = torch.bincount(unit, minlength=n_batch * n_pairs).double()
        counts = counts.view(n_batch, n_pairs)
        offset = p - q
        in_range = offset.abs() <= MAX_OFFSET
        flat = unit[in_range] * len(OFFSETS) + offset[in_range] + MAX_OFFSET
        hist = torch.bincount(flat, minlength=n_batch * n_pairs * len(OFFSETS)).double()
        hist = hist.view(n_batch, n_pairs, len(OFFSETS))  # [batch, n_pairs, n_offsets]
        return _Cases(pool_from, pool_to, blocked, s, q, p, k, offset, counts, hist)

    def _reduce(
        self,
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
        batch: ProbeBatch,
        cases: _Cases,
        layer: int,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        n_heads = pattern.shape[1]
        p_from = cases.pool_from.to(pattern.dtype)[:, None]  # [batch, 1, n_words, pos]
        p_to = cases.pool_to.to(pattern.dtype)[:, None]
        word_attn = p_from @ pattern @ p_to.transpose(-1, -2)  # [batch, head, words, words]
        word_attn = word_attn.masked_fill(cases.blocked[:, None], float("-inf"))
        pred = word_attn.argmax(-1)  # [batch, head_index, n_words]
        hit = pred[cases.seq, :, cases.query] == cases.partner[:, None]  # [n_cases, head]
        n_batch, n_pairs = cases.counts.shape
        hits = torch.zeros(n_batch * n_pairs, n_heads, dtype=torch.float64, device=pattern.device)
        hits.index_add_(0, cases.seq * n_pairs + cases.pair, hit.double())
        hits = hits.view(n_batch, n_pairs, n_heads)  # per sequence
        # hits where the partner lies at each baseline offset: the cases both get right
        at = torch.zeros(len(OFFSETS), n_batch * n_pairs, n_heads, dtype=torch.float64)
        at = at.to(pattern.device)
        for j, off in enumerate(OFFSETS):
            both = hit & (cases.offset == off)[:, None]
            at[j].index_add_(0, cases.seq * n_pairs + cases.pair, both.double())
        at = at.view(len(OFFSETS), n_batch, n_pairs, n_heads)
        out: dict[str, tuple[Tensor, Tensor]] = {}
        for k, (rel, direction) in enumerate(self.pairs):
            n = cases.counts[:, k]  # [batch]
            out[f"{rel}.{direction}.hit"] = (hits[:, k], n)
            for j, off in enumerate(OFFSETS):
                out[f"{rel}.{direction}.hit_at_{off:+d}"] = (at[j, :, k], n)
            # the baseline does not depend on the head: the same histogram for every head
            for j, off in enumerate(OFFSETS):
                out[f"{rel}.{direction}.offset_{off:+d}"] = (
                    cases.offset_hist[:, k, j, None].expand(-1, n_heads),
                    n,
                )
        return out

    def reducers(self) -> list[Reducer]:
        return [Reducer(self.name, self._reduce, self._prepare)]

    # --- decision -----------------------------------------------------------------
    def _table(self, stats: HeadStats) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per pair: accuracy ``[n_pairs, n_layers, n_heads]``, baseline, its offset and
        the number of cases (``[n_pairs]`` each)."""
        acc = torch.stack([stats.mean(self._stat(r, d, "hit")) for r, d in self.pairs])
        n = torch.stack([stats.counts[self._stat(r, d, "hit")].max() for r, d in self.pairs])
        hist = torch.stack(
            [
                torch.stack([stats.mean(self._stat(r, d, f"offset_{o:+d}")).max() for o in OFFSETS])
                for r, d in self.pairs
            ]
        ).nan_to_num(0.0)  # [n_pairs, n_offsets]
        baseline, j = hist.max(-1)
        offset = torch.tensor(OFFSETS)[j]
        return acc.nan_to_num(0.0), baseline, offset, n

    def significance(self, stats: HeadStats) -> tuple[Tensor, Tensor]:
        """Per (relation, direction) pair and head, ``[n_pairs, n_layers, n_heads]``: the
        one-sided p-value of the head beating the positional baseline, and its
        Benjamini-Hochberg q-value across every eligible pair and head.

        The null: the head is no better than always predicting the baseline's offset.
        On the same cases, the exact sign test (McNemar's, conditional on the
        discordant cases) counts those the head gets right and the baseline wrong
        (``n10``) against the reverse (``n01``): p = P(Bin(n10 + n01, 1/2) >= n10), a
        permutation null that swaps the two predictions case by case. Pairs with fewer
        than ``min_cases`` cases are not tested (p = q = 1)."""
        from scipy.stats import false_discovery_control

        acc, baseline, offset, n = self._table(stats)
        both = torch.stack(
            [
                stats.mean(self._stat(r, d, f"hit_at_{int(offset[k]):+d}")).nan_to_num(0.0)
                for k, (r, d) in enumerate(self.pairs)
            ]
        )  # [n_pairs, n_layers, n_heads], a share of the pair's cases
        p = sign_test(acc, both, baseline[:, None, None], n[:, None, None])
        eligible = (n >= self.min_cases)[:, None, None].expand_as(p)
        p = torch.where(eligible, p, torch.ones_like(p))
        q = torch.ones_like(p)
        if bool(eligible.any()):
            q[eligible] = torch.from_numpy(false_discovery_control(p[eligible].numpy()))
        return p.float(), q.float()

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        """Heads none of whose relations above the threshold survives Benjamini-Hochberg
        at ``alpha`` across every relation, direction and head."""
        acc, baseline, _, n = self._table(stats)
        _, q = self.significance(stats)
        gain = acc - baseline[:, None, None]
        passes = at_or_above(gain, self.threshold) & (n >= self.min_cases)[:, None, None]
        best_q = q.masked_fill(~passes, 2.0).min(0).values  # over the passing pairs
        out = {}
        for a, b in (best_q > self.alpha).nonzero().tolist():
            if best_q[a, b] <= 1.0:  # above the threshold somewhere, significant nowhere
                out[HeadIndex(a, b)] = (
                    f"no relation {self.threshold:g} above the positional baseline survives "
                    f"Benjamini-Hochberg at q = {self.alpha:g} over {int((n >= self.min_cases).sum())} "
                    f"relation-directions x {q.shape[1] * q.shape[2]} heads (best q "
                    f"{float(best_q[a, b]):.3f})"
                )
        return out

    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        acc, baseline, _, n = self._table(stats)
        gain = acc - baseline[:, None, None]  # [n_pairs, n_layers, n_heads]
        eligible = (n >= self.min_cases)[:, None, None]
        gain = gain.masked_fill(~eligible, float("-inf")).max(0).values
        # no pair with enough cases: no evidence either way
        return torch.where(torch.isfinite(gain), gain, torch.zeros_like(gain))

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        acc, baseline, offset, n = self._table(stats)
        p, q = self.significance(stats)
        n_heads = acc.shape[-1]
        relations: dict[str, dict[str, Any]] = {}
        per_head: dict[str, list[str]] = {str(h): [] for h in heads}
        for k, (rel, direction) in enumerate(self.pairs):
            best = int(acc[k].flatten().argmax())
            h = HeadIndex(best // n_heads, best % n_heads)
            gain = float(acc[k][h] - baseline[k])
            reaches = bool(at_or_above(torch.tensor(gain), self.threshold))
            passes = bool(int(n[k]) >= self.min_cases and reaches)
            relations.setdefault(rel, {})[direction] = {
                "head": [h.layer, h.head],
                "accuracy": round(float(acc[k][h]), 4),
                "baseline": round(float(baseline[k]), 4),
                "baseline_offset": int(offset[k]),
                "count": int(n[k]),
                "p": float(f"{float(p[k][h]):.3g}"),
                "q": float(f"{float(q[k][h]):.3g}"),
                "syntactic": passes and float(q[k][h]) <= self.alpha,
            }
            if int(n[k]) >= self.min_cases:
                for lh in heads:
                    gain_lh = float(acc[k][lh] - baseline[k])
                    reaches = bool(at_or_above(torch.tensor(gain_lh), self.threshold))
                    if reaches and float(q[k][lh]) <= self.alpha:
                        per_head[str(lh)].append(f"{rel}.{direction}")
        return {
            "relations": relations,
            "head_relations": per_head,
            "min_cases": self.min_cases,
            "alpha": self.alpha,
            "n_tests": int((n >= self.min_cases).sum()) * int(acc.shape[1] * n_heads),
            "above_threshold": len(self.above(score)),
            "surviving_fdr": len(heads),
        }

    def check_model(self, info: Any) -> str | None:
        """Dependency parses need spaCy and its English pipeline (the ``syntactic`` extra)."""
        from headmech.probes.text import parser_problem

        return parser_problem(self.name) or super().check_model(info)
