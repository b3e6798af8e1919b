"""Function-vector heads: their mean output carries an in-context task to a prompt that does not show it (Todd et al. 2023)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.base import first_examples
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch


class FunctionVectorHead(HeadType):
    """A head whose mean output at the query restores an in-context task (Todd et al. 2023).

    Probe: ``icl`` (:mod:`headmech.probes.icl`): 8 examples " x: y" of one task
    (antonyms, country capitals, capitalisation) and a query " x:".

    Score: Todd et al.'s average indirect effect (AIE). For each task, the head's mean
    output (``hook_z``) at the query's last token over clean prompts of the task; then, on
    prompts whose example answers are shuffled among the examples (the task no longer
    shows), that mean is patched into the head at the last token alone and the answer's
    probability measured. AIE = mean over prompts of ``p(answer | patched) - p(answer |
    shuffled)``, every task weighted by its prompts (tasks take turns). It is a
    measurement of the model, not of attention: :meth:`model_statistics` runs it on the
    probe's prompts through :func:`headmech.interventions.run_variants` (one variant per
    head, stacked; the edit is at the last token and the answer is read there, so the
    blocks above each head run at that token alone, on the clean run's keys and values:
    24 forwards of the prompts for SmolLM2-135M on 4 prompts, 86 when every pass ran the
    whole prompt; still the catalog's most expensive score, so it reads at most
    ``max_prompts`` of the probe's prompts, default 24: 8 per task). Evidence kept: the query's attention mass on the
    examples' answer tokens, where Todd et al. find these heads look.

    Threshold: 0.01, one percentage point of answer probability (Todd et al. keep the top
    10 heads by AIE of GPT-J, whose AIEs fall from about 0.05 to below 0.01 by the 10th;
    no absolute cut is published).

    Behavioural metric: the answer's loss on clean in-context prompts (``icl`` task),
    which mean-ablating the heads should raise.

    References:
        Todd, Li, Sharma, Mueller, Wallace, Bau 2023, "Function Vectors in Large Language
        Models", arXiv:2310.15213 (code: ericwtodd/function_vectors,
        ``compute_indirect_effect``).
    """

    name = "function_vector"
    reference = "Todd et al. 2023"
    citation = (
        "Todd, Li, Sharma, Mueller, Wallace, Bau 2023, Function Vectors in Large Language "
        "Models, arXiv:2310.15213"
    )
    description = "its mean output at the query carries an in-context task (antonyms, capitals)"
    probe = "icl"
    default_threshold = 0.01
    threshold_note = "average indirect effect ≥ 0.01: patching the head's mean output raises the answer's probability by at least one percentage point (Todd et al.'s ranking has no cut; their top-10 AIEs in GPT-J fall below 0.01); null: 0, no effect"
    # patched minus shuffled probability; a quarter of the answer's probability moved by
    # one head's mean is beyond any head Todd et al. report (GPT-J's best: about 0.05)
    score_range = (-0.25, 0.25)
    threshold_range = (-1.0, 1.0)  # a difference of probabilities
    causal_only = True
    task = "icl"
    ablation = "mean"

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """The query's last token looks at the examples' answers."""
        n = batch.input_ids.shape[1]
        last = batch.attention_mask.sum(1) - 1  # [batch]
        is_last = torch.arange(n, device=last.device)[None] == last[:, None]  # [batch, pos]
        return is_last[:, :, None] & batch.extras["label"][:, None, :]

    def __init__(
        self, threshold: float | None = None, max_prompts: int = 24, *, probe: str | None = None
    ) -> None:
        super().__init__(threshold, probe=probe)
        # the indirect effect costs about one suffix pass per head and prompt: bound it
        self.max_prompts = int(max_prompts)

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        return {"aie": indirect_effects(model, first_examples(batches, self.max_prompts))}

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return stats.mean(f"{self.name}.aie")

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        mass = stats.mean(f"{self.name}.mass")
        order = score.flatten().argsort(descending=True)[:10].tolist()
        top = [HeadIndex(i // score.shape[1], i % score.shape[1]) for i in order]
        return {
            "aie": {str(h): round(float(score[h]), 4) for h in top},
            "label_mass": {str(h): round(float(mass[h]), 4) for h in top},
            "n_prompts": int(stats.counts[f"{self.name}.mass"].max())
            if f"{self.name}.mass" in stats
            else 0,
        }


@torch.no_grad()
def indirect_effects(
    model: Any,
    batches: Sequence[ProbeBatch] | None = None,
    *,
    n_prompts: int = 32,
    seed: int = 0,
) -> Float[Tensor, "n_layers n_heads"]:
    """Todd et al.'s average indirect effect of every head (class docstring) on the
    ``icl`` probe's ``batches`` (default: ``n_prompts`` prompts from ``seed``); the
    shuffled prompts are seeded by ``seed``."""
    from headmech.interventions import Intervention, Set, capture, run_variants
    from headmech.probes import ProbeOptions, build_probe
    from headmech.probes.icl import shuffle_labels
    from headmech.tasks.data import icl_task

    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    if batches is None:
        options = ProbeOptions(n_sequences=n_prompts, seed=seed)
        batches = build_probe("icl", model, options).batches
    names = [f"blocks.{la}.attn.hook_z" for la in range(n_layers)]
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    for b in batches:  # each task's mean output per head at the last token (same length)
        got = capture(model, b, names)
        z = torch.stack([got[n][:, -1] for n in names], 1).float()  # [batch, L, H, d_head]
        for row, task in enumerate(b.extras["task"]):
            sums[task] = sums.get(task, 0) + z[row]  # [n_layers, n_heads, d_head]
            counts[task] = counts.get(task, 0) + 1
    mean = {t: sums[t] / counts[t] for t in sums}
    shuffled = [shuffle_labels(b, model, seed) for b in batches]
    heads = [(la, h) for la in range(n_layers) for h in range(n_heads)]

    def variants(bi: int, batch: ProbeBatch) -> list[list[Intervention]]:
        rows = torch.stack([mean[t] for t in batch.extras["task"]])  # [batch, L, H, d_head]
        return [
            [Intervention.on([(la, h)], Set(rows[:, la, h][:, None, None]), "z", pos=-1)]
            for la, h in heads
        ]

    from headmech.core.progress import active

    task = icl_task(probability=True)
    desc = f"function-vector indirect effects ({len(heads)} heads)" if active() else False
    values, clean = run_variants(model, task, shuffled, variants, progress=desc)
    # the metric is minus the answer's probability: patched minus shuffled probability
    return (clean - values).float().view(n_layers, n_heads).cpu()
