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
(:func:`headmech.models.weights.head_weights`). Random matrices of the same shapes already score
around ``1/sqrt(d_model)``-ish, so every score comes with that baseline
(:func:`composition_baseline`).

Composition scores say what the weights *could* carry; path patching (Wang et al. 2022,
:mod:`headmech.circuits.path_patching`, re-exported here) measures what one edge does carry on a
task: :func:`path_patch` patches a sender's output only into a receiver's Q, K or V input
through the intervention layer, and :func:`path_patch_scores` does it for many senders in
:func:`composition_scores`' layout.

:func:`graph` turns scores into a ``networkx.MultiDiGraph`` of heads labelled with their
catalog types: one edge per composition kind between a pair (key and ``kind`` ``"q"``,
``"k"``, ``"v"``), so a pair that both Q- and K-composes keeps both;
:func:`add_path_patching_edges` adds causal edges (``"path-q"``, ``"path-k"``,
``"path-v"``) beside them. :func:`circuit` wraps the graph in a :class:`Circuit` whose
``save`` writes the GraphML, node-link JSON and figure that ``headmech circuit`` writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import networkx as nx
import torch
from jaxtyping import Float
from torch import Tensor

from headmech.circuits.path_patching import add_path_patching_edges, path_patch, path_patch_scores
from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex, check_heads
from headmech.models.loaded import model_name
from headmech.models.weights import HeadWeights, head_weights

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.classify import HeadCatalog

