"""Head circuits as graphs: weight-based composition and direct path patching.

Heads work in circuits: a previous-token head writes "the token before me" into each
position, and an induction head's *key* reads it (K-composition, Elhage et al. 2021).
Composition scores measure, from the weights alone, how much of a later head's QK or OV
circuit reads what an earlier head's OV circuit writes:

* Q-composition: ``‖W_OV¹ W_QK²‖_F / (‖W_OV¹‖_F ‖W_QK²‖_F)`` (the sender feeds the query side),
* K-composition: ``‖W_OV¹ W_QK²ᵀ‖_F / (...)`` (the key side),
* V-composition: ``‖W_OV¹ W_OV²‖_F / (...)`` (the value side),

with ``W_OV = W_V W_O`` and ``W_QK = W_Q W_Kᵀ`` in TransformerLens' row-vector convention,
norm weights folded in and grouped-query K/V expanded to query heads
(:func:`headmech.weights.head_weights`). Random matrices of the same shapes already score
around ``1/sqrt(d_model)``-ish, so every score comes with that baseline
(:func:`composition_baseline`). Path patching (Wang et al. 2022) measures one edge
causally on prompts; :func:`path_patch` wraps TransformerLens' exact direct-path patch.

:func:`graph` turns scores into a ``networkx.DiGraph`` of heads labelled with their
catalog types; :func:`circuit` wraps it in a :class:`Circuit` whose ``save`` writes the
GraphML, node-link JSON and figure that ``headmech circuit`` writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import networkx as nx
import torch
from jaxtyping import Float
from torch import Tensor

from headmech.errors import HeadmechError
from headmech.heads import HeadIndex
from headmech.weights import HeadWeights, head_weights

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classify import HeadCatalog

__all__ = [
    "Circuit",
    "add_path_patching_edges",
    "circuit",
    "composition_baseline",
    "composition_scores",
    "draw",
    "graph",
    "path_patch",
    "save_graph",
]

Kind = Literal["q", "k", "v"]


def _gram(X: Tensor) -> Tensor:
    # X: [..., d_model, d_head] -> XᵀX: [..., d_head, d_head]
    return X.transpose(-1, -2) @ X


def _factored_norm_sq(gx: Tensor, m: Tensor, gy: Tensor) -> Tensor:
    """‖X M Yᵀ‖_F² = tr(Mᵀ XᵀX M YᵀY), from the small Gram matrices (never d_model x d_model)."""
    a = m.transpose(-1, -2) @ gx @ m  # Mᵀ XᵀX M
    return (a * gy.transpose(-1, -2)).sum((-1, -2))


def _scores(w: HeadWeights, kind: Kind) -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
    W_Q, W_K, W_V, W_O = (t.double().contiguous() for t in (w.W_Q, w.W_K, w.W_V, w.W_O))
    n_layers, n_heads = W_Q.shape[:2]
    # sender OV = V1 O1 = X1 M1 Y1ᵀ with X1 = V1, M1 = I, Y1 = O1ᵀ
    gV, gOt = _gram(W_V), W_O @ W_O.transpose(-1, -2)  # [L, H, d_head, d_head]
    gQ, gK = _gram(W_Q), _gram(W_K)
    ov_norm = torch.einsum("lhab,lhba->lh", gV, gOt).clamp(min=0).sqrt()  # ‖V O‖_F
    qk_norm = torch.einsum("lhab,lhba->lh", gQ, gK).clamp(min=0).sqrt()  # ‖Q Kᵀ‖_F
    out = torch.zeros(n_layers, n_heads, n_layers, n_heads, dtype=torch.float64)
    for l1 in range(n_layers - 1):
        for l2 in range(l1 + 1, n_layers):
            # middle factor: O1 (d_head x d_model) times the receiver's reading matrix
            if kind == "q":  # V1 O1 Q2 K2ᵀ: X = V1, M = O1 Q2, Y = K2
                m = torch.einsum("idm,jme->ijde", W_O[l1], W_Q[l2])
                sq = _factored_norm_sq(gV[l1][:, None], m, gK[l2][None])
                denom = ov_norm[l1][:, None] * qk_norm[l2][None]
            elif kind == "k":  # V1 O1 K2 Q2ᵀ: X = V1, M = O1 K2, Y = Q2
                m = torch.einsum("idm,jme->ijde", W_O[l1], W_K[l2])
                sq = _factored_norm_sq(gV[l1][:, None], m, gQ[l2][None])
                denom = ov_norm[l1][:, None] * qk_norm[l2][None]
            else:  # V1 O1 V2 O2: X = V1, M = O1 V2, Y = O2ᵀ
                m = torch.einsum("idm,jme->ijde", W_O[l1], W_V[l2])
                sq = _factored_norm_sq(gV[l1][:, None], m, gOt[l2][None])
                denom = ov_norm[l1][:, None] * ov_norm[l2][None]
            out[l1, :, l2, :] = sq.clamp(min=0).sqrt() / denom.clamp(min=1e-30)
    return out.float()


@torch.no_grad()
def composition_scores(
    model: TransformerBridge, kind: Kind = "k", weights: HeadWeights | None = None
) -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
    """Composition score of every (sender, receiver) pair; 0 where the sender is not earlier.

    ``scores[l1, h1, l2, h2]``: how much head (l2, h2)'s ``kind`` side reads what head
    (l1, h1) writes.

    References:
        Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits".
    """
    if kind not in ("q", "k", "v"):
        raise HeadmechError(f"composition kind must be q, k or v, got '{kind}'")
    return _scores(weights or head_weights(model), kind)


@torch.no_grad()
def composition_baseline(
    model: TransformerBridge, kind: Kind = "k", n_samples: int = 4, seed: int = 0
) -> float:
    """Mean composition score of Gaussian matrices with the model's shapes (2 layers' worth)."""
    cfg = model.cfg
    d_model, d_head, n_heads = int(cfg.d_model), int(cfg.d_head), int(cfg.n_heads)
    g = torch.Generator().manual_seed(seed)
    vals = []
    for _ in range(n_samples):

        def r(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g)

        w = HeadWeights(
            W_Q=r(2, n_heads, d_model, d_head),
            W_K=r(2, n_heads, d_model, d_head),
            W_V=r(2, n_heads, d_model, d_head),
            W_O=r(2, n_heads, d_head, d_model),
            W_E=r(1, d_model),
            W_U=r(d_model, 1),
        )
        vals.append(float(_scores(w, kind)[0, :, 1, :].mean()))
    return sum(vals) / len(vals)


def _senders(
    scores: Tensor, receiver: HeadIndex, top_k: int, floor: float
) -> list[tuple[HeadIndex, float]]:
    """The ``top_k`` earlier heads with the highest score into ``receiver``, above ``floor``."""
    n_heads = scores.shape[1]
    s = scores[: receiver.layer, :, receiver.layer, receiver.head]  # [sender_layer, sender_head]
    vals, idx = s.flatten().topk(min(top_k, s.numel()))
    return [
        (HeadIndex(i // n_heads, i % n_heads), v)
        for v, i in zip(vals.tolist(), idx.tolist(), strict=True)
        if v >= floor
    ]


def graph(
    model: TransformerBridge,
    catalog: HeadCatalog | None = None,
    *,
    kinds: Sequence[Kind] = ("q", "k", "v"),
    receivers: Sequence[HeadIndex] | None = None,
    top_k: int = 3,
    min_ratio: float = 1.5,
) -> nx.DiGraph:
    """A graph of heads whose edges carry composition scores.

    Args:
        model: the bridge.
        catalog: labels nodes with head types (and picks receivers: every labelled head).
        kinds: composition kinds to include.
        receivers: heads whose inputs to explain (default: the catalog's labelled heads,
            else every head).
        top_k: per receiver and kind, the strongest senders kept.
        min_ratio: keep an edge only if its score is at least this times the random baseline.

    Returns:
        ``networkx.DiGraph``; nodes ``"L{l}H{h}"`` with ``layer``, ``head``, ``types``;
        edges with ``kind``, ``score``, ``baseline``, ``ratio``.
    """
    w = head_weights(model)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    labels = catalog.labels() if catalog is not None else {}
    if receivers is None:
        everyone = [HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads)]
        receivers = list(labels) if labels else everyone
    G = nx.DiGraph(model=str(getattr(model, "headmech_name", "model")))

    def add_node(h: HeadIndex) -> str:
        if str(h) not in G:
            G.add_node(str(h), layer=h.layer, head=h.head, types=",".join(labels.get(h, [])))
        return str(h)

    for h in labels:
        add_node(h)
    for kind in kinds:
        scores = composition_scores(model, kind, w)
        base = composition_baseline(model, kind)
        for r in receivers:
            for sender, v in _senders(scores, r, top_k, min_ratio * base):
                G.add_edge(
                    add_node(sender),
                    add_node(r),
                    kind=kind,
                    score=round(v, 5),
                    baseline=round(base, 5),
                    ratio=round(v / base, 3),
                )
    return G


@dataclass
class Circuit:
    """A head graph and what it was computed from; ``save(dir)`` writes what the
    ``headmech circuit`` command writes.

    Attributes:
        graph: nodes ``"L{l}H{h}"`` (``layer``, ``head``, ``types``), edges with ``kind``,
            ``score``, ``baseline``, ``ratio``.
        model: the model's short name.
    """

    graph: nx.DiGraph
    model: str = ""

    def edges(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Edges, strongest (ratio to the random baseline) first."""
        return sorted(self.graph.edges(data=True), key=lambda e: -e[2]["ratio"])

    def save(self, out: str | os.PathLike) -> dict[str, str]:
        """Write ``circuit.graphml``, ``circuit.json`` (node-link) and ``circuit.png``."""
        files = save_graph(self.graph, out)
        files["png"] = os.path.join(out, "circuit.png")
        draw(self.graph, files["png"])
        return files


