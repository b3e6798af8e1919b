"""LOCOS's headline test at any scale: mean-ablate the same share of heads, watch recall.

LOCOS (arXiv 2607.01002) mean-ablates the top 50 of Qwen3-8B's 1,152 heads (4.3%) by its
logit-contribution score: NoLiMa recall falls from 0.401 to 0.000, random sets of as many
heads move it by at most 0.05, and parametric recall does not move. :func:`share_ablation`
repeats that on any decoder: the ``probe``'s trials (``nonliteral``: NoLiMa's design,
LOCOS's task; ``literal`` or ``documents`` where a model answers no non-literal needle),
LOCOS's score of every head on them (:func:`headmech.interventions.sources.locos_scores`),
its top ``round(share x heads)`` mean-ablated (each head's mean output over the probe's
tokens, :func:`headmech.interventions.ablation.mean_outputs`), then

- recall: the share of the trials the clean model answers (its top token is the answer)
  that it still answers ablated; the relative fall is one minus that;
- the same for ``draws`` sets of as many heads drawn uniformly from the rest (LOCOS's
  control), with the exact permutation p of the top set's fall among them
  (``(1 + #draws falling as far) / (1 + draws)``);
- parametric recall: the ``facts`` prompts (no context) the clean model answers, under
  the same ablations (``n_facts=0``: not asked).

The refusal comes first: a model that answers none of the trials has no recall to take
away (:class:`~headmech.core.errors.InputError`, before any head is scored).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex, top_k
from headmech.core.stats import ProbeBatch

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["LOCOS_SHARE", "share_ablation"]

LOCOS_SHARE = 50 / 1152
"""LOCOS's ablated share: the top 50 of Qwen3-8B's 1,152 heads."""


def _pick(batches: list[ProbeBatch], keep: Tensor) -> list[ProbeBatch]:
    """The rows of ``batches`` where ``keep`` (one flag a row, in batch order) holds."""
    sizes = [b.input_ids.shape[0] for b in batches]
    return [b.select(k) for b, k in zip(batches, keep.split(sizes), strict=True) if bool(k.any())]


def _kept(model: TransformerBridge, batches: list[ProbeBatch], hooks: Any) -> float:
    """The share of ``batches`` (all answered clean) the model still answers."""
    from headmech.interventions.intervention import applied
    from headmech.probes.facts import answer_is_top

    with applied(model, hooks):
        return float(answer_is_top(model, batches).float().mean())


def _ablated(
    model: TransformerBridge,
    sets: list[list[HeadIndex]],
    means: Tensor,
    trials: list[ProbeBatch],
    prompts: list[ProbeBatch],
    progress: bool,
) -> tuple[list[float], list[float]]:
    """Per head set, mean-ablated: the share of ``trials`` and of ``prompts`` (the facts;
    none: NaN) still answered."""
    from headmech.interventions.ablation import ablation

    kept, facts_kept = [], []
    for i, heads in enumerate(sets):
        hooks = [ablation(heads, "mean", means)]
        kept.append(_kept(model, trials, hooks))
        facts_kept.append(_kept(model, prompts, hooks) if prompts else float("nan"))
        if progress:
            print(f"share_ablation: set {i + 1}/{len(sets)}: recall kept {kept[-1]:.2f}, facts {facts_kept[-1]:.2f}")  # fmt: skip
    return kept, facts_kept


def _answered(
    model: TransformerBridge, probe: str, n: int, what: str
) -> tuple[list[ProbeBatch], Tensor]:
    """The ``probe``'s first ``n`` sequences and which the model answers (its top token at
    the end is the answer); a one-line error where it answers none."""
    from headmech.probes import ProbeOptions, build_probe
    from headmech.probes.facts import answer_is_top

    batches = build_probe(probe, model, ProbeOptions(n_sequences=n)).batches
    answered = answer_is_top(model, batches)
    if not bool(answered.any()):
        raise InputError(f"the model answers none of the {len(answered)} {probe} {what}")
    return batches, answered


def share_ablation(
    model: TransformerBridge,
    *,
    probe: str = "nonliteral",
    n_questions: int = 48,
    n_facts: int = 64,
    share: float = LOCOS_SHARE,
    draws: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """LOCOS's test on ``model`` (module docstring): a JSON-ready record of the top set,
    the clean and ablated recalls, the random draws' and the parametric recall's.

    Raises:
        InputError: the model answers none of the probe's trials or none of the facts, or
            ``share`` leaves no head to ablate or none to draw controls from.
    """
    from headmech.interventions.ablation import mean_outputs, random_heads
    from headmech.interventions.sources import locos_scores

    t0 = time.perf_counter()
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    k = round(share * n_layers * n_heads)
    if not 1 <= k <= n_layers * n_heads // 2:
        raise InputError(f"share {share:g} of {n_layers * n_heads} heads is {k} heads")
    batches, answered = _answered(model, probe, n_questions, "trials: no recall to take away")
    known, prompts = torch.zeros(0, dtype=torch.bool), []
    if n_facts:
        facts, known = _answered(model, "facts", n_facts, "prompts")
        prompts = _pick(facts, known)
    trials = _pick(batches, answered)
    # LOCOS's score over the answered trials (its authors' average over correct trials)
    scores = locos_scores(model, batches=trials, probe=probe, answered_only=False)["score"]
    top = top_k(scores, k)
    means = mean_outputs(model, batches)
    gen = torch.Generator().manual_seed(seed)
    sets: list[list[HeadIndex]] = [top] + [
        random_heads(n_layers, n_heads, k, exclude=top, generator=gen) for _ in range(draws)
    ]
    kept, facts_kept = _ablated(model, sets, means, trials, prompts, progress)
    fall = [1 - x for x in kept]
    return {
        "probe": probe, "share": share, "k": k, "heads": [str(h) for h in top],
        "trials": len(answered), "answered": int(answered.sum()),
        "recall": float(answered.float().mean()),
        "facts": len(known), "facts_answered": int(known.sum()),  # n_facts=0: none asked
        "fall": fall[0], "facts_fall": 1 - facts_kept[0],
        "random_fall": fall[1:], "random_facts_fall": [1 - x for x in facts_kept[1:]],
        "random_sets": [[str(h) for h in s] for s in sets[1:]],
        "p": (1 + sum(f >= fall[0] for f in fall[1:])) / (1 + draws), "draws": draws,
        "seed": seed, "seconds": time.perf_counter() - t0,
    }  # fmt: skip
