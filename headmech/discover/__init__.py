"""Discover unnamed head types: cluster heads by what they do, report what the catalog misses.

The catalog names the head types someone has described. To find the ones nobody has,
every head gets a behavioural feature vector — its score on every catalog type that fits
the model, plus attention statistics on the prose probe (the entropy of a query's
attention row, the mean attended distance, the mass on the first token, on the query
itself and on later special tokens, and the row maximum) — the features are
standardised, and the heads are clustered by Ward's agglomerative clustering
(scikit-learn). Unless given, the number of clusters is the one with the best silhouette
over a small range.

A cluster is *explained* when at least ``min_share`` of its heads carry the label of a
specific catalog type; a type that labels more than ``broad_share`` of all the model's
heads (the attention sink in an LM: it is every head's default state) explains nothing.
The other clusters are reported with the features that set them apart, example prompts
with the top attended key per query and attention figures (:mod:`headmech.discover.clusters`), so
a contributor can name the type.

The attention statistics are one blockwise reducer (:func:`attention_reducer`) streamed
in the same forward passes as the prose types' statistics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from headmech.classification.results import HeadCatalog, TypeResult
from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex
from headmech.discover.clusters import Cluster, DiscoveryResult, add_examples
from headmech.discover.spec import K_RANGE, DiscoverSpec
from headmech.headtypes.registry import HeadType, collect_statistics
from headmech.models import model_info
from headmech.probes import Probe, build_probe
from headmech.stream import blockwise
from headmech.stream.engine import HeadStats, ProbeBatch, Reducer

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "ATTENTION_FEATURES",
    "Cluster",
    "DiscoveryResult",
    "attention_reducer",
    "cluster_heads",
    "discover",
    "discover_spec",
]

ATTENTION = "attention"  # reducer name: statistics "attention.<feature>"
# per query (real, not special, position >= 1), averaged over the probe's queries
ATTENTION_FEATURES = (
    "entropy",  # -sum p log p over the keys (nats)
    "distance",  # mean attended distance sum p |query - key| (tokens)
    "first_mass",  # mass on the first token (BOS / [CLS]: the sink)
    "self_mass",  # mass on the query itself
    "special_mass",  # mass on special tokens after the first ([SEP], EOS)
    "max_weight",  # the row's maximum (Voita et al.'s confidence)
)


def _attention_prepare(batch: ProbeBatch) -> tuple[Tensor, Tensor, Tensor]:
    pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
    real = batch.attention_mask.bool()
    queries = real & ~batch.special & (pos >= 1)  # [batch, pos]
    special_keys = real & batch.special & (pos >= 1)  # [batch, pos]
    return queries, special_keys, pos


def _attention_fn(
    pattern: Tensor, batch: ProbeBatch, prepared: Any, layer: int, rows: slice
) -> dict[str, tuple[Tensor, Tensor]]:
    queries, special_keys, pos = prepared
    # pattern: [batch, head_index, query rows, key_pos] (keys 0 .. width - 1)
    width = pattern.shape[-1]
    q = queries[:, rows][:, None]  # [batch, 1, rows]
    qpos = pos[rows]
    dist = (qpos[:, None] - pos[None, :width]).abs().to(pattern.dtype)  # [rows, width]
    diag = qpos.clamp(max=width - 1)[None, None, :, None].expand(*pattern.shape[:3], 1)
    special = special_keys[:, None, None, :width].to(pattern.dtype)  # [batch, 1, 1, width]
    per_query = {
        "entropy": -torch.xlogy(pattern, pattern).sum(-1),
        "distance": (pattern * dist).sum(-1),
        "first_mass": pattern[..., 0],
        "self_mass": pattern.gather(-1, diag)[..., 0],
        "special_mass": (pattern * special).sum(-1),
        "max_weight": blockwise.top1(pattern)[0],
    }
    n = q[:, 0].sum(1)  # [batch]: queries per sequence in this block
    # where, not a product: a row that is not a query may hold anything (NaN included)
    return {k: (torch.where(q, v, 0.0).sum(2), n) for k, v in per_query.items()}


def attention_reducer(name: str = ATTENTION) -> Reducer:
    """Attention statistics of every head, per query averaged over the probe.

    The queries are the real, non-special tokens from position 1 on; the statistics are
    :data:`ATTENTION_FEATURES` (``name.entropy``, ``name.distance``, ...). Blockwise: the
    engine may hand it blocks of query rows rebuilt from q and k.

    Examples:
        >>> stats = stream_statistics(model, batches, [attention_reducer()])  # doctest: +SKIP
        >>> stats.mean("attention.entropy")  # [n_layers, n_heads]  # doctest: +SKIP
    """
    return Reducer(name, _attention_fn, _attention_prepare, blockwise=True)


class _AttentionStatistics(HeadType):
    """Not a head type (it labels nothing and is never registered): it hands
    :func:`headmech.headtypes.registry.collect_statistics` the attention reducer, so the statistics
    ride in the same passes as the probe's types."""

    name = ATTENTION

    def reducers(self) -> list[Reducer]:
        return [attention_reducer()]


