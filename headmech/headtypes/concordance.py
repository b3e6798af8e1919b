"""Concordance heads: from a verb, attend to the noun it agrees with in number (Kamath et al. 2025)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.base import at_or_above
from headmech.headtypes.registry import HeadType
from headmech.headtypes.syntactic import sign_test
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer

# distances (in tokens) from the verb back to the noun it agrees with that the statistics
# are kept for: the attractor is one back, the subject 4 to about 10 (prepositions of one to
# four words)
MAX_OFFSET = 16
OFFSETS: tuple[int, ...] = tuple(range(1, MAX_OFFSET + 1))


class ConcordanceHead(HeadType):
    """From a verb, the most-attended other token is the noun the verb agrees with in
    number, whether that noun is the subject or the attractor, more often than position
    explains.

    Probe: ``agreement`` (:mod:`headmech.probes.agreement`): "The keys to the cabinet are"
    and, with the same nouns, the ungrammatical "The keys to the cabinet is": the subject
    ("keys") and the *attractor* ("cabinet") differ in number, each pair of nouns is asked
    at four distances (prepositions of one to four words), and each prompt ends in either
    verb. In a grammatical prompt the noun the verb agrees with is the subject; in its
    twin, the attractor. A head that finds the subject by syntax or by position attends to
    the same noun in both and is right in half of them; a head that matches on number
    (Kamath et al.'s concordance heads: the verb's query and the nouns' keys meet on
    grammatical number) follows the verb.

    Score: as the ``syntactic`` type scores a relation (Voita et al. 2019; Clark et al.
    2019). From the verb, the head's prediction is its most-attended other token (itself
    and special tokens excluded); accuracy is the share of prompts where that is the noun
    the verb agrees with. The positional baseline is the accuracy of always predicting the
    most common distance of that noun on the same prompts (one back, the attractor, in
    the ungrammatical half: 0.5). The score is accuracy minus the baseline; a head is
    labelled at ``threshold`` (10 points, Voita et al.'s) when the gain is also
    significant: the exact sign test of the head against the baseline on the same prompts
    (McNemar's, on the discordant prompts), Benjamini-Hochberg across every head at
    ``alpha``, with at least ``min_cases`` prompts. Kept beside it: accuracy on each half
    and the share of prompts where the head picks the subject whatever the verb.

    Behaviour: the ``agreement`` task, minus the logit difference of the verb of the
    subject's number over the other at the attractor (Linzen et al. 2016), which
    mean-ablating the heads should raise if the number they match on is what the model
    predicts the verb from.

    Args:
        threshold: accuracy above the positional baseline needed (default 0.10).
        min_cases: prompts needed for a verdict (default 20).
        alpha: the false discovery rate (default 0.05).

    References:
        Kamath, Ameisen, Kauvar, Luger, Gurnee, Pearce, Zimmerman, Batson, Conerly, Olah,
        Lindsey 2025, "Tracing Attention Computation Through Feature Interactions",
        Transformer Circuits Thread (concordance heads). Linzen, Dupoux, Goldberg 2016,
        "Assessing the Ability of LSTMs to Learn Syntax-Sensitive Dependencies", TACL
        (agreement across attractors).
    """

    name = "concordance"
    reference = "Kamath et al. 2025"
    citation = (
        "Kamath, Ameisen, Kauvar, Luger, Gurnee, Pearce, Zimmerman, Batson, Conerly, Olah, "
        "Lindsey 2025, Tracing Attention Computation Through Feature Interactions, "
        "Transformer Circuits Thread; Linzen, Dupoux, Goldberg 2016, Assessing the Ability "
        "of LSTMs to Learn Syntax-Sensitive Dependencies, TACL"
    )
    description = (
        "attends from a verb to the noun that agrees with it in number, subject or attractor"
    )
    probe = "agreement"
    default_threshold = 0.10  # Voita et al.'s ten points above the positional baseline
    threshold_note = "share of prompts whose most-attended other token from the verb is the noun it agrees with (the subject, or the attractor after the wrong verb) ≥ 0.10 above the positional baseline (the most common distance of that noun: 0.5), as the syntactic type; null: that baseline, with a sign test and Benjamini-Hochberg across heads"
    causal_only = True
    task = "agreement"
    ablation = "mean"
    claim = (
        "mean-ablating the labelled heads lowers the logit difference of the verb of the "
        "subject's number over the other at the attractor more than as many random heads "
        "(Linzen et al.'s agreement; Kamath et al.: the heads match on number)"
    )
    score_range = (-1.0, 1.0)  # accuracy minus the positional baseline

    def __init__(
        self,
        threshold: float | None = None,
        min_cases: int = 20,
        alpha: float = 0.05,
        *,
        probe: str | None = None,
    ) -> None:
        super().__init__(threshold, probe=probe)
        self.min_cases = int(min_cases)
        self.alpha = float(alpha)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(threshold={self.threshold}, min_cases={self.min_cases}, "
            f"alpha={self.alpha})"
        )

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Int[Tensor, "batch query_pos"]:
        """From the verb, the noun it agrees with: the subject, or the attractor after the
        verb of the attractor's number (-1 elsewhere)."""
        t = torch.full_like(batch.input_ids, -1)
        rows = torch.arange(t.shape[0], device=t.device)
        t[rows, batch.extras["verb_pos"].to(t.device)] = _agreeing(batch).to(t.device)
        return t

    def _reduce(
        self,
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
        batch: ProbeBatch,
        prepared: Any,
        layer: int,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        dev = pattern.device
        verb, subj, target = (
            x.to(dev)
            for x in (batch.extras["verb_pos"], batch.extras["subj_pos"], _agreeing(batch))
        )
        agrees = batch.extras["agrees"].to(dev).double()
        rows = torch.arange(pattern.shape[0], device=dev)
        last = pattern[rows, :, verb]  # [batch, head, key_pos]: the verb's row
        keys = torch.arange(pattern.shape[-1], device=dev)
        other = (keys[None, :] < verb[:, None]) & ~batch.special.to(dev)
        pred = last.masked_fill(~other[:, None], float("-inf")).argmax(-1)  # [batch, head]
        hit = (pred == target[:, None]).double()
        ones = torch.ones(pattern.shape[0], dtype=torch.float64, device=dev)
        n_heads = last.shape[1]

        def at(pos: Tensor) -> Tensor:
            return last.gather(-1, pos[:, None, None].expand(-1, n_heads, 1))[..., 0].double()

        out = {
            "hit": (hit, ones),
            "mass": (at(target), ones),  # on the noun the verb agrees with
            "subject": ((pred == subj[:, None]).double(), ones),  # picks the subject
            "grammatical": (hit * agrees[:, None], agrees),
            "ungrammatical": (hit * (1 - agrees)[:, None], 1 - agrees),
        }
        offset = verb - target
        for d in OFFSETS:
            here = (offset == d).double()[:, None]  # [batch, 1]
            out[f"hit_at_{d}"] = (hit * here, ones)  # the prompts both get right, at d
            out[f"offset_{d}"] = (here.expand_as(hit), ones)  # the same for every head
        return out

    def reducers(self) -> list[Reducer]:
        return [Reducer(self.name, self._reduce)]

    # --- decision -----------------------------------------------------------------
    def _table(self, stats: HeadStats) -> tuple[Tensor, float, int, int]:
        """Accuracy ``[n_layers, n_heads]``, the positional baseline, its distance and the
        number of prompts."""
        acc = stats.mean(f"{self.name}.hit").nan_to_num(0.0)
        n = int(stats.counts[f"{self.name}.hit"].max())
        shares = torch.stack(
            [stats.mean(f"{self.name}.offset_{d}").max() for d in OFFSETS]
        ).nan_to_num(0.0)
        baseline, j = shares.max(0)
        return acc, float(baseline), OFFSETS[int(j)], n

    def significance(self, stats: HeadStats) -> tuple[Tensor, Tensor]:
        """Per head ``[n_layers, n_heads]``: the one-sided p-value of the head beating the
        positional baseline and its Benjamini-Hochberg q across every head.

        The null: the head is no better than always predicting the baseline's distance.
        On the same prompts the exact sign test counts those the head gets right and the
        baseline wrong (``n10``) against the reverse (``n01``): p = P(Bin(n10 + n01, 1/2)
        >= n10). With fewer than ``min_cases`` prompts, p = q = 1."""
        from scipy.stats import false_discovery_control

        acc, baseline, offset, n = self._table(stats)
        both = stats.mean(f"{self.name}.hit_at_{offset}").nan_to_num(0.0)
        p = sign_test(acc, both, torch.tensor(baseline), torch.tensor(n))
        if n < self.min_cases:
            return torch.ones_like(p).float(), torch.ones_like(p).float()
        q = torch.from_numpy(false_discovery_control(p.flatten().numpy())).view_as(p)
        return p.float(), q.float()

    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        acc, baseline, _, _ = self._table(stats)
        return acc - baseline

    def rejected(self, score: Tensor, stats: HeadStats) -> dict[HeadIndex, str]:
        """Heads at the threshold whose gain does not survive Benjamini-Hochberg."""
        _, _, _, n = self._table(stats)
        _, q = self.significance(stats)
        out = {}
        for a, b in (at_or_above(score, self.threshold) & (q > self.alpha)).nonzero().tolist():
            why = (
                f"{n} prompts, fewer than {self.min_cases}: no verdict"
                if n < self.min_cases
                else f"its gain over the positional baseline does not survive "
                f"Benjamini-Hochberg at q = {self.alpha:g} over {q.numel()} heads "
                f"(q {float(q[a, b]):.3f})"
            )
            out[HeadIndex(a, b)] = why
        return out

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        acc, baseline, offset, n = self._table(stats)
        p, q = self.significance(stats)
        shown = self.above(score)

        def per_head(values: Tensor, digits: int = 4) -> dict[str, float]:
            return {str(h): round(float(values[h]), digits) for h in shown}

        return {
            "prompts": n,
            "baseline": round(baseline, 4),
            "baseline_offset": offset,
            "accuracy": per_head(acc),
            "grammatical": per_head(stats.mean(f"{self.name}.grammatical")),
            "ungrammatical": per_head(stats.mean(f"{self.name}.ungrammatical")),
            "picks_subject": per_head(stats.mean(f"{self.name}.subject")),
            "mass": per_head(stats.mean(f"{self.name}.mass")),
            "p": {str(h): float(f"{float(p[h]):.3g}") for h in shown},
            "q": {str(h): float(f"{float(q[h]):.3g}") for h in shown},
            "min_cases": self.min_cases,
            "alpha": self.alpha,
            "n_tests": int(acc.numel()),
        }


def _agreeing(batch: ProbeBatch) -> Tensor:
    """Per prompt, the position of the noun its verb agrees with."""
    e = batch.extras
    return torch.where(e["agrees"].bool(), e["subj_pos"], e["attr_pos"])
