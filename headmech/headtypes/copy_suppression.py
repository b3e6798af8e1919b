"""Copy-suppression heads: lower the logit of the token they attend to (McDougall et al. 2023)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer

N_TOKENS = 500  # word tokens sampled for the OV circuit (seeded)
TOP_K = 10  # the paper's: the token's own logit among the 10 most negative


class CopySuppressionHead(HeadType):
    """Suppress the tokens they attend to through the OV circuit (McDougall et al. 2023).

    Score (the paper's OV-circuit test, from weights): for a token ``t``, its effective
    embedding ``W_EE[t]`` (the residual after block 0 for ``t`` alone; normalised, norm
    weights folded into ``W_V`` and ``W_U``) through the head's values and output gives
    logits over the whole vocabulary, ``W_U · W_OV · W_EE[t]``; the head suppresses ``t``
    when ``t``'s own logit is among the 10 most negative. The score is the share of
    tokens suppressed, over 500 word tokens (a leading space and letters only) drawn with
    a seed. McDougall et al. report 84.7% for GPT-2 small's L10H7; chance is 10 / d_vocab.

    Threshold: the authors publish none; 0.5, a majority of tokens suppressed, well below
    L10H7's 84.7% and over 2,000 times chance for a 50k vocabulary.

    Behavioural metric (the ``copy_suppression`` task, McDougall et al.'s own): on prose,
    at the positions where the clean model's top prediction is a token already in the
    context, that token's log-probability; ablating copy-suppression heads should raise it
    (the naive copy is no longer suppressed). Average next-token loss is not the claim:
    a head that suppresses over-predicted copies can leave it almost unchanged.

    References:
        McDougall, Conmy, Rushing, McGrath, Nanda 2023, "Copy Suppression:
        Comprehensively Understanding an Attention Head", arXiv:2310.04625.
    """

    name = "copy_suppression"
    reference = "McDougall et al. 2023"
    citation = (
        "McDougall, Conmy, Rushing, McGrath, Nanda 2023, Copy Suppression: Comprehensively "
        "Understanding an Attention Head, arXiv:2310.04625"
    )
    description = (
        "lowers the logit of the token it attends to (negative OV circuit on its diagonal)"
    )
    probe = "prose"
    default_threshold = 0.5
    threshold_note = "share of prose tokens whose logit the head lowers when it attends to their earlier copy ≥ 0.5 (a majority; the authors publish no cut); null: chance, 1/vocabulary"
    causal_only = True  # the unembedding of the bundled encoder is not trained
    task = "copy_suppression"
    claim = (
        "McDougall et al.: ablating the heads raises the log-probability of the in-context "
        "token the model predicts (the copy they suppress), more than ablating random heads"
    )

    def __init__(
        self, threshold: float | None = None, n_tokens: int = N_TOKENS, *, probe: str | None = None
    ) -> None:
        super().__init__(threshold, probe=probe)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
            raise InputError(
                f"copy_suppression: n_tokens must be an integer >= 1, got {n_tokens!r}"
            )
        self.n_tokens = n_tokens  # word tokens of the OV circuit (cost: linear in them)

    def __repr__(self) -> str:
        more = "" if self.n_tokens == N_TOKENS else f", n_tokens={self.n_tokens}"
        return f"{type(self).__name__}(threshold={self.threshold}{more})"

    def targets(self, batch: ProbeBatch) -> Tensor:
        """A copy suppressor attends to an earlier copy of the current token (each query's
        latest earlier copy, else none): what
        :func:`headmech.testing.planting.ideal_pattern` plants; the score reads the OV
        circuit alone."""
        ids = batch.input_ids
        n = ids.shape[1]
        earlier = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-1)
        same = (ids[:, :, None] == ids[:, None, :]) & earlier & ~batch.special[:, None, :]
        pos = torch.arange(n, device=ids.device)
        last = torch.where(same, pos, -1).amax(-1)
        return last.masked_fill(batch.special, -1)

    def reducers(self) -> list[Reducer]:
        return []  # a weight-based score: nothing to stream

    def weight_statistics(self, model: Any) -> dict[str, Tensor]:
        return {
            "suppression": suppression_scores(model, word_tokens(model.tokenizer, self.n_tokens))
        }

    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.suppression")

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        best = int(score.flatten().argmax())
        top = HeadIndex(best // score.shape[1], best % score.shape[1])
        return {
            "suppressed_share": {str(h): round(float(score[h]), 4) for h in heads},
            "best_head": [top.layer, top.head],
            "best_share": round(float(score[top]), 4),
            "n_tokens": self.n_tokens,
            "top_k": TOP_K,
        }


def word_tokens(tokenizer: Any, n: int = N_TOKENS, seed: int = 0) -> Tensor:
    """Up to ``n`` token ids that decode to a space and letters (" house"), drawn with a
    seed from the whole vocabulary, in id order."""
    vocab = len(tokenizer)
    words = [
        i
        for i in range(vocab)
        if (s := tokenizer.decode([i])).startswith(" ") and len(s) > 2 and s[1:].isalpha()
    ]
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(words), generator=g)[:n]
    return torch.tensor(words, dtype=torch.long)[pick].sort().values


def suppression_scores(model: Any, ids: Tensor | None = None) -> Float[Tensor, "n_layers n_heads"]:
    """Per head, the share of tokens ``ids`` (default :func:`word_tokens`) whose own logit
    under the head's effective OV circuit is among the ``TOP_K`` most negative of the
    whole vocabulary."""
    from headmech.models.weights import own_token_ranks

    ids = word_tokens(model.tokenizer) if ids is None else ids
    _, below = own_token_ranks(model, ids)  # tokens more suppressed than t itself
    return (below < TOP_K).float().mean(-1)
