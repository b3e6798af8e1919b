"""Head discovery: planted heads no catalog type describes form their own unexplained
cluster, a planted previous-token head lands in an explained one, the attention statistics
equal a hand computation from ``run_with_cache``, and the command refuses bad input in
one line."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import pytest
import torch

from headmech.cli import main
from headmech.core.head_index import HeadIndex
from headmech.discover import ATTENTION_FEATURES, attention_reducer, discover
from headmech.interventions import Intervention, applied
from headmech.interventions.effects import Effect
from headmech.probes import ProbeOptions, build_probe
from headmech.stream.engine import stream_statistics
from headmech.testing import tiny_model

TYPES = ["previous_token", "positional", "attention_sink", "induction", "duplicate_token"]
SMALL = dict(n_sentences=32, n_sequences=8, half_len=16)
OFFSET_HEADS = [HeadIndex(0, 1), HeadIndex(1, 3)]  # attend to i - 6: no catalog type
PREVIOUS = HeadIndex(1, 0)  # attends to i - 1: previous_token (and positional)


@dataclass(frozen=True)
class Offset(Effect):
    """Each query attends to the key ``offset`` before it (to itself where there is none)."""

    offset: int
    sites = ("pattern",)

    def apply(self, x, layer, idx, ctx):
        q = torch.arange(x.shape[-2], device=x.device)
        k = torch.where(q >= self.offset, q - self.offset, q)
        one = torch.nn.functional.one_hot(k, x.shape[-1]).to(x)  # [query_pos, key_pos]
        return one[None, None].expand_as(x)


@pytest.fixture(scope="module")
def model():
    return tiny_model("causal")


def _discover_planted(model):
    plants = [
        Intervention.on(OFFSET_HEADS, Offset(6), site="pattern"),
        Intervention.on([PREVIOUS], Offset(1), site="pattern"),
    ]
    with applied(model, plants, strict=False), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return discover(model, TYPES, **SMALL)


@pytest.fixture(scope="module")
def planted(model):
    """Discovery on the tiny model with i - 6 planted in two heads (positional heads are
    defined for offsets up to 4, so i - 3 would be a positional head) and i - 1 in one."""
    return _discover_planted(model)


def test_planted_offset_heads_form_one_unexplained_cluster(planted):
    cluster = planted.cluster_of(OFFSET_HEADS[0])
    assert cluster.heads == OFFSET_HEADS
    assert not cluster.explained and cluster.labelled_share == 0.0
    assert cluster in planted.unexplained
    # what sets them apart: one key per query (entropy far below the average head)
    assert cluster.z["attention.entropy"] < -1 and cluster.z["attention.max_weight"] > 1
    # examples: the central head's top key is 6 tokens back wherever there is one
    assert len(cluster.examples) == 3
    for example in cluster.examples:
        pairs = example.top_keys(cluster.central)
        assert pairs and all(k == (q - 6 if q >= 6 else q) for q, k, _ in pairs)


def test_planted_previous_token_head_is_explained(planted):
    cluster = planted.cluster_of(PREVIOUS)
    assert cluster.explained and PREVIOUS in cluster.heads
    assert "previous_token" in cluster.explained_by
    assert not set(OFFSET_HEADS) & set(cluster.heads)


def test_clusters_cover_every_head_and_silhouette_picks_the_count(planted):
    heads = sorted(h for c in planted.clusters for h in c.heads)
    assert heads == [HeadIndex(la, h) for la in range(2) for h in range(4)]
    assert planted.assignment.shape == (2, 4)
    best = max(planted.silhouette.values())
    assert planted.silhouette[len(planted.clusters)] == best
    assert planted.used[-1] == "attention.max_weight"


def test_discovery_json_is_deterministic(planted, model, tmp_path):
    a = planted.save(tmp_path / "a").read_bytes()
    again = _discover_planted(model)  # a second discovery from scratch: the same bytes
    assert again.save(tmp_path / "b").read_bytes() == a
    data = json.loads(a)
    assert list(data) == sorted(data)  # sorted keys
    assert data["provenance"]["model"]["weights_sha256"]
    assert data["provenance"]["settings"]["linkage"] == "ward"
    assert data["unexplained"] == [c.id for c in planted.unexplained]
    odd = planted.cluster_of(OFFSET_HEADS[0]).id
    assert (tmp_path / "a" / f"cluster_{odd}.png").exists()
    assert (tmp_path / "a" / "discovery.png").exists()


def _by_hand(model, batches):
    """Per head, each statistic's mean over the queries (real, not special, position >= 1),
    from run_with_cache's patterns."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    sums = {f: torch.zeros(n_layers, n_heads, dtype=torch.float64) for f in ATTENTION_FEATURES}
    count = 0
    for batch in batches:
        _, cache = model.run_with_cache(batch.input_ids, attention_mask=batch.attention_mask)
        pos = torch.arange(batch.input_ids.shape[1])
        queries = batch.attention_mask.bool() & ~batch.special & (pos >= 1)
        special = batch.attention_mask.bool() & batch.special & (pos >= 1)
        count += int(queries.sum())
        for la in range(n_layers):
            p = cache[f"blocks.{la}.attn.hook_pattern"].double()  # [batch, head, q, k]
            stats = {
                "entropy": -(p * p.clamp(min=1e-300).log()).sum(-1),
                "distance": (p * (pos[:, None] - pos[None, :]).abs()).sum(-1),
                "first_mass": p[..., 0],
                "self_mass": p.diagonal(dim1=-2, dim2=-1),
                "special_mass": (p * special[:, None, None, :]).sum(-1),
                "max_weight": p.max(-1).values,
            }
            for f, v in stats.items():  # v: [batch, head, query_pos]
                sums[f][la] += v.permute(0, 2, 1)[queries].sum(0)
    return {f: s / count for f, s in sums.items()}


