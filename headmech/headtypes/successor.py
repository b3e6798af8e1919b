"""Successor heads: the OV circuit maps an ordinal token to its successor (Gould et al. 2023)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer


class SuccessorHead(HeadType):
    """Increment ordinal tokens through the OV circuit (Gould et al. 2023).

    Score (the paper's succession score, from weights): for each ordinal task's tokens
    ``T`` (days, months, letters, number words, ...: :mod:`headmech.probes.ordinal`), the
    effective OV circuit ``M = W_U[:, T]ᵀ · W_OV · MLP0(W_E[T])`` — each token's effective
    embedding (the residual after block 0 for the token alone, so attention 0 and MLP 0
    have acted; RMS/Layer-normalised, norm weights folded into ``W_V`` and ``W_U``) sent
    through the head's values and output and read out on the task's tokens. A pair
    ``t_i → t_{i+1}`` succeeds when ``M``'s row for ``t_i`` peaks at ``t_{i+1}`` among
    ``T``; the score is the fraction of pairs that succeed, pooled over tasks.

    Threshold: the authors publish none; 0.4, the cut of the re-implementation in
    curt-tigges/circuits-over-time (chance is 1/|T|: 0.04–0.14 for these tasks).

    Behavioural metric: next-item loss on ordinal sequences (the ``succession`` task),
    raised by zero-ablating the labelled heads more than as many random heads.

    References:
        Gould, Ong, Ogden, Conmy 2023, "Successor Heads: Recurring, Interpretable
        Attention Heads In The Wild", arXiv:2312.09230.
    """

    name = "successor"
    reference = "Gould et al. 2023"
    citation = (
        "Gould, Ong, Ogden, Conmy 2023, Successor Heads: Recurring, Interpretable Attention "
        "Heads In The Wild, arXiv:2312.09230"
    )
    description = "maps an ordinal token (Monday, March, C) to its successor through its OV circuit"
    probe = "ordinal"
    default_threshold = 0.4
    threshold_note = "share of ordinal items whose successor the head's OV circuit ranks first ≥ 0.4 (the cut of curt-tigges/circuits-over-time; the authors publish none); null: chance, 1/|task| = 0.04-0.14"
    causal_only = True  # the unembedding of the bundled encoder is not trained
    task = "succession"

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """The comma before the next item attends to the previous item (the token the OV
        circuit increments): what
        :func:`headmech.testing.planting.ideal_pattern` plants; the score reads the OV
        circuit alone."""
        pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        return torch.where(batch.extras["next_item"], pos - 1, -1)

    def reducers(self) -> list[Reducer]:
        return []  # a weight-based score: nothing to stream

    def weight_statistics(self, model: Any) -> dict[str, Tensor]:
        succeeded, pairs = succession_counts(model)
        per_task = {
            f"succession.{t}": succeeded[i] / pairs[i]
            for i, t in enumerate(self._tasks)
            if pairs[i] > 0  # tasks without a single-token run are left out
        }
        return {"succession": succeeded.sum(0) / pairs.sum().clamp(min=1), **per_task}

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.succession")

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        per_task = {
            k.split(".", 2)[2]: stats.mean(k)
            for k in stats.sums
            if k.startswith("successor.succession.")
        }
        best = int(score.flatten().argmax())
        top = HeadIndex(best // score.shape[1], best % score.shape[1])
        return {
            "succession_score": {str(h): round(float(score[h]), 4) for h in heads},
            "per_task": {
                t: {str(h): round(float(v[h]), 4) for h in heads} for t, v in per_task.items()
            },
            "best_head": [top.layer, top.head],
            "best_score": round(float(score[top]), 4),
        }

    @property
    def _tasks(self) -> list[str]:
        from headmech.probes.ordinal import ORDINAL_TASKS

        return list(ORDINAL_TASKS)


@torch.no_grad()
def succession_counts(model: Any) -> tuple[Tensor, Tensor]:
    """Per ordinal task, how many of its pairs each head's OV circuit gets right
    ``[n_tasks, n_layers, n_heads]``, and how many pairs it has ``[n_tasks]`` (tasks in
    :data:`headmech.probes.ordinal.ORDINAL_TASKS` order; a task with no single-token run
    has 0 pairs)."""
    from headmech.models.weights import effective_embeddings, head_weights
    from headmech.probes.ordinal import ORDINAL_TASKS, ordinal_runs

    w = head_weights(model)  # norms folded: W_V reads the normalised residual
    runs = ordinal_runs(model.tokenizer)
    n_layers, n_heads = w.W_V.shape[:2]
    succeeded = torch.zeros(len(ORDINAL_TASKS), n_layers, n_heads)
    pairs = torch.zeros(len(ORDINAL_TASKS))
    for i, task in enumerate(ORDINAL_TASKS):
        task_runs = runs.get(task, [])
        if not task_runs:
            continue
        ids = torch.tensor([t for run in task_runs for t in run])
        e = effective_embeddings(model, ids).cpu()  # [n, d_model]
        ov = torch.einsum("nd,lhde,lhef->lhnf", e, w.W_V, w.W_O)  # [L, H, n, d_model]
        logits = ov @ w.W_U[:, ids]  # [L, H, n, n]: each token's output, read on the task's
        top = logits.argmax(-1)  # index into ids
        starts = [0]
        for run in task_runs[:-1]:
            starts.append(starts[-1] + len(run))
        for start, run in zip(starts, task_runs, strict=True):
            src = torch.arange(start, start + len(run) - 1)
            succeeded[i] += (top[:, :, src] == (src + 1)).float().sum(-1)
            pairs[i] += len(run) - 1
    return succeeded, pairs
