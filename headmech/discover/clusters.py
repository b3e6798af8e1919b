"""What head discovery returns: clusters of heads, the catalog's verdict on each, example
prompts and figures.

:class:`DiscoveryResult` is what :func:`headmech.discover.discover` returns and what
``headmech discover`` writes: ``discovery.json`` (deterministic: sorted keys, rounded
floats, the provenance record every headmech JSON carries), ``discovery.png`` (the
cluster of every head beside the clusters' standardised feature means) and one
``cluster_<id>.png`` per unexplained cluster: the attention patterns of its most central
heads on the example prompts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from headmech.core.head_index import HeadIndex
from headmech.models import ModelInfo
from headmech.runs.files import FileSchema
from headmech.runs.provenance import SCHEMA_VERSION

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.results import HeadCatalog
    from headmech.probes import Probe

__all__ = ["Cluster", "DiscoveryResult", "Example", "add_examples"]

SHOWN_HEADS = 3  # heads per unexplained cluster in its figure (the most central)
EXAMPLE_TOKENS = (8, 24)  # example prompts are picked among sequences of this many tokens
# discovery.json: written (its header, deterministic JSON), not read back into a result
DISCOVERY_FILE = FileSchema(
    "discovery result", "discovery.json", SCHEMA_VERSION,
    required=("model", "types", "clusters", "assignment"),
)  # fmt: skip


@dataclass
class Example:
    """One prompt of the probe and the attention of a cluster's central heads on it.

    Attributes:
        sequence: its index in the probe (batch order).
        tokens: the tokens as text.
        is_query: per position, whether it counts as a query (real, not special, not first).
        patterns: head → its pattern ``[query_pos, key_pos]`` on this prompt.
    """

    sequence: int
    tokens: list[str]
    is_query: list[bool]
    patterns: dict[HeadIndex, Tensor] = field(default_factory=dict)

    def top_keys(self, head: HeadIndex) -> list[tuple[int, int, float]]:
        """``(query, top attended key, its weight)`` for every query position."""
        p = self.patterns[head]
        w, k = p.max(-1)
        return [(q, int(k[q]), float(w[q])) for q, ok in enumerate(self.is_query) if ok]

    def to_json(self, head: HeadIndex) -> dict[str, Any]:
        """The prompt, and per position the head's top key and weight (-1/None: no query)."""
        keys = [-1] * len(self.tokens)
        weights: list[float | None] = [None] * len(self.tokens)
        for q, k, w in self.top_keys(head):
            keys[q], weights[q] = k, round(w, 4)
        return {
            "sequence": self.sequence,
            "tokens": self.tokens,
            "head": [head.layer, head.head],
            "top_key": keys,
            "top_weight": weights,
        }


@dataclass
class Cluster:
    """One cluster of heads and the catalog's verdict on it.

    Attributes:
        id: numbered in order of each cluster's first head (layer-major).
        heads: its heads, in layer-major order.
        ranked: its heads, the nearest to the cluster's centre (in standardised feature
            space) first; ``ranked[0]`` is the most central head.
        explained: whether at least ``min_share`` of its heads carry a specific type's label.
        labelled_share: the share of its heads that carry one.
        explained_by: specific type → how many of its heads carry that label.
        z: feature → the cluster's mean standardised value (a z-score: how far from the
            average head, in units of the spread over all heads).
        examples: example prompts (unexplained clusters only).
    """

    id: int
    heads: list[HeadIndex]
    ranked: list[HeadIndex]
    explained: bool
    labelled_share: float
    explained_by: dict[str, int]
    z: dict[str, float]
    examples: list[Example] = field(default_factory=list)

    @property
    def central(self) -> HeadIndex:
        """The head nearest the cluster's centre."""
        return self.ranked[0]

    def distinguishing(self, n: int = 4) -> list[tuple[str, float]]:
        """The ``n`` features whose z-scores are largest in absolute value."""
        return sorted(self.z.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:n]

    def to_json(self) -> dict[str, Any]:
        """This cluster's entry in ``discovery.json``."""
        return {
            "id": self.id,
            "size": len(self.heads),
            "heads": [[h.layer, h.head] for h in self.heads],
            "central": [self.central.layer, self.central.head],
            "explained": self.explained,
            "labelled_share": self.labelled_share,
            "explained_by": self.explained_by,
            "z": self.z,
            "distinguishing": [f for f, _ in self.distinguishing()],
            "examples": [e.to_json(self.central) for e in self.examples],
        }


def _token(tokenizer: Any, i: int) -> str:
    return str(tokenizer.decode([i])).replace("\n", "\\n")


