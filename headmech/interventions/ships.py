"""Ships: safety heads by how far ablating each moves a refused request's reply.

Zhou et al. 2024, "On the Role of Attention Heads in Large Language Model Safety" (code
ydyjya/SafetyHeadAttribution, ``lib/SHIPS/get_ships.py``): a head's Ships on a request the
model refuses is ``KL(p || p')`` of the last token's next-token distribution, ``p'`` with
the head ablated by scaling its query by 0 (``scale_mask``, ``scale_factor`` 0: its scores
all 0, so its attention uniform over the keys it may see); the generalized Ships averages
over the requests. :func:`ships_scores` measures it for every head on the ``refusal``
probe's harmful requests (the task :class:`headmech.tasks.refusal.RefusalShiftTask`), one
forward pass a head, variants stacked along the batch and run from the head's layer on
(:func:`headmech.interventions.runner.run_variants`). ``ablation="query"`` scales the
query by 0 as the authors do; the default ``"uniform"`` sets the pattern to what that
gives, uniform over the causal keys (equal in exact arithmetic: the suite checks it).

:func:`refuses` tells which requests the model refuses: greedy decoding, the reply's start
against :func:`headmech.probes.refusal.is_refusal`. It decodes by repeated full
forward passes, without a KV cache: TransformerLens 4.3.0's bridge returns garbage after
the first cached token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex
from headmech.core.stats import ProbeBatch
from headmech.interventions.effects import Scale, Uniform
from headmech.interventions.intervention import Intervention, applied

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["ships_scores", "refuses"]


def _ablate(heads: Sequence[HeadIndex], how: str, n_layers: int, n_heads: int) -> Intervention:
    if how == "uniform":
        return Intervention.on(heads, Uniform(), site="pattern")
    if how == "query":
        return Intervention.on(heads, Scale(torch.zeros(n_layers, n_heads)), site="q")
    raise InputError(f"unknown Ships ablation {how!r}; known: uniform, query")


def ships_scores(
    model: TransformerBridge,
    *,
    batches: list[ProbeBatch] | None = None,
    n_requests: int = 24,
    heads: Sequence[HeadIndex] | None = None,
    ablation: str = "uniform",
    progress: bool = False,
) -> dict[str, Any]:
    """Every head's (or ``heads``') generalized Ships on the harmful requests of
    ``batches`` (default: the ``refusal`` probe's first ``n_requests``; a caller keeps
    those the model refuses, :func:`refuses`) (module docstring): ``{"ships": [n_layers, n_heads] (NaN: not measured),
    "per_request": [n_harmful, n_heads measured], "heads", "requests"}``."""
    from headmech.interventions.runner import run_variants
    from headmech.probes import ProbeOptions, build_probe
    from headmech.tasks.refusal import RefusalShiftTask

    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    if batches is None:  # the harmful requests alone: the benign ones count nothing
        probe = build_probe("refusal", model, ProbeOptions(n_sequences=n_requests)).batches
        batches = [b.select(b.extras["harmful"].bool()) for b in probe]
        batches = [b for b in batches if b.input_ids.shape[0]]
    heads = list(heads) if heads is not None else [
        HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads)
    ]  # fmt: skip
    variants = [[_ablate([h], ablation, n_layers, n_heads)] for h in heads]
    _, _, sums, counts = run_variants(
        model, RefusalShiftTask(), batches, variants, per_unit=True, progress=progress
    )
    harmful = counts[0] > 0  # units: the requests; benign ones count nothing
    per_request = sums[1:, harmful].T.float()  # [n_harmful, n_heads measured]
    grid = torch.full((n_layers, n_heads), float("nan"))
    for i, h in enumerate(heads):
        grid[h.layer, h.head] = per_request[:, i].mean()
    return {"ships": grid, "per_request": per_request, "heads": heads,
            "requests": int(harmful.sum())}  # fmt: skip


def refuses(
    model: TransformerBridge,
    batches: list[ProbeBatch],
    interventions: Sequence[Intervention] = (),
    n_tokens: int = 8,
) -> tuple[Tensor, list[str]]:
    """Per request (in batch order), whether the greedy reply starts as a refusal, and the
    replies (``n_tokens`` tokens each; ``interventions`` applied throughout)."""
    from headmech.probes.refusal import is_refusal

    tok = model.tokenizer
    replies: list[str] = []
    with torch.no_grad(), applied(model, list(interventions)):
        for b in batches:
            for row in range(b.input_ids.shape[0]):
                ids = b.input_ids[row : row + 1, : int(b.extras["end_pos"][row]) + 1]
                for _ in range(n_tokens):  # no KV cache (module docstring)
                    nxt = model(ids)[0, -1].argmax()
                    ids = torch.cat([ids, nxt.view(1, 1).to(ids)], 1)
                replies.append(tok.decode(ids[0, -n_tokens:], skip_special_tokens=True).strip())
    refused = [is_refusal(r) for r in replies]
    return torch.tensor(refused), replies