@pytest.mark.parametrize("attention", ["blocks", "pattern"])
def test_attention_statistics_equal_a_hand_computation(model, attention):
    probe = build_probe("prose", model, ProbeOptions(n_sentences=12, batch_size=6))
    want = _by_hand(model, probe.batches)
    # a small block budget: several blocks of query rows per layer
    stats = stream_statistics(
        model, probe.batches, [attention_reducer()], attention=attention, block_memory=2**14
    )
    for f in ATTENTION_FEATURES:
        got = stats.mean(f"attention.{f}").double()
        torch.testing.assert_close(got, want[f], atol=1e-5, rtol=1e-5, msg=f)
    assert float(want["entropy"].min()) > 0 and float(want["self_mass"].max()) < 1


def test_bad_cluster_counts(model):
    from headmech.core.errors import InputError

    with pytest.raises(InputError, match="at least 2"):
        discover(model, TYPES, n_clusters=1, **SMALL)
    with pytest.raises(InputError, match="only 8 heads"):
        discover(model, TYPES, n_clusters=9, **SMALL)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--clusters", "1"], "--clusters must be an integer of at least 2, got 1"),
        (["--clusters", "9"], "--clusters 9: the model has only 8 heads"),
    ],
)
def test_cli_refuses_bad_cluster_counts(tiny_dirs, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    status = main(["discover", str(tiny_dirs["llama"]), "--out", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [f"headmech: error: {message}"]
    assert not out.exists()


def test_cli_refuses_an_unknown_model(tmp_path, capsys):
    assert main(["discover", "smollm2-13m", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model 'smollm2-13m'" in err[0]


def test_cli_discover_writes_its_files_and_force_replaces_them(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    types = "previous_token,positional,attention_sink"  # prose only: the model has 64 positions
    args = ["discover", str(tiny_dirs["llama"]), "--out", str(out), "--types", types]
    args += ["--n-sentences", "16", "--clusters", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "discovery.json").read_text())
    assert (
        len(data["clusters"]) == 3
        and f"3 clusters, {len(data['unexplained'])} unexplained" in printed
    )
    assert sorted(h for c in data["clusters"] for h in map(tuple, c["heads"])) == [
        (la, h) for la in range(2) for h in range(4)
    ]
    figures = {p.name for p in out.glob("cluster_*.png")}
    assert figures == {f"cluster_{c}.png" for c in data["unexplained"]}
    assert (out / "run.json").exists() and (out / "discovery.png").exists()
    (out / "cluster_99.png").write_bytes(b"stale")  # an earlier run's figure
    assert main(args) == 2  # no --force: refuses to overwrite
    assert main([*args, "--force"]) == 0
    assert not (out / "cluster_99.png").exists()