def _pick(probe: Probe, n: int) -> list[tuple[int, int, int]]:
    """``n`` prompts of EXAMPLE_TOKENS real tokens, spread over the probe (the shortest
    where none fits): ``(sequence, batch, row)``."""
    rows, seq = [], 0
    for b, batch in enumerate(probe.batches):
        for r, length in enumerate(batch.attention_mask.sum(1).tolist()):
            rows.append((seq, b, r, int(length)))
            seq += 1
    lo, hi = EXAMPLE_TOKENS
    fit = [x for x in rows if lo <= x[3] <= hi] or sorted(rows, key=lambda x: (x[3], x[0]))[:n]
    idx = sorted({round(i * (len(fit) - 1) / max(n - 1, 1)) for i in range(min(n, len(fit)))})
    return [fit[i][:3] for i in idx]


def add_examples(
    model: TransformerBridge, probe: Probe, clusters: list[Cluster], n_examples: int
) -> None:
    """Give each cluster ``n_examples`` prompts of ``probe`` with the patterns of its
    :data:`SHOWN_HEADS` most central heads (one forward pass per prompt for all clusters)."""
    from headmech.interventions import capture
    from headmech.stream.engine import ProbeBatch

    if not clusters or n_examples < 1:
        return
    shown = {c.id: c.ranked[:SHOWN_HEADS] for c in clusters}
    layers = sorted({h.layer for heads in shown.values() for h in heads})
    names = [f"blocks.{la}.attn.hook_pattern" for la in layers]
    for seq, b, r in _pick(probe, n_examples):
        batch = probe.batches[b]
        n = int(batch.attention_mask[r].sum())  # right padding: the real tokens come first
        one = ProbeBatch(
            batch.input_ids[r : r + 1, :n],
            batch.attention_mask[r : r + 1, :n],
            batch.special[r : r + 1, :n],
        )
        store = capture(model, one, names)  # each [1, head_index, query_pos, key_pos]
        tokens = [_token(model.tokenizer, i) for i in one.input_ids[0].tolist()]
        is_query = [not s and q >= 1 for q, s in enumerate(one.special[0].tolist())]
        for c in clusters:
            patterns = {
                h: store[f"blocks.{h.layer}.attn.hook_pattern"][0, h.head].cpu()
                for h in shown[c.id]
            }
            c.examples.append(Example(seq, tokens, is_query, patterns))


