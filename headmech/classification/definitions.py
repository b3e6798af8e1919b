"""Competing definitions of one head role, side by side: which heads each picks.

Four published definitions compete for "the heads that retrieve from context" (Wu et al.
2024's copy-paste retrieval score, QRHead's query-to-document attention, LOCOS's logit
contribution, causal retrieval importance). Each paper compares against its own baselines
only. This module scores heads by the definitions that are not catalog types and compares
any two rankings by the overlap of their top-``k`` sets (Jaccard), the first column of the
agreement matrix.

* :func:`qrhead_scores`: QRHead (Wu, Zhang et al. 2025, "Query-Focused Retrieval Heads
  Improve Long-Context Reasoning and Re-ranking", arXiv 2506.09944; code
  princeton-pli/QRHead): a head's attention mass from the question's tokens to the gold
  document, averaged over the question's tokens and over the questions, on the
  ``documents`` probe (:mod:`headmech.probes.documents`). The paper keeps the top 16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.core.head_index import top_k as top_k  # re-exported: the rankings compared

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.core.stats import ProbeBatch

__all__ = ["QRHEAD_TOP_K", "jaccard", "qrhead_scores", "query_to_gold", "top_k"]

QRHEAD_TOP_K = 16
"""Heads QRHead keeps (its paper's default on Llama-3.1-8B)."""


def query_to_gold(batch: ProbeBatch) -> Tensor:
    """``Bool[batch, query_pos, key_pos]``: from each token of the question (``query_start``
    to ``query_end``) to every token of the gold document (``doc_start`` to ``doc_end`` of
    document ``gold``); other queries have no target."""
    n_seq, n_pos = batch.input_ids.shape
    pos = torch.arange(n_pos)
    rows = torch.arange(n_seq)
    gold = batch.extras["gold"]
    lo, hi = batch.extras["doc_start"][rows, gold], batch.extras["doc_end"][rows, gold]
    asks = (pos >= batch.extras["query_start"][:, None]) & (
        pos < batch.extras["query_end"][:, None]
    )
    keys = (pos >= lo[:, None]) & (pos < hi[:, None])  # [batch, key_pos]
    return asks[:, :, None] & keys[:, None, :]


def qrhead_scores(
    model: TransformerBridge,
    n_questions: int = 40,
    *,
    seed: int = 0,
    batches: list[ProbeBatch] | None = None,
) -> Tensor:
    """QRHead's score of every head, ``[n_layers, n_heads]``: the mean attention mass from
    a question's tokens to its gold document (module docstring), over ``n_questions`` of
    the ``documents`` probe (or the given ``batches`` of it)."""
    from headmech.probes import ProbeOptions, build_probe
    from headmech.stream.engine import stream_statistics
    from headmech.stream.reducers import target_reducer

    if batches is None:
        options = ProbeOptions(n_sequences=n_questions, seed=seed)
        batches = build_probe("documents", model, options).batches
    stats = stream_statistics(model, batches, [target_reducer("qrhead", query_to_gold, hits=False)])
    return stats.mean("qrhead.mass")


def jaccard(a: list[HeadIndex] | set[HeadIndex], b: list[HeadIndex] | set[HeadIndex]) -> float:
    """``|a ∩ b| / |a ∪ b|`` of two head sets (1.0 for two empty sets)."""
    x, y = set(a), set(b)
    return len(x & y) / len(x | y) if x | y else 1.0