def circuit(
    model: TransformerBridge,
    catalog: HeadCatalog | None = None,
    *,
    kinds: Sequence[Kind] = ("q", "k", "v"),
    top_k: int = 3,
    min_ratio: float = 1.5,
) -> Circuit:
    """:func:`graph` as a :class:`Circuit` (receivers: the catalog's labelled heads)."""
    for k in kinds:
        if k not in ("q", "k", "v"):
            raise HeadmechError(f"composition kinds are q, k and v, got '{k}'")
    G = graph(model, catalog, kinds=kinds, top_k=top_k, min_ratio=min_ratio)
    return Circuit(G, str(getattr(model, "headmech_name", "model")))


def save_graph(G: nx.DiGraph, out: str | os.PathLike) -> dict[str, str]:
    """Write ``circuit.graphml`` and ``circuit.json`` (node-link) into folder ``out``."""
    os.makedirs(out, exist_ok=True)
    gml = os.path.join(out, "circuit.graphml")
    js = os.path.join(out, "circuit.json")
    nx.write_graphml(G, gml)
    with open(js, "w") as f:
        json.dump(nx.node_link_data(G, edges="edges"), f, indent=1)
    return {"graphml": gml, "json": js}


def draw(G: nx.DiGraph, path: str | os.PathLike | None = None, title: str = "") -> Any:
    """Heads placed by (layer, head), coloured by their first catalog type (seaborn palette);
    edge width grows with the score's ratio to the random baseline."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    types = sorted({t.split(",")[0] for _, t in G.nodes(data="types") if t})
    palette = dict(zip(types, sns.color_palette("tab10", max(len(types), 1)), strict=False))
    pos = {n: (d["layer"], -d["head"]) for n, d in G.nodes(data=True)}
    colors = [
        palette.get(d["types"].split(",")[0], (0.8, 0.8, 0.8)) if d["types"] else (0.8, 0.8, 0.8)
        for _, d in G.nodes(data=True)
    ]
    fig, ax = plt.subplots(
        figsize=(max(6, 0.5 * (1 + max((p[0] for p in pos.values()), default=1))), 5)
    )
    styles = {"q": "solid", "k": "dashed", "v": "dotted"}
    for kind, style in styles.items():
        edges = [(u, v) for u, v, k in G.edges(data="kind") if k == kind]
        widths = [0.5 + G.edges[e]["ratio"] / 2 for e in edges]
        nx.draw_networkx_edges(
            G, pos, edgelist=edges, style=style, width=widths, ax=ax, alpha=0.6, arrows=True
        )
    nx.draw_networkx_nodes(G, pos, node_color=colors, node_size=350, ax=ax)
    nx.draw_networkx_labels(G, pos, font_size=6, ax=ax)
    for t, c in palette.items():
        ax.scatter([], [], color=c, label=t)
    for kind, style in styles.items():
        ax.plot([], [], linestyle=style, color="k", label=f"{kind}-composition")
    ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("layer")
    ax.set_title(title or f"{G.graph.get('model', '')}: head composition")
    from headmech.plot import finish

    return finish(fig, path)


def path_patch(
    model: TransformerBridge,
    clean_tokens: Tensor,
    corrupt_tokens: Tensor,
    metric: Callable[[Tensor], Tensor],
    sender: HeadIndex,
    component: Kind = "q",
) -> Float[Tensor, "n_layers n_heads"]:
    """Direct path patching (Wang et al. 2022) of one sender into every later head's
    ``component`` input: the metric on the corrupted run with only the edge
    sender → (l, h) restored to its clean value. Wraps TransformerLens'
    ``get_act_patch_direct_path`` (exact edge patch on the bridge).

    Grouped-query models share K/V inputs between query heads, so K/V path patching is not
    defined per query head there: a one-line error says so.

    References:
        Wang et al. 2022, "Interpretability in the Wild"; Goldowsky-Dill et al. 2023,
        "Localizing Model Behavior with Path Patching".
    """
    from transformer_lens.patching import get_act_patch_direct_path

    n_kv = getattr(model.cfg, "n_key_value_heads", None) or model.cfg.n_heads
    if component in ("k", "v") and n_kv != model.cfg.n_heads:
        raise HeadmechError(
            f"{component}-path patching is not defined per query head under grouped-query attention "
            f"({model.cfg.n_heads} query heads share {n_kv} KV heads); use q, or composition scores"
        )
    if clean_tokens.shape != corrupt_tokens.shape:
        raise HeadmechError("clean and corrupt prompts must have the same token length")
    z = f"blocks.{sender.layer}.attn.hook_z"
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean_tokens, names_filter=lambda n: n == z)
        _, corrupt_cache = model.run_with_cache(corrupt_tokens, names_filter=lambda n: n == z)
        return get_act_patch_direct_path(
            model,
            corrupt_tokens,
            clean_cache,
            corrupt_cache,
            metric,
            sender.layer,
            sender.head,
            component,
            verbose=False,
        ).cpu()


def add_path_patching_edges(
    G: nx.DiGraph,
    model: TransformerBridge,
    clean_tokens: Tensor,
    corrupt_tokens: Tensor,
    metric: Callable[[Tensor], Tensor],
    senders: Sequence[HeadIndex],
    component: Kind = "q",
    top_k: int = 3,
) -> nx.DiGraph:
    """Add causal edges: for each sender, the ``top_k`` receivers whose ``component`` path
    restores the metric most (``effect`` = patched metric - corrupted metric)."""
    with torch.no_grad():
        base = float(metric(model(corrupt_tokens)))
    n_heads = int(model.cfg.n_heads)
    for s in senders:
        res = path_patch(model, clean_tokens, corrupt_tokens, metric, s, component)
        effect = res - base
        effect[: s.layer + 1] = 0.0  # rows up to the sender are placeholders
        vals, idx = effect.flatten().abs().topk(min(top_k, effect.numel()))
        for v, i in zip(vals.tolist(), idx.tolist(), strict=True):
            if v == 0.0:
                continue
            r = HeadIndex(i // n_heads, i % n_heads)
            for h in (s, r):
                if str(h) not in G:
                    G.add_node(str(h), layer=h.layer, head=h.head, types="")
            G.add_edge(
                str(s),
                str(r),
                kind=f"path-{component}",
                score=round(float(effect.flatten()[i]), 5),
                baseline=0.0,
                ratio=1.0,
            )
    return G