def _measure(
    model: TransformerBridge, spec: Any, attention_probe: str, progress: bool
) -> tuple[HeadCatalog, HeadStats, Probe]:
    """Every type's score and labels (``spec``: a checked
    :class:`~headmech.classification.spec.ClassifySpec`), and the attention statistics on
    ``attention_probe``, which ride in the same passes as that probe's types."""
    from headmech.classification.runner import build_or_skip, runnable_types, score_type
    from headmech.runs.provenance import provenance

    info, options, named = model_info(model), spec.probe, spec.named
    runnable, skipped = runnable_types(list(spec.types), named, info)
    groups: dict[str, list[HeadType]] = {attention_probe: []}
    for t in runnable:
        groups.setdefault(t.probe, []).append(t)
    results: dict[str, TypeResult] = {}
    used: dict[str, list[ProbeBatch]] = {}
    meta: dict[str, Any] = {"skipped": skipped, "probes": {}}
    attention: HeadStats | None = None
    source: Probe | None = None
    for name, group in groups.items():
        t0 = time.perf_counter()
        if name == attention_probe:
            probe = build_probe(name, model, options)
        elif built := build_or_skip(model, name, group, options, named, skipped):
            probe = built
        else:
            continue
        riders = [_AttentionStatistics()] if name == attention_probe else []
        desc = f"{name} ({', '.join(t.name for t in [*group, *riders])})" if progress else False
        stats = collect_statistics([*group, *riders], model, probe.batches, progress=desc)
        results.update({t.name: score_type(t, stats, 0, options.seed) for t in group})
        used[name] = probe.batches
        meta["probes"][name] = {"n_tokens": probe.n_tokens, "seconds": time.perf_counter() - t0}
        if name == attention_probe:
            attention, source = stats, probe
    assert attention is not None and source is not None
    runnable = [t for t in runnable if t.name in results]
    meta["types"] = {t.name: repr(t) for t in runnable}
    prov = provenance(model, probes=used, options=options)
    catalog = HeadCatalog(info, {t.name: results[t.name] for t in runnable}, meta, prov)
    return catalog, attention, source


def head_features(catalog: HeadCatalog, attention: HeadStats) -> dict[str, Tensor]:
    """Feature name → ``[n_layers, n_heads]``: every type's score (named by the type), then
    the attention statistics (``attention.<feature>``)."""
    out = {name: r.score.float() for name, r in catalog.types.items()}
    for f in ATTENTION_FEATURES:
        out[f"{ATTENTION}.{f}"] = attention.mean(f"{ATTENTION}.{f}")
    return out


