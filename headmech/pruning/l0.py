"""L0 head pruning with Hard Concrete gates (Voita et al. 2019).

Each head ``(l, h)`` gets one input-independent gate ``g`` that multiplies its output
``hook_z`` (so ``MultiHead = Concat(g_i · head_i) W^O``). The gates are parametrised by
``log α`` (``[n_layers, n_heads]``) and follow the Hard Concrete distribution of Louizos
et al. 2018, with Voita et al.'s defaults β = 0.33, (γ, ζ) = (−0.1, 1.1), ε = 1e-6 (its
training sample, evaluation gate and ``P(g ≠ 0)``: :mod:`headmech.pruning.concrete`).

The objective is ``L = L_distil + λ · L_C``. ``L_distil`` distils the unpruned model
into the gated one on the prose probe: for causal models the KL divergence
``KL(p_unpruned ‖ p_gated)`` of the next-token distributions, averaged over the real query
positions; for encoders ``1 − cos(e, e0)`` between the gated and unpruned mean-pooled final
hidden states (as :class:`headmech.tasks.EmbeddingTask`). ``L_C`` follows Voita's code:
each layer's ``Σ_h P(g_h ≠ 0)`` is *averaged over layers* (``reduce_mean`` over the
regularisation losses), i.e. ``L_C = Σ_{l,h} P(g ≠ 0) / n_layers``. Only the gates are
trained (Adam); the model's ``requires_grad`` flags are restored afterwards.

``log α`` starts at ``init_log_alpha = 3`` so every evaluation gate starts at exactly 1
(``σ(3)(ζ − γ) + γ > 1``): training starts from the converged, unpruned model as in Voita.

The reported task metric uses the *hard* evaluation mask: a head whose evaluation gate is
0 is zero-ablated, every other head is kept unscaled (pure pruning, no soft rescaling).
It is measured on held-out batches: the task's probe drawn with another seed
(``seed + 1000``), not the batches the gates were trained on.

References:
    Voita, Talbot, Moiseev, Sennrich, Titov 2019, "Analyzing Multi-Head Self-Attention:
    Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned", ACL
    (code: lena-voita/the-story-of-heads, ``lib/layers/concrete_gate.py``).
    Louizos, Welling, Kingma 2018, "Learning Sparse Neural Networks through L0
    Regularization", ICLR.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from headmech.core.placement import model_device
from headmech.interventions import Intervention, Scale, applied, evaluate, hooks
from headmech.models.unembedding import unembed
from headmech.probes import ProbeOptions
from headmech.pruning.concrete import (
    BETA,
    EPS,
    GAMMA,
    ZETA,
    hard_concrete_eval,
    hard_concrete_sample,
    prob_nonzero,
)
from headmech.pruning.result import PruningResult
from headmech.stream.engine import ProbeBatch, run_blocks
from headmech.tasks import Task, get_task, is_causal

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.classify import HeadCatalog

__all__ = [
    "BETA",
    "EPS",
    "GAMMA",
    "ZETA",
    "GateResult",
    "L0Options",
    "L0Sweep",
    "distillation_loss",
    "frozen",
    "gate_hooks",
    "gate_intervention",
    "hard_concrete_eval",
    "hard_concrete_sample",
    "l0_prune",
    "l0_sweep",
    "masked_task_metric",
    "prob_nonzero",
    "train_l0_gates",
]

Hook = tuple[str, Callable[..., Tensor]]


def gate_intervention(
    model: TransformerBridge, gates: Float[Tensor, "n_layers n_heads"]
) -> Intervention:
    """Head ``(l, h)``'s output multiplied by ``gates[l, h]`` (differentiable)."""
    return Intervention.all_heads(model, Scale(gates))


def gate_hooks(model: TransformerBridge, gates: Float[Tensor, "n_layers n_heads"]) -> list[Hook]:
    """``hook_z`` hooks multiplying head ``(l, h)``'s output by ``gates[l, h]``."""
    return hooks(model, [gate_intervention(model, gates)])