__all__ = [
    "Circuit",
    "add_path_patching_edges",
    "circuit",
    "circuit_of",
    "composition_baseline",
    "composition_scores",
    "draw",
    "graph",
    "path_patch",
    "path_patch_scores",
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


def _scores(
    w: HeadWeights, kind: Kind, layers: Collection[int] | None = None
) -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
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
            if layers is not None and l2 not in layers:
                continue
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
    model: TransformerBridge,
    kind: Kind = "k",
    weights: HeadWeights | None = None,
    layers: Collection[int] | None = None,
) -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
    """Composition score of every (sender, receiver) pair; 0 where the sender is not earlier.

    ``scores[l1, h1, l2, h2]``: how much head (l2, h2)'s ``kind`` side reads what head
    (l1, h1) writes. ``layers``: only receivers in these layers (the others stay 0; a
    graph of a few receivers costs a few layers, not all).

    References:
        Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits".
    """
    if kind not in ("q", "k", "v"):
        raise HeadmechError(f"composition kind must be q, k or v, got '{kind}'")
    return _scores(weights or head_weights(model), kind, layers)


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
) -> nx.MultiDiGraph:
    """A graph of heads whose edges carry composition scores, one edge per kind and pair.

    Args:
        model: the bridge.
        catalog: labels nodes with head types (and picks receivers: every labelled head).
        kinds: composition kinds to include.
        receivers: heads whose inputs to explain (default: the catalog's labelled heads,
            else every head).
        top_k: per receiver and kind, the strongest senders kept.
        min_ratio: keep an edge only if its score is at least this times the random baseline.

    Returns:
        ``networkx.MultiDiGraph``; nodes ``"L{l}H{h}"`` with ``layer``, ``head``, ``types``;
        edges keyed by their ``kind`` (a pair that Q- and K-composes has two parallel
        edges), with ``kind``, ``score``, ``baseline``, ``ratio``.

    References:
        Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits".
    """
    w = head_weights(model)
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    labels = catalog.labels() if catalog is not None else {}
    if receivers is None:
        everyone = [HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads)]
        receivers = list(labels) if labels else everyone
    receivers = check_heads(receivers, n_layers, n_heads, "receivers")  # pairs or "L18H6"
    G = nx.MultiDiGraph(model=model_name(model))

    def add_node(h: HeadIndex) -> str:
        if str(h) not in G:
            G.add_node(str(h), layer=h.layer, head=h.head, types=",".join(labels.get(h, [])))
        return str(h)

    for h in labels:
        add_node(h)
    for kind in kinds:
        scores = composition_scores(model, kind, w, {r.layer for r in receivers})
        base = composition_baseline(model, kind)
        for r in receivers:
            for sender, v in _senders(scores, r, top_k, min_ratio * base):
                G.add_edge(
                    add_node(sender),
                    add_node(r),
                    key=kind,
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
        graph: a ``networkx.MultiDiGraph``: nodes ``"L{l}H{h}"`` (``layer``, ``head``,
            ``types``), edges keyed by ``kind`` with ``kind``, ``score``, ``baseline``,
            ``ratio`` (path-patching edges add ``effect``; see
            :func:`add_path_patching_edges`).
        model: the model's short name.
        provenance: weights, versions, settings and the catalog's provenance (written
            into ``circuit.json`` and, as JSON text, the GraphML's graph attribute).
    """

    graph: nx.MultiDiGraph
    model: str = ""
    provenance: dict[str, Any] = field(default_factory=dict)

    def edges(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Edges as ``(sender, receiver, data)``, parallel edges separately, strongest
        first (by ``ratio``: to the random baseline for composition edges, to the mean
        ``|effect|`` of the measured edges for path-patching edges). Every edge has
        ``kind``, ``score`` and ``ratio``."""
        return sorted(self.graph.edges(data=True), key=lambda e: -e[2]["ratio"])

    def save(self, out: str | os.PathLike) -> dict[str, str]:
        """Write ``circuit.graphml``, ``circuit.json`` (node-link) and ``circuit.png``."""
        from headmech.runs.provenance import dumps

        G = self.graph.copy()
        G.graph["provenance"] = dumps(self.provenance).strip()  # GraphML takes text
        files = save_graph(G, out)
        data = json.loads(Path(files["json"]).read_text())
        data["graph"]["provenance"] = self.provenance
        Path(files["json"]).write_text(dumps(data))
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
    """:func:`graph` as a :class:`Circuit` (receivers: the catalog's labelled heads); the
    settings checked once (:class:`~headmech.circuits.spec.CircuitSpec`)."""
    from headmech.circuits.spec import CircuitSpec

    return circuit_of(
        model, catalog, CircuitSpec.create(kinds=kinds, top_k=top_k, min_ratio=min_ratio)
    )


def circuit_of(model: TransformerBridge, catalog: HeadCatalog | None, spec: Any) -> Circuit:
    """The circuit of a checked :class:`~headmech.circuits.spec.CircuitSpec`."""
    from headmech.runs.provenance import provenance

    G = graph(model, catalog, kinds=spec.kinds, top_k=spec.top_k, min_ratio=spec.min_ratio)
    prov = provenance(model, settings=spec.to_json())
    if catalog is not None:
        prov["catalog"] = catalog.provenance
    return Circuit(G, model_name(model), prov)


def save_graph(G: nx.MultiDiGraph, out: str | os.PathLike) -> dict[str, str]:
    """Write ``circuit.graphml`` and ``circuit.json`` (node-link) into folder ``out``.

    Parallel edges survive both: GraphML gives each its key as its id (``nx.read_graphml``
    reads them back as a ``MultiDiGraph``), node-link JSON lists each with its ``key``.
    """
    os.makedirs(out, exist_ok=True)
    gml = os.path.join(out, "circuit.graphml")
    js = os.path.join(out, "circuit.json")
    nx.write_graphml(G, gml)
    with open(js, "w") as f:
        json.dump(nx.node_link_data(G, edges="edges"), f, indent=1)
    return {"graphml": gml, "json": js}


# per edge kind: line style, colour and curvature (parallel edges of a pair bend apart)
_EDGE_STYLES: dict[str, tuple[str, str, float]] = {
    "q": ("solid", "0.25", 0.08),
    "k": ("dashed", "0.25", 0.16),
    "v": ("dotted", "0.25", 0.24),
    "path-q": ("solid", "tab:red", -0.08),
    "path-k": ("dashed", "tab:red", -0.16),
    "path-v": ("dotted", "tab:red", -0.24),
}


def _draw_edges(G: nx.MultiDiGraph, pos: dict[str, tuple[int, int]], ax: Any) -> list[str]:
    """Each kind's edges, in its own style and curvature; returns the kinds drawn."""
    drawn = []
    for kind, (style, color, rad) in _EDGE_STYLES.items():
        edges = [(u, v, d) for u, v, d in G.edges(data=True) if d.get("kind") == kind]
        if not edges:
            continue
        H = nx.DiGraph()
        H.add_nodes_from(G.nodes)
        H.add_edges_from((u, v) for u, v, _ in edges)
        nx.draw_networkx_edges(
            H,
            pos,
            edgelist=[(u, v) for u, v, _ in edges],
            style=style,
            edge_color=color,
            width=[0.5 + min(float(d["ratio"]), 8.0) / 2 for *_, d in edges],
            connectionstyle=f"arc3,rad={rad}",
            ax=ax,
            alpha=0.7,
            arrows=True,
            node_size=350,
        )
        drawn.append(kind)
    return drawn


def draw(G: nx.MultiDiGraph, path: str | os.PathLike | None = None, title: str = "") -> Any:
    """Heads placed by (layer, head), coloured by their first catalog type (seaborn palette).

    Parallel edges of a pair are drawn apart (each kind bends its own way): composition
    edges grey (q solid, k dashed, v dotted), path-patching edges red in the same styles;
    width grows with the edge's ``ratio``.
    """
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
    drawn = _draw_edges(G, pos, ax)
    nx.draw_networkx_nodes(G, pos, node_color=colors, node_size=350, ax=ax)
    nx.draw_networkx_labels(G, pos, font_size=6, ax=ax)
    for t, c in palette.items():
        ax.scatter([], [], color=c, label=t)
    for kind in drawn:
        style, color, _ = _EDGE_STYLES[kind]
        label = f"{kind} patching" if kind.startswith("path") else f"{kind}-composition"
        ax.plot([], [], linestyle=style, color=color, label=label)
    ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("layer")
    what = (
        "composition and path patching"
        if any(k.startswith("path") for k in drawn)
        else "composition"
    )
    ax.set_title(title or f"{G.graph.get('model', '')}: head {what}")
    from headmech.core.plot import finish

    return finish(fig, path)
