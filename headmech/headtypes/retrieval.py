"""Retrieval heads: copy the needle's tokens out of a long context (Wu et al. 2024)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.probes.needle import needle_spans
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer

if TYPE_CHECKING:
    from headmech.stream.rows import RowBlock


class RetrievalHead(HeadType):
    """At each answer token, the head's top-1 attention is on the same token in the needle.

    Probe: ``needle`` (:mod:`headmech.probes.needle`): prose haystacks of several lengths
    with a needle sentence ("The secret code of the blue door is 7-4-2-9-1-3.") at several
    depths, a question at the end, then the answer (the code).

    Score: Wu et al.'s copy-paste score, under **teacher forcing**. The answer is appended
    to the prompt and the sequence runs forward once; at each answer token (the query is
    the token before it, as in a decoding step) a head copy-pastes if its top-1 attended
    position lies inside the needle sentence and holds the token being produced. Each
    such step adds 1/|answer|; the score is the mean over trials. Wu et al. decode greedily
    and keep only trials the model answers (ROUGE recall > 50%); teacher forcing scores
    every trial at the cost of one forward pass each (no decoding loop) and does not
    depend on whether this model recalls the needle, so planted heads in random control
    models are scored the same way. Evidence kept: attention mass on the needle and the
    top-1 hit rate on the exact source position, at answer steps.

    Behaviour (the ``retrieval`` task): the mean negative log-likelihood of the
    teacher-forced answer tokens (continuous; 0 is perfect recall). Validation masks
    heads with uniform attention over the keys they may see, as Wu et al. do.

    References:
        Wu, Wang, Xiao, Peng, Fu 2024, "Retrieval Head Mechanistically Explains
        Long-Context Factuality", arXiv:2404.15574 (code: nightdessert/Retrieval_Head,
        ``retrieval_head_detection.py::retrieval_calculate``).
    """

    name = "retrieval"
    reference = "Wu et al. 2024"
    citation = (
        "Wu, Wang, Xiao, Peng, Fu 2024, Retrieval Head Mechanistically Explains "
        "Long-Context Factuality, arXiv:2404.15574"
    )
    description = "copy-pastes the needle's tokens from a long context into the answer"
    probe = "needle"
    default_threshold = 0.1  # the paper's: copy-pastes at least 10% of the answer
    threshold_note = "share of the needle's answer tokens the head copy-pastes ≥ 0.1: Wu et al.'s own cut; null: 0 (a head that never attends to the token it outputs)"
    causal_only = True
    task = "retrieval"  # needle answer NLL (teacher-forced)
    ablation = "uniform"

    # --- what the engine computes -------------------------------------------------
    def broad_targets(self, batch: ProbeBatch) -> Tensor:
        from headmech.probes.broad import copy_of_next

        return copy_of_next(batch)  # earlier copies of the token that comes next

    def targets(self, batch: ProbeBatch) -> Int[Tensor, "batch query_pos"]:
        """The needle position of the token each answer step produces (-1 elsewhere):
        a perfect retrieval head's top-1 key (used by
        :func:`headmech.testing.planting.ideal_pattern`)."""
        answer_pos, source_pos, valid, _ = needle_spans(batch)
        t = torch.full_like(batch.input_ids, -1)  # [batch, query_pos]
        query = (answer_pos - 1).clamp(min=0)
        return t.scatter(1, query, torch.where(valid, source_pos, query.new_full((), -1)))

    def reducers(self) -> list[Reducer]:
        def fn(pattern: Tensor, batch: ProbeBatch, prepared: Any, layer: int, rows: slice) -> dict:
            return sums(lambda idx: pattern.gather(2, idx), pattern.shape, batch, prepared, rows)

        def from_rows(
            view: RowBlock, batch: ProbeBatch, prepared: Any, layer: int, rows: slice
        ) -> dict:
            # only the answer steps' rows become probabilities: exp(score - LSE)
            return sums(view.rows_at, view.scores.shape, batch, prepared, rows)

        def sums(
            steps_at: Callable[[Tensor], Tensor],
            shape: torch.Size,
            batch: ProbeBatch,
            prepared: Any,
            rows: slice,
        ) -> dict:
            query, target, source_pos, valid_all, span = prepared
            _, n_heads, n_rows, n_key = shape
            # this block's answer steps: their query rows fall in ``rows``
            local = query - rows.start
            valid = valid_all & (local >= 0) & (local < n_rows)
            idx = local.clamp(0, n_rows - 1)[:, None, :, None].expand(-1, n_heads, -1, n_key)
            steps = steps_at(idx)  # [batch, head_index, answer, key_pos]
            top = steps.argmax(-1)  # [batch, head_index, answer]
            flat = top.flatten(1)  # [batch, head_index * answer]
            in_span = span.gather(1, flat).view_as(top)
            same = batch.input_ids.gather(1, flat).view_as(top) == target[:, None]
            w = valid[:, None].to(steps.dtype)  # [batch, 1, answer]
            copy = (in_span & same).to(steps.dtype) * w
            n_steps = valid_all.sum(1, keepdim=True).clamp(min=1).to(steps.dtype)  # [batch, 1]
            on_span = span[:, None, None, :n_key].to(steps.dtype)  # keys 0 .. n_key - 1
            mass = (steps * on_span).sum(-1)  # [batch, head, answer]
            src_hit = (top == source_pos[:, None]).to(steps.dtype) * w
            n = valid.sum(1)  # per trial (sequence), this block's steps
            # one trial counts once: its steps' shares over the blocks sum to 1 (a trial
            # with no valid step counts in the first block)
            share = n / n_steps[:, 0] + (~valid_all.any(1) & (rows.start == 0))
            return {
                "copy": (copy.sum(-1) / n_steps, share),
                "needle_mass": ((mass * w).sum(2), n),
                "source_hit": (src_hit.sum(2), n),
            }

        def prepare(batch: ProbeBatch) -> tuple[Tensor, ...]:
            answer_pos, source_pos, valid, span = needle_spans(batch)
            query = (answer_pos - 1).clamp(min=0)  # [batch, answer]
            target = batch.input_ids.gather(1, answer_pos.clamp(min=0))  # [batch, answer]
            return query, target, source_pos, valid, span

        return [Reducer(self.name, fn, prepare, blockwise=True, from_rows=from_rows)]

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.copy")

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        mass = stats.mean(f"{self.name}.needle_mass")
        hit = stats.mean(f"{self.name}.source_hit")
        n_layers, n_heads = score.shape
        return {
            "scoring": "teacher-forced copy-paste score over every trial",
            "fraction_of_heads": round(len(heads) / (n_layers * n_heads), 4),
            "needle_mass": {str(h): round(float(mass[h]), 4) for h in heads},
            "source_hit_rate": {str(h): round(float(hit[h]), 4) for h in heads},
            "n_trials": int(stats.counts[f"{self.name}.copy"][0, 0]),
        }