@contextmanager
def frozen(model: TransformerBridge) -> Iterator[None]:
    """Set ``requires_grad=False`` on every model parameter; restore the flags on exit."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _query(batch: ProbeBatch) -> Tensor:
    """Positions whose next token is real (the ``lm`` task's query positions)."""
    mask = batch.attention_mask.bool()
    query = torch.zeros_like(mask)
    query[:, :-1] = mask[:, 1:]
    return query


def _outputs(
    model: TransformerBridge, batch: ProbeBatch, interventions: Sequence[Intervention] = ()
) -> Tensor:
    """Causal: log-probabilities at the query positions ``[n_query, d_vocab]``.
    Encoder: mean-pooled final hidden state ``[batch, d_model]``."""
    dev = model_device(model)
    ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
    with applied(model, list(interventions)):
        h = run_blocks(model, ids, mask)  # [batch, pos, d_model]
    if is_causal(model):
        return F.log_softmax(unembed(model, h[_query(batch).to(dev)]).float(), dim=-1)
    m = mask[..., None].to(h.dtype)
    return ((h * m).sum(1) / m.sum(1)).float()


def distillation_loss(
    model: TransformerBridge, student: Tensor, teacher: Tensor
) -> Float[Tensor, ""]:
    """KL(teacher ‖ student) per query position (causal) or mean ``1 − cos`` (encoders)."""
    if is_causal(model):
        return F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    return (1.0 - F.cosine_similarity(student, teacher, dim=-1)).mean()


def masked_task_metric(
    model: TransformerBridge,
    task: Task,
    batches: Sequence[ProbeBatch],
    mask: Float[Tensor, "n_layers n_heads"] | None,
    base: Sequence[Intervention] = (),
) -> float:
    """The task's mean metric with head outputs multiplied by ``mask`` (None: no mask),
    after the interventions ``base``. Encoder references are the clean model's."""
    ivs = [
        *base,
        *([] if mask is None else [gate_intervention(model, mask.to(model_device(model)))]),
    ]
    return evaluate(model, task, batches, ivs)


@dataclass
class GateResult:
    """Trained Hard Concrete gates.

    Attributes:
        lam: the L0 coefficient λ.
        log_alpha: the gate parameters ``[n_layers, n_heads]``.
        eval_gates: evaluation gates ``clip(σ(log α)(ζ − γ) + γ, 0, 1)``.
        heads_kept: heads whose evaluation gate is not 0.
        metric: the task metric with the hard mask (heads with gate 0 zero-ablated).
        base_metric: the task metric of the unpruned model.
        curve: per training step: ``loss``, ``distil``, ``l0`` (``L_C``) and
            ``expected_heads`` (``Σ P(g ≠ 0)``).
        task_metric: what ``metric`` measures.
    """

    lam: float
    log_alpha: Float[Tensor, "n_layers n_heads"]
    eval_gates: Float[Tensor, "n_layers n_heads"]
    heads_kept: int
    metric: float
    base_metric: float
    curve: list[dict[str, float]] = field(default_factory=list)
    task_metric: str = ""

    @property
    def hard_mask(self) -> Float[Tensor, "n_layers n_heads"]:
        """1 for kept heads, 0 for pruned ones."""
        return (self.eval_gates > 0).float()


def _train(
    model: TransformerBridge,
    batches: Sequence[ProbeBatch],
    log_alpha: Tensor,
    lam: float,
    steps: int,
    lr: float,
    hc: tuple[float, float, float],
    gen: torch.Generator,
    base: Sequence[Intervention],
) -> list[dict[str, float]]:
    """Adam on ``log_alpha`` (in place) for ``L = L_distil + λ·L_C``; the loss curve."""
    beta, gamma, zeta = hc
    n_layers = log_alpha.shape[0]
    opt = torch.optim.Adam([log_alpha], lr=lr)
    curve: list[dict[str, float]] = []
    with torch.no_grad():
        teachers = [_outputs(model, b, base) for b in batches]
    for step in range(steps):
        i = step % len(batches)
        g = hard_concrete_sample(log_alpha, beta, gamma, zeta, generator=gen)
        student = _outputs(model, batches[i], [*base, gate_intervention(model, g)])
        distil = distillation_loss(model, student, teachers[i])
        p = prob_nonzero(log_alpha, beta, gamma, zeta)
        l0 = p.sum() / n_layers
        loss = distil + lam * l0
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(
            {
                "loss": float(loss.detach()),
                "distil": float(distil.detach()),
                "l0": float(l0.detach()),
                "expected_heads": float(p.detach().sum()),
            }
        )
    return curve


def _probes(
    model: TransformerBridge, task: Task, options: ProbeOptions | None
) -> tuple[list[ProbeBatch], list[ProbeBatch]]:
    """Training and held-out batches of the task's own probe (held out: seed + 1000).

    Gates distil on the task's probe: gates trained on prose keep the heads prose needs,
    which for the induction task are the wrong ones (measured on toy-induction).
    """
    opts = options or ProbeOptions(n_sentences=32, n_sequences=16)
    return task.batches(model, opts), task.batches(model, replace(opts, seed=opts.seed + 1000))


def train_l0_gates(
    model: TransformerBridge,
    lam: float,
    steps: int = 200,
    lr: float = 0.05,
    *,
    task: str | Task = "lm",
    probe_options: ProbeOptions | None = None,
    init_log_alpha: float = 3.0,
    beta: float = BETA,
    gamma: float = GAMMA,
    zeta: float = ZETA,
    seed: int = 0,
    base: Sequence[Intervention] = (),
) -> GateResult:
    """Train one Hard Concrete gate per head by distillation to the unpruned model.

    Args:
        model: the model; its weights are frozen during training and left unchanged.
        lam: λ in ``L = L_distil + λ · L_C`` (``L_C`` averaged over layers, as Voita's code).
        steps: Adam steps (one probe batch each, cycling through the task's probe).
        lr: Adam learning rate on ``log α``.
        task: the task whose probe the gates are distilled on and whose metric is
            reported with the hard mask, on held-out batches (the probe at ``seed + 1000``).
        probe_options: probe sizes (default 32 sentences / 16 repeated sequences).
        init_log_alpha: initial ``log α`` of every gate (3: all evaluation gates are 1).
        beta, gamma, zeta: Hard Concrete temperature and stretch interval.
        seed: seeds the gate noise.
        base: interventions applied before the gates in every run (teacher and student);
            they define the model being pruned (tests plant head importances this way).

    Returns:
        A :class:`GateResult`.

    References:
        Voita et al. 2019, ACL (module docstring).
    """
    t = get_task(task, model)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    batches, held_out = _probes(model, t, probe_options)
    log_alpha = torch.full((n_layers, n_heads), float(init_log_alpha), device=model_device(model))
    log_alpha.requires_grad_(True)
    gen = torch.Generator().manual_seed(seed)
    with frozen(model):
        curve = _train(model, batches, log_alpha, lam, steps, lr, (beta, gamma, zeta), gen, base)
    la = log_alpha.detach()
    ev = hard_concrete_eval(la, gamma, zeta)
    hard = (ev > 0).float()
    return GateResult(
        lam=float(lam),
        log_alpha=la.cpu(),
        eval_gates=ev.cpu(),
        heads_kept=int(hard.sum()),
        metric=masked_task_metric(model, t, held_out, hard, base),
        base_metric=masked_task_metric(model, t, held_out, None, base),
        curve=curve,
        task_metric=t.description,
    )


@dataclass
class L0Sweep:
    """Gates trained at several λ: heads kept against the task metric."""

    results: list[GateResult]

    @property
    def points(self) -> list[tuple[float, int, float]]:
        """``(λ, heads_kept, metric)`` for each λ, in sweep order."""
        return [(r.lam, r.heads_kept, r.metric) for r in self.results]


def l0_sweep(model: TransformerBridge, lams: Sequence[float], **kwargs: Any) -> L0Sweep:
    """:func:`train_l0_gates` at each λ in ``lams`` (other arguments passed through);
    each λ is a unit of a resumable run (:mod:`headmech.runs.resume`; its gate noise is seeded
    afresh, so a λ read back changes none after it)."""
    from dataclasses import fields

    from headmech.runs.resume import unit

    def one(lam: float) -> dict[str, Any]:
        r = train_l0_gates(model, lam, **kwargs)
        return {f.name: getattr(r, f.name) for f in fields(r)}

    return L0Sweep(
        [GateResult(**unit(f"lambda{i}", partial(one, lam))) for i, lam in enumerate(lams)]
    )


@dataclass
class L0Options:
    """Options of :func:`l0_prune`.

    Attributes:
        lams: the λ values of the sweep.
        steps: gate training steps per λ.
        lr: Adam learning rate on ``log α``.
        seed: seeds the gate noise.
    """

    lams: tuple[float, ...] = (0.01, 0.1, 1.0, 3.0, 10.0)
    steps: int = 100
    lr: float = 0.05
    seed: int = 0


def l0_prune(
    model: TransformerBridge,
    task: str | Task = "lm",
    *,
    lams: Sequence[float] = L0Options.lams,
    steps: int = L0Options.steps,
    lr: float = L0Options.lr,
    seed: int = L0Options.seed,
    probe_options: ProbeOptions | None = None,
    catalog: HeadCatalog | None = None,
    progress: bool = False,
) -> PruningResult:
    """An L0 λ sweep as a pruning trajectory: step 0 is the full model, then one step per
    λ ordered by heads kept (each with its ``lambda``).

    Returns:
        A :class:`~headmech.pruning.result.PruningResult` (``method="l0"``).
    """
    from headmech.pruning.michel import pruning_result
    from headmech.pruning.survival import check_catalog

    check_catalog(catalog, model)
    t = get_task(task, model)
    sweep = l0_sweep(
        model, lams, steps=steps, lr=lr, task=t, probe_options=probe_options, seed=seed
    )
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    everything = [[la, h] for la in range(n_layers) for h in range(n_heads)]
    history: list[dict[str, Any]] = [
        {
            "n_kept": n_layers * n_heads,
            "heads_kept": everything,
            "metric": sweep.results[0].base_metric,
            "lambda": 0.0,
        }
    ]
    for r in sorted(sweep.results, key=lambda r: (-r.heads_kept, r.lam)):
        kept = [[int(a), int(b)] for a, b in (r.hard_mask > 0).nonzero().tolist()]
        history.append(
            {"n_kept": r.heads_kept, "heads_kept": kept, "metric": r.metric, "lambda": r.lam}
        )
    settings = {"lams": list(lams), "steps": steps, "lr": lr, "seed": seed}
    return pruning_result(
        "l0", t, model, history, catalog, n_layers * n_heads, (), probe_options, settings
    )