def standardise(features: dict[str, Tensor]) -> tuple[np.ndarray, list[str], dict[str, str]]:
    """Heads x features, each feature standardised over the heads (scikit-learn's
    ``StandardScaler``); a NaN (a head that saw no query) becomes the feature's mean.
    Features that are undefined or constant over the heads, or repeat an earlier feature
    up to scale, are left out, with why.

    Returns:
        ``(Z [n_layers * n_heads, n_used], used names, {left-out name: reason})``.
    """
    from sklearn.preprocessing import StandardScaler

    cols: list[np.ndarray] = []
    used: list[str] = []
    dropped: dict[str, str] = {}
    for name, value in features.items():
        x = value.double().flatten().numpy()
        finite = np.isfinite(x)
        if not finite.any():
            dropped[name] = "undefined for every head"
            continue
        x = np.where(finite, x, x[finite].mean())
        if float(x.std()) <= 1e-9 * max(1.0, float(np.abs(x).max())):
            dropped[name] = "constant over the heads"
            continue
        z = (x - x.mean()) / x.std()
        same = [
            u for u, c in zip(used, cols, strict=True) if np.allclose(z, (c - c.mean()) / c.std())
        ]
        if same:  # a copy counts once (two types with one score would weigh double)
            dropped[name] = f"same as {same[0]} up to scale"
            continue
        cols.append(x)
        used.append(name)
    if not cols:
        raise InputError("no feature varies across the heads: nothing to cluster")
    z = StandardScaler().fit_transform(np.stack(cols, 1))
    return z, used, dropped


def _ward(z: np.ndarray, k: int) -> np.ndarray:
    from sklearn.cluster import AgglomerativeClustering

    return AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(z)


def cluster_heads(
    z: np.ndarray, n_clusters: int | None = None, k_range: tuple[int, int] = K_RANGE
) -> tuple[np.ndarray, dict[int, float]]:
    """Ward clustering of standardised head features (rows: heads).

    Args:
        z: ``[n_heads_total, n_features]``.
        n_clusters: the number of clusters; None: the count in ``k_range`` (inclusive)
            with the best silhouette (ties: fewer clusters).
        k_range: the counts tried when ``n_clusters`` is None.

    Returns:
        ``(labels, silhouette)``: labels numbered in order of each cluster's first head
        (deterministic), and the silhouette of every count tried.
    """
    from sklearn.metrics import silhouette_score

    n = z.shape[0]
    if n_clusters is not None:
        ks = [n_clusters]
    else:
        ks = list(range(max(2, k_range[0]), min(k_range[1], n - 1) + 1))
        if not ks:
            raise InputError(f"{n} heads are too few to choose a number of clusters")
    fits = {k: _ward(z, k) for k in ks}
    sil = {k: float(silhouette_score(z, fits[k])) for k in ks if 2 <= k <= n - 1}
    best = ks[0] if n_clusters is not None else max(ks, key=lambda k: (round(sil[k], 9), -k))
    raw = fits[best]
    order = {c: i for i, c in enumerate(dict.fromkeys(raw.tolist()))}  # first appearance
    return np.array([order[c] for c in raw.tolist()]), sil


def _clusters(
    labels: np.ndarray,
    z: np.ndarray,
    used: list[str],
    catalog: HeadCatalog,
    min_share: float,
    broad: list[str],
) -> list[Cluster]:
    """Members, central head, z-scores of the cluster mean and the catalog's verdict."""
    n_heads = catalog.model.n_heads
    head_labels = catalog.labels()
    out = []
    for c in range(int(labels.max()) + 1):
        idx = np.flatnonzero(labels == c)
        heads = [HeadIndex(int(i) // n_heads, int(i) % n_heads) for i in idx]
        centre = z[idx].mean(0)
        near = np.argsort(((z[idx] - centre) ** 2).sum(1), kind="stable")
        by: dict[str, int] = {}
        labelled = 0
        for h in heads:
            specific = [t for t in head_labels.get(h, []) if t not in broad]
            labelled += bool(specific)
            for t in specific:
                by[t] = by.get(t, 0) + 1
        share = labelled / len(heads)
        out.append(
            Cluster(
                id=c,
                heads=heads,
                ranked=[heads[int(i)] for i in near],
                explained=share >= min_share,
                labelled_share=share,
                explained_by=dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))),
                z={f: float(v) for f, v in zip(used, centre, strict=True)},
            )
        )
    return out


