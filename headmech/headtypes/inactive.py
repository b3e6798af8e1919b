"""Inactive heads: write almost nothing on every input domain (Sandoval-Segura et al. 2025)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import HeadType
from headmech.stream.engine import HeadStats, ProbeBatch


class InactiveHead(HeadType):
    """A head whose output is small beside its layer's on every input domain.

    Probe: ``domains`` (:mod:`headmech.probes.domains`): prose, Python code and repeated
    random tokens, in separate batches.

    Score: Sandoval-Segura et al.'s layer-normalised average head output norm (AHON-LN).
    Per domain, a head's output norm is ``‖z_h W_O[h]‖`` (its write to the residual
    stream, before any post-attention norm), averaged over the domain's real, non-special
    tokens, and divided by the mean of that average over its layer's heads: 1 is a typical
    head of the layer, 0 a head that writes nothing. The score is the inactivity
    ``1 - max over domains of the ratio``: high only when the head is quiet on every
    domain, so that zeroing it is safe wherever the model is used.

    Threshold: 0.5, i.e. an output norm at most half the layer's mean on every domain.
    The paper sweeps thresholds on its layer-normalised scores and keeps the largest set
    whose zero-ablation leaves MMLU within 1% (no single cut is published); half the
    layer's mean is this catalog's fixed cut, and validation checks the same 1% criterion
    on next-token loss, against random sets of as many heads.

    Evidence kept beside it (``details``): the ratio per domain; heads that are quiet on
    some domains and not others (Guo et al.'s active–dormant heads); and each head's mean
    attention on the first token, the weight-based score the paper compares with (AWFT):
    the labelled heads whose first-token attention is below ``first_token_threshold`` are
    those an attention-sink criterion would miss.

    Behavioural metric: next-token loss on prose (``lm`` task), which zeroing the labelled
    heads should change by at most 1% of its clean value and less than random heads do
    (``expected_effect = "little"``): the catalog's link to pruning.

    References:
        Sandoval-Segura, Wang, Panda, Goldblum, Basri, Goldstein, Jacobs 2025,
        "Identifying and Evaluating Inactive Heads in Pretrained LLMs", arXiv:2504.03889;
        Guo, Kong, Shen, Yan, Zhou, Hu, Soatto, Darrell, Su 2024, "Active-Dormant
        Attention Heads: Mechanistically Demystifying Extreme-Token Phenomena in LLMs",
        arXiv:2410.13835.
    """

    name = "inactive"
    reference = "Sandoval-Segura et al. 2025"
    citation = (
        "Sandoval-Segura, Wang, Panda, Goldblum, Basri, Goldstein, Jacobs 2025, Identifying "
        "and Evaluating Inactive Heads in Pretrained LLMs, arXiv:2504.03889"
    )
    description = "writes almost nothing (small output norm beside its layer) on every domain"
    probe = "domains"
    default_threshold = 0.5  # output norm at most half the layer's mean (see the docstring)
    threshold_note = "1 - output norm / the layer's mean norm ≥ 0.5 on every domain: the head writes at most half of what its layer's heads do (Guo et al. sweep their cut; this is the catalog's); null: 0, a typical head of its layer"
    causal_only = True  # the validation is next-token loss
    task = "lm"
    expected_effect = "little"
    claim = (
        "zeroing the labelled heads changes next-token loss on prose by at most 1% of its "
        "clean value and less than as many random heads (the paper: inactive heads are "
        "zero-ablated with MMLU within 1%)"
    )
    score_range = (-1.0, 1.0)  # 1 - output-norm ratio: 0 is a typical head of its layer
    first_token_threshold = 0.5  # first-token attention that counts as a sink (AWFT)

    # --- what the engine computes -------------------------------------------------
    def targets(self, batch: ProbeBatch) -> Tensor:
        """Every real query but the first attends to the first token (a dormant head's
        pattern; streamed as the first-token attention kept beside the norm)."""
        pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        ok = ~batch.special & (pos >= 1)
        return torch.zeros_like(batch.input_ids).masked_fill(~ok, -1)

    def model_statistics(self, model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
        norms = output_norms(model, batches)
        ratios = {d: n / n.mean(1, keepdim=True).clamp(min=1e-12) for d, n in norms.items()}
        out = {f"ratio.{d}": r for d, r in ratios.items()}
        out.update({f"norm.{d}": n for d, n in norms.items()})
        out["ratio"] = torch.stack(list(ratios.values())).amax(0)
        return out

    # --- decision -----------------------------------------------------------------
    def score(self, stats: HeadStats) -> Float[Tensor, "n_layers n_heads"]:
        return 1.0 - stats.mean(f"{self.name}.ratio")

    def details(self, stats: HeadStats, score: Tensor, heads: list[HeadIndex]) -> dict[str, Any]:
        domains = sorted(
            k.split(".")[-1] for k in stats.sums if k.startswith(f"{self.name}.ratio.")
        )
        ratio = {d: stats.mean(f"{self.name}.ratio.{d}") for d in domains}
        mass = stats.mean(f"{self.name}.mass")
        cut = 1.0 - self.threshold  # the ratio at or below which a domain counts as quiet
        n_layers, n_heads = score.shape
        every = [HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads)]
        quiet = {h: [d for d in domains if float(ratio[d][h]) <= cut] for h in every}
        sinks = [h for h in every if float(mass[h]) >= self.first_token_threshold]
        return {
            "ratio_by_domain": {
                str(h): {d: round(float(ratio[d][h]), 4) for d in domains} for h in heads
            },
            "first_token_mass": {str(h): round(float(mass[h]), 4) for h in heads},
            "active_dormant": {str(h): q for h, q in quiet.items() if q and len(q) < len(domains)},
            "missed_by_first_token": [[h.layer, h.head] for h in heads if h not in sinks],
            "first_token_only": [[h.layer, h.head] for h in sinks if h not in heads],
            "first_token_threshold": self.first_token_threshold,
            "inactive_fraction": round(len(heads) / max(n_layers * n_heads, 1), 4),
        }


@torch.no_grad()
def output_norms(model: Any, batches: Sequence[ProbeBatch]) -> dict[str, Tensor]:
    """Per domain (``extras["domain"]``, else ``"all"``), every head's mean output norm
    ``‖z_h W_O[h]‖`` over the real, non-special tokens, ``[n_layers, n_heads]`` each."""
    from headmech.interventions.intervention import capture_z

    n_layers = int(model.cfg.n_layers)
    w_o = [model.blocks[la].attn.W_O.detach().float() for la in range(n_layers)]
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    for b in batches:
        domain = str(b.extras.get("domain", "all"))
        z = capture_z(model, b)  # [n_layers, batch, pos, n_heads, d_head]
        real = (b.attention_mask.bool() & ~b.special).to(z.device)
        per_layer = []
        for la in range(n_layers):
            out = torch.einsum("nhd,hdm->nhm", z[la][real], w_o[la].to(z.device))
            per_layer.append(out.norm(dim=-1).double().sum(0).cpu())  # [n_heads]
        sums[domain] = sums.get(domain, 0) + torch.stack(per_layer)
        counts[domain] = counts.get(domain, 0) + int(real.sum())
    return {d: (sums[d] / max(counts[d], 1)).float() for d in sums}
