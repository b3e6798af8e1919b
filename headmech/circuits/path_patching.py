"""Direct path patching: one head's output, patched only where another head reads it.

Activation patching replaces a head's output everywhere it goes. Path patching (Wang et
al. 2022; Goldowsky-Dill et al. 2023) isolates one *edge* sender → receiver: the
receiver's query, key or value input is recomputed as ``ln1(resid + Δ)`` with

``Δ = (z_src[sender] - z_base[sender]) @ W_O[sender]``,

the difference between the sender's direct write to the residual stream in the other
("source") run and in the run being patched ("base"). Every other reader of the residual
stream, including the receiver's other two inputs, keeps the base run's values, and
everything downstream of the receiver is recomputed. The patch is the
:class:`~headmech.interventions.PathPatch` effect on site ``q``, ``k`` or ``v``, so it runs
in :func:`~headmech.interventions.run_variants` with every other intervention: one
variant per receiver, stacked along the batch axis.

Directions follow :func:`headmech.attribution.patching.patching_importance`:

* ``noising`` (default): base = the task's clean batches, source = its corrupted ones
  (``task.corrupt``); effect = ``metric(patched) - metric(clean)``;
* ``denoising``: base = the corrupted batches, source = the clean ones; effect =
  ``metric(corrupted) - metric(patched)`` (TransformerLens' ``get_act_patch_direct_path``
  patches this way and reports ``metric(patched)``).

Either way a positive effect means the edge carries what the task needs (the metric is a
loss, higher is worse).

**Grouped-query attention.** Keys and values are computed per KV head, and the query heads
of a group share them, so a ``k``/``v`` receiver is a KV head. Receivers are named by query
head as everywhere else in headmech and mapped to their KV head ``h // (n_heads /
n_kv_heads)``; every query head of a group gets the group's effect (one patched run per KV
head). Query receivers are per query head.

**Post-norm models** (BERT) are refused: there a head's write passes through the block's
LayerNorms before any later head reads it, so the direct path is not ``resid + Δ``.
Decoders whose attention output passes through a norm before the residual stream (Gemma
2/3's sandwich norm, OLMo 2) are not: their ``Δ`` is that norm's output change,
``norm(a + Δz @ W_O) - norm(a)`` with ``a`` the base run's attention output; OLMo 2's
attention reads the raw residual (it has no input norm).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import networkx as nx
import torch
from jaxtyping import Float
from torch import Tensor

from headmech.attribution.patching import patching_pairs
from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex, check_heads
from headmech.interventions import Intervention, PathPatch, run_variants
from headmech.interventions.direct_effects import direct_writes as _direct_writes
from headmech.probes import ProbeOptions
from headmech.stream.engine import ProbeBatch
from headmech.tasks import Task, get_task, is_causal

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["add_path_patching_edges", "path_patch", "path_patch_scores"]

Component = Literal["q", "k", "v"]
Direction = Literal["noising", "denoising"]


def _check(model: TransformerBridge, component: str, direction: str) -> None:
    if component not in ("q", "k", "v"):
        raise HeadmechError(f"path-patching component must be q, k or v, got '{component}'")
    if direction not in ("noising", "denoising"):
        raise HeadmechError(f"direction must be 'noising' or 'denoising', got '{direction}'")
    if not is_causal(model):
        raise HeadmechError(
            "path patching needs pre-norm blocks: in this post-norm encoder a head's write is "
            "normalised before later heads read it, so there is no direct path to patch"
        )
    from headmech.core.placement import is_offloaded

    if is_offloaded(model):  # a sender's W_O is read while another block runs
        raise HeadmechError("path patching does not support offloaded models yet")


def _sender(model: TransformerBridge, sender: HeadIndex | Sequence[int] | str) -> HeadIndex:
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    (s,) = check_heads([sender], None, None, "sender")  # a pair or "L18H6"
    if not (0 <= s.layer < n_layers and 0 <= s.head < n_heads):
        raise HeadmechError(f"sender {s} is not a head ({n_layers} layers of {n_heads} heads)")
    return s


def _kv_group(model: TransformerBridge, component: str) -> int:
    """Query heads per KV head for ``component`` (1 for q, and without grouped-query)."""
    if component == "q":
        return 1
    n_heads = int(model.cfg.n_heads)
    return n_heads // int(getattr(model.cfg, "n_key_value_heads", None) or n_heads)


def _targets(
    model: TransformerBridge,
    sender: HeadIndex,
    receivers: Iterable[HeadIndex | Sequence[int]] | None,
    component: str,
) -> dict[HeadIndex, list[int]]:
    """Patched head at the site (a KV head for k/v under GQA) → the query heads it stands for."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    if receivers is None:
        receivers = [(la, h) for la in range(sender.layer + 1, n_layers) for h in range(n_heads)]
    group = _kv_group(model, component)
    out: dict[HeadIndex, list[int]] = {}
    for la, h in check_heads(receivers, None, None, "receivers"):
        if not (sender.layer < la < n_layers and 0 <= h < n_heads):
            raise HeadmechError(
                f"receiver L{la}H{h} is not a head after sender {sender} "
                f"({n_layers} layers of {n_heads} heads)"
            )
        out.setdefault(HeadIndex(int(la), int(h) // group), []).append(int(h))
    return out


def _prepare(
    model: TransformerBridge,
    task: str | Task,
    batches: Sequence[ProbeBatch] | None,
    probe_options: ProbeOptions | None,
) -> tuple[Task, list[ProbeBatch]]:
    if isinstance(task, Tensor):
        raise HeadmechError(
            "path_patch takes a task, not prompt tokens: wrap clean/corrupted prompts and a "
            "metric with headmech.attribution.patching.prompt_pair_task (direction='denoising' "
            "patches as TransformerLens' get_act_patch_direct_path)"
        )
    t = get_task(task, model)
    got = batches if batches is not None else t.batches(model, probe_options or ProbeOptions())
    return t, list(got)


def _measure_layer(
    model: TransformerBridge,
    task: Task,
    pairs: list[tuple[ProbeBatch, ProbeBatch]],
    senders: list[HeadIndex],
    receivers: Iterable[HeadIndex | Sequence[int]] | None,
    component: str,
    sign: float,
) -> Float[Tensor, "n_senders n_layers n_heads"]:
    """Every edge from senders of one layer, in one :func:`run_variants` call (one variant
    per sender and patched receiver head; the senders' writes ``Δ`` from one capture of
    that layer's ``hook_z`` per batch and run)."""
    layer = senders[0].layer
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    out = torch.full((len(senders), n_layers, n_heads), float("nan"))
    edges = [
        (i, site, heads)
        for i, s in enumerate(senders)
        for site, heads in _targets(model, s, receivers, component).items()
    ]
    if not edges:
        return out

    def variants(bi: int, batch: ProbeBatch) -> list[list[Intervention]]:
        base, source = pairs[bi]
        # Δ per sender: its source-minus-base direct write, [batch, pos, d_model]
        effects = [
            PathPatch(model, delta, component)
            for delta in _direct_writes(model, base, source, layer, senders)
        ]
        return [[Intervention((site,), effects[i], component)] for i, site, _ in edges]

    values, base = run_variants(model, task, [b for b, _ in pairs], variants)
    for (i, site, heads), value in zip(edges, values.tolist(), strict=True):
        out[i, site.layer, heads] = sign * (value - base)
    return out


def path_patch(
    model: TransformerBridge,
    task: str | Task,
    sender: HeadIndex | Sequence[int],
    receivers: Iterable[HeadIndex | Sequence[int]] | None = None,
    component: Component = "q",
    *,
    batches: Sequence[ProbeBatch] | None = None,
    direction: Direction = "noising",
    seed: int = 0,
    probe_options: ProbeOptions | None = None,
) -> Float[Tensor, "n_layers n_heads"]:
    """The task's metric change when only the edge sender → receiver is patched, per receiver.

    Args:
        model: a pre-norm ``TransformerBridge`` (decoders; BERT is refused).
        task: a :class:`~headmech.tasks.Task` or its registry name; it must define
            ``corrupt`` (``induction``, ``retrieval``, a prompt-pair task).
        sender: the head whose output is patched, ``(layer, head)``.
        receivers: heads whose ``component`` input receives the patch (default: every head
            of every later layer); under grouped-query attention a ``k``/``v`` receiver
            stands for its KV head (module docstring).
        component: ``"q"``, ``"k"`` or ``"v"``: which input of the receiver is patched.
        batches: the task's clean batches (default: its probe under ``probe_options``).
        direction: ``noising`` (patch the corrupted sender output into the clean run) or
            ``denoising`` (the clean one into the corrupted run).
        seed: seeds the task's corruption.
        probe_options: probe sizes when ``batches`` is not given.

    Returns:
        ``[n_layers, n_heads]``: the effect (positive = the path matters: noising,
        ``metric(patched) - metric(clean)``; denoising, ``metric(corrupted) -
        metric(patched)``); NaN for heads not measured (not after the sender, or not
        among ``receivers``).

    References:
        Wang et al. 2022, "Interpretability in the Wild"; Goldowsky-Dill et al. 2023,
        "Localizing Model Behavior with Path Patching".
    """
    _check(model, component, direction)
    t, clean = _prepare(model, task, batches, probe_options)
    pairs = patching_pairs(model, t, clean, direction, seed)
    sign = 1.0 if direction == "noising" else -1.0
    s = _sender(model, sender)
    return _measure_layer(model, t, pairs, [s], receivers, component, sign)[0]


def path_patch_scores(
    model: TransformerBridge,
    task: str | Task,
    component: Component = "k",
    *,
    senders: Iterable[HeadIndex | Sequence[int]] | None = None,
    receivers: Iterable[HeadIndex | Sequence[int]] | None = None,
    batches: Sequence[ProbeBatch] | None = None,
    direction: Direction = "noising",
    seed: int = 0,
    probe_options: ProbeOptions | None = None,
) -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
    """:func:`path_patch` for many senders, in :func:`headmech.circuits.composition_scores`'
    layout: ``scores[l1, h1, l2, h2]`` is the effect of the edge (l1, h1) → (l2, h2).

    Args:
        model, task, component, batches, direction, seed, probe_options: as
            :func:`path_patch` (the batches and their corruption are shared by all senders).
        senders: default every head of every layer but the last.
        receivers: per sender, the later heads among these (default: every later head).

    Returns:
        ``[n_layers, n_heads, n_layers, n_heads]``, NaN where not measured.

    References:
        Wang et al. 2022, "Interpretability in the Wild".
    """
    _check(model, component, direction)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    t, clean = _prepare(model, task, batches, probe_options)
    pairs = patching_pairs(model, t, clean, direction, seed)
    sign = 1.0 if direction == "noising" else -1.0
    if senders is None:
        senders = [(la, h) for la in range(n_layers - 1) for h in range(n_heads)]
    wanted = None if receivers is None else check_heads(receivers, None, None, "receivers")
    by_layer: dict[int, list[HeadIndex]] = {}
    for sender in senders:
        s = _sender(model, sender)
        by_layer.setdefault(s.layer, []).append(s)
    from headmech.core.progress import steps

    out = torch.full((n_layers, n_heads, n_layers, n_heads), float("nan"))
    layers = steps(sorted(by_layer.items()), "path patching (sender layers)", len(by_layer))
    for layer, group in layers:
        rs = None if wanted is None else [r for r in wanted if r.layer > layer]
        got = _measure_layer(model, t, pairs, group, rs, component, sign)
        for s, grid in zip(group, got, strict=True):
            out[s.layer, s.head] = grid
    return out


def add_path_patching_edges(
    G: nx.MultiDiGraph,
    model: TransformerBridge,
    task: str | Task,
    senders: Iterable[HeadIndex | Sequence[int]],
    component: Component = "q",
    *,
    top_k: int = 3,
    min_ratio: float = 1.0,
    receivers: Iterable[HeadIndex | Sequence[int]] | None = None,
    batches: Sequence[ProbeBatch] | None = None,
    direction: Direction = "noising",
    seed: int = 0,
    probe_options: ProbeOptions | None = None,
) -> nx.MultiDiGraph:
    """Add causal edges to a head graph: for each sender, the ``top_k`` receivers whose
    ``component`` path changes the metric most (by :func:`path_patch_scores`).

    Each edge is a further parallel edge (key and ``kind`` ``"path-q"``/``"path-k"``/
    ``"path-v"``) beside any composition edges of the pair, with ``effect`` (the signed
    metric change), ``score`` (the same number), ``baseline`` (the mean ``|effect|`` over
    every edge measured in this call: all senders, all their receivers) and ``ratio``
    (``|effect| / baseline``: how far the edge stands out among the measured edges, as a
    composition edge's ratio says how far it stands out from random weights).

    Args:
        G: a ``networkx.MultiDiGraph`` (:func:`headmech.circuits.graph`'s); changed in place.
        model, task, component, receivers, batches, direction, seed, probe_options: as
            :func:`path_patch_scores`.
        senders: the heads whose outgoing edges are measured.
        top_k: edges kept per sender at most.
        min_ratio: keep an edge only if ``|effect|`` is at least this times the baseline
            (0: the ``top_k`` of every sender; edges with effect 0 are never added).

    Returns:
        ``G``.

    References:
        Wang et al. 2022, "Interpretability in the Wild".
    """
    if not G.is_multigraph():
        raise HeadmechError("path-patching edges go into a MultiDiGraph (circuits.graph's)")
    heads = [_sender(model, s) for s in senders]
    scores = path_patch_scores(
        model,
        task,
        component,
        senders=heads,
        receivers=receivers,
        batches=batches,
        direction=direction,
        seed=seed,
        probe_options=probe_options,
    )
    rows = torch.stack([scores[s.layer, s.head] for s in heads])  # [sender, layer, head]
    _add_edges(G, heads, rows, f"path-{component}", top_k, min_ratio)
    return G


def _add_edges(
    G: nx.MultiDiGraph,
    senders: list[HeadIndex],
    effects: Float[Tensor, "n_senders n_layers n_heads"],
    kind: str,
    top_k: int,
    min_ratio: float,
) -> None:
    """Each sender's strongest edges, against the mean |effect| of every measured edge."""
    measured = effects[~torch.isnan(effects)]
    baseline = float(measured.abs().mean()) if measured.numel() else 0.0
    if baseline == 0.0:
        return  # nothing measured, or every edge without effect
    floor = max(min_ratio * baseline, 0.0)
    for s, effect in zip(senders, effects, strict=True):
        _add_sender_edges(G, s, effect, kind, top_k, floor, baseline)


def _add_sender_edges(
    G: nx.MultiDiGraph,
    sender: HeadIndex,
    effect: Tensor,
    kind: str,
    top_k: int,
    floor: float,
    baseline: float,
) -> None:
    """The ``top_k`` edges by ``|effect|`` (``[n_layers, n_heads]``, NaN unmeasured) with
    ``|effect|`` above 0 and at least ``floor``."""
    n_heads = effect.shape[1]
    flat = effect.flatten()
    mag = torch.nan_to_num(flat.abs(), nan=-1.0)
    vals, idx = mag.topk(min(top_k, flat.numel()))
    for v, i in zip(vals.tolist(), idx.tolist(), strict=True):
        if v <= 0.0 or v < floor:
            continue
        r = HeadIndex(i // n_heads, i % n_heads)
        for h in (sender, r):
            if str(h) not in G:
                G.add_node(str(h), layer=h.layer, head=h.head, types="")
        e = round(float(flat[i]), 6)
        G.add_edge(
            str(sender),
            str(r),
            key=kind,
            kind=kind,
            effect=e,
            score=e,
            baseline=round(baseline, 6),
            ratio=round(v / baseline, 3),
        )