def discover(
    model: TransformerBridge,
    types: Sequence[str | HeadType | type[HeadType]] | str | None = None,
    *,
    n_clusters: int | None = None,
    seed: int = 0,
    k_range: tuple[int, int] = K_RANGE,
    min_share: float = 0.5,
    broad_share: float = 0.5,
    n_examples: int = 3,
    attention_probe: str = "prose",
    progress: bool = True,
    **probe_options: Any,
) -> DiscoveryResult:
    """Cluster the heads of ``model`` by behaviour and report the clusters the catalog
    does not explain.

    Args:
        model: a bridge from :func:`headmech.load_model`.
        types: the catalog types whose scores are features (default: every registered
            type that fits the model).
        n_clusters: the number of clusters (2 .. number of heads); None: chosen by
            silhouette over ``k_range``.
        seed: seeds the probes.
        k_range: the cluster counts (inclusive) the silhouette chooses from.
        min_share: a cluster is explained when at least this share of its heads carry a
            specific type's label.
        broad_share: a type labelling more than this share of all heads is not specific.
        n_examples: example prompts per unexplained cluster.
        attention_probe: the probe of the attention statistics (``repeated_random`` for a
            vocabulary without English words).
        progress: show progress bars on stderr (default; ``False``: silent).
        **probe_options: fields of :class:`headmech.probes.ProbeOptions` (``n_sentences``,
            ``n_sequences``, ``half_len``, ``batch_size``, ``corpus``, ...).

    Returns:
        A :class:`DiscoveryResult` (``save`` writes ``discovery.json`` and figures).

    Examples:
        >>> result = headmech.discover.discover(model, n_sentences=64)  # doctest: +SKIP
        >>> [c.heads for c in result.unexplained]  # doctest: +SKIP
    """
    spec = DiscoverSpec.create(
        types=types, n_clusters=n_clusters, seed=seed, k_range=k_range, min_share=min_share,
        broad_share=broad_share, n_examples=n_examples, attention_probe=attention_probe,
        **probe_options,
    )  # fmt: skip
    return discover_spec(model, spec, progress=progress)


def discover_spec(model: TransformerBridge, spec: Any, *, progress: bool = True) -> DiscoveryResult:
    """The discovery of a checked :class:`~headmech.discover.spec.DiscoverSpec`."""
    t0 = time.perf_counter()
    info = model_info(model)
    total = info.n_layers * info.n_heads
    if spec.n_clusters is not None and spec.n_clusters > total:
        raise InputError(f"{spec.n_clusters} clusters: the model has only {total} heads")
    n_clusters, k_range, min_share = spec.n_clusters, spec.k_range, spec.min_share
    broad_share, n_examples = spec.broad_share, spec.n_examples
    catalog, attention, probe = _measure(model, spec.classify, spec.attention_probe, progress)
    features = head_features(catalog, attention)
    z, used, dropped = standardise(features)
    labels, sil = cluster_heads(z, n_clusters, k_range)
    broad = sorted(t for t, r in catalog.types.items() if len(r.heads) > broad_share * total)
    clusters = _clusters(labels, z, used, catalog, min_share, broad)
    t1 = time.perf_counter()
    add_examples(model, probe, [c for c in clusters if not c.explained], n_examples)
    settings = {
        "types": catalog.meta["types"],
        "skipped": catalog.meta["skipped"],
        **spec.to_json(),
    }
    catalog.provenance["settings"] = settings
    meta = {"seconds": {"measure_and_cluster": t1 - t0, "examples": time.perf_counter() - t1}}
    return DiscoveryResult(
        model=info,
        features=features,
        used=used,
        dropped=dropped,
        assignment=torch.from_numpy(labels).view(info.n_layers, info.n_heads),
        clusters=clusters,
        silhouette=sil,
        catalog=catalog,
        broad_types=broad,
        provenance=catalog.provenance,
        meta={**meta, **catalog.meta},
    )