@dataclass
class DiscoveryResult:
    """Heads clustered by behaviour, and which clusters the catalog explains.

    Attributes:
        model: name and shape of the model.
        features: feature name → ``[n_layers, n_heads]`` (raw values: type scores, then
            ``attention.*`` statistics).
        used: the features clustered on (standardised).
        dropped: features left out, with why (constant or undefined over the heads).
        assignment: ``[n_layers, n_heads]`` cluster ids.
        clusters: the clusters, by id.
        silhouette: cluster count → silhouette score, for every count tried.
        catalog: the classification the type features come from.
        broad_types: types labelling more than ``broad_share`` of all heads (they explain
            no cluster).
        provenance: weights, probes, versions and settings (written to JSON).
        meta: seconds and probe sizes (not written to JSON).
    """

    model: ModelInfo
    features: dict[str, Tensor]
    used: list[str]
    dropped: dict[str, str]
    assignment: Tensor
    clusters: list[Cluster]
    silhouette: dict[int, float]
    catalog: HeadCatalog
    broad_types: list[str]
    provenance: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def unexplained(self) -> list[Cluster]:
        """The clusters no specific catalog type explains."""
        return [c for c in self.clusters if not c.explained]

    def cluster_of(self, head: HeadIndex | tuple[int, int]) -> Cluster:
        """The cluster a head belongs to."""
        return self.clusters[int(self.assignment[head[0], head[1]])]

    def to_json(self) -> dict[str, Any]:
        """The ``discovery.json`` contents."""
        values = {name: v.tolist() for name, v in self.features.items()}
        types = {
            name: {"reference": r.reference, "threshold": r.threshold, "heads": [list(h) for h in r.heads]}
            for name, r in self.catalog.types.items()
        }  # fmt: skip
        data = {
            "model": {
                "name": self.model.name,
                "n_layers": self.model.n_layers,
                "n_heads": self.model.n_heads,
            },
            "n_clusters": len(self.clusters),
            "silhouette": {str(k): v for k, v in sorted(self.silhouette.items())},
            "assignment": self.assignment.tolist(),
            "features": {"used": self.used, "dropped": self.dropped, "values": values},
            "types": types,
            "broad_types": self.broad_types,
            "clusters": [c.to_json() for c in self.clusters],
            "unexplained": [c.id for c in self.unexplained],
        }
        return DISCOVERY_FILE.contents(data, self.provenance)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``discovery.json``, ``discovery.png`` and a ``cluster_<id>.png`` per
        unexplained cluster with examples into the folder ``path``; returns the JSON path.
        The same result always gives the same JSON bytes."""
        p = Path(path)
        DISCOVERY_FILE.write(p / DISCOVERY_FILE.filename, self.to_json())
        self.figure(p / "discovery.png")
        for c in self.unexplained:
            if c.examples:
                self.cluster_figure(c, p / f"cluster_{c.id}.png")
        return p / "discovery.json"

    def figure(self, path: str | os.PathLike | None = None) -> Figure:
        """The cluster of every head (unexplained clusters outlined in red) beside each
        cluster's z-scores."""
        import matplotlib.pyplot as plt
        import seaborn as sns

        from headmech.core.plot import finish, head_heatmap

        n_layers, n_heads = self.model.n_layers, self.model.n_heads
        k = len(self.clusters)
        left, right = 1.5 + 0.35 * n_heads, 1.5 + 0.45 * len(self.used)
        fig, (a, b) = plt.subplots(
            1, 2, figsize=(left + right + 1, 3 + 0.22 * max(n_layers, k)),
            gridspec_kw={"width_ratios": [left, right]},
        )  # fmt: skip
        odd = [tuple(h) for c in self.unexplained for h in c.heads]
        head_heatmap(
            self.assignment.float(), ax=a, title="cluster of each head\n(red: unexplained)",
            heads=odd, cmap=sns.color_palette("tab20", k), cbar=False, annot=True, fmt=".0f",
            annot_kws={"size": 6},
        )  # fmt: skip
        z = torch.tensor([[c.z[f] for f in self.used] for c in self.clusters])
        names = [f"{c.id}{'' if c.explained else ' ?'} ({len(c.heads)})" for c in self.clusters]
        sns.heatmap(
            z.numpy(), ax=b, cmap="coolwarm", center=0, annot=True, fmt=".1f",
            annot_kws={"size": 6}, xticklabels=self.used, yticklabels=names,
        )  # fmt: skip
        b.set_title("cluster mean, z-score\n(cluster id, ? unexplained, size)")
        b.tick_params(axis="x", labelrotation=90, labelsize=7)
        b.tick_params(axis="y", labelrotation=0, labelsize=7)
        fig.suptitle(f"{self.model.name}: {k} clusters, {len(self.unexplained)} unexplained")
        return finish(fig, path)

    def cluster_figure(self, cluster: Cluster, path: str | os.PathLike | None = None) -> Figure:
        """The patterns of a cluster's most central heads (rows) on its example prompts
        (columns)."""
        import matplotlib.pyplot as plt

        from headmech.core.plot import finish, pattern_heatmap

        heads = list(cluster.examples[0].patterns) if cluster.examples else []
        cols = max(len(cluster.examples), 1)
        width = max((len(e.tokens) for e in cluster.examples), default=8)
        side = min(1.5 + 0.22 * width, 1.5 + 0.22 * 32)  # token labels: at most 32 an axis
        fig, axes = plt.subplots(
            max(len(heads), 1), cols, figsize=(cols * side, max(len(heads), 1) * side),
            squeeze=False,
        )  # fmt: skip
        for i, h in enumerate(heads):
            for j, e in enumerate(cluster.examples):
                pattern_heatmap(
                    e.patterns[h], e.tokens, ax=axes[i, j], title=f"{h}, prompt {e.sequence}"
                )
        top = ", ".join(f"{f} {v:+.1f}" for f, v in cluster.distinguishing(3))
        fig.suptitle(f"cluster {cluster.id} ({len(cluster.heads)} heads): {top}")
        return finish(fig, path)

    def table(self, max_heads: int = 8) -> str:
        """A plain-text table: per cluster, its size, verdict, types and features."""
        lines = []
        for c in self.clusters:
            verdict = "explained" if c.explained else "UNEXPLAINED"
            by = ", ".join(f"{t} {n}" for t, n in list(c.explained_by.items())[:3]) or "-"
            feats = ", ".join(f"{f} {v:+.1f}" for f, v in c.distinguishing(3))
            heads = ", ".join(map(str, c.ranked[:max_heads]))
            heads += f", ... (+{len(c.heads) - max_heads})" if len(c.heads) > max_heads else ""
            lines.append(
                f"cluster {c.id:>2}  {len(c.heads):>3} heads  {verdict:<11}  "
                f"labelled {c.labelled_share:.0%} ({by})  z: {feats}\n    {heads}"
            )
        return "\n".join(lines)

    def examples_text(self, max_pairs: int = 10) -> str:
        """Per unexplained cluster, its central head's top key for each query of the
        example prompts (``query -> key (weight)``)."""
        lines = []
        for c in self.unexplained:
            lines.append(f"cluster {c.id}, central head {c.central}:")
            for e in c.examples:
                pairs = [
                    f"{e.tokens[q]!r}->{e.tokens[k]!r} {w:.2f}"
                    for q, k, w in e.top_keys(c.central)[:max_pairs]
                ]
                lines.append(f"  prompt {e.sequence}: {'  '.join(pairs)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        odd = ", ".join(str(c.id) for c in self.unexplained) or "none"
        return (
            f"DiscoveryResult({self.model.name}, {len(self.clusters)} clusters; unexplained: {odd})"
        )
