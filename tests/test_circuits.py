"""Composition scores against a hand computation; the toy induction circuit is found."""

from __future__ import annotations

import json

import networkx as nx
import pytest
import torch

import headmech
from headmech.circuits import (
    add_path_patching_edges,
    composition_baseline,
    composition_scores,
    graph,
    path_patch,
    save_graph,
)
from headmech.heads import HeadIndex
from headmech.weights import head_weights


@pytest.mark.parametrize("kind", ["q", "k", "v"])
def test_composition_matches_full_matrices(tiny_models, kind):
    model = tiny_models["llama"]  # grouped-query attention: K/V expanded to query heads
    w = head_weights(model)
    got = composition_scores(model, kind)
    for (l1, h1), (l2, h2) in [((0, 0), (1, 3)), ((0, 2), (1, 1))]:
        ov1 = w.W_V[l1, h1] @ w.W_O[l1, h1]  # [d_model, d_model]
        qk2 = w.W_Q[l2, h2] @ w.W_K[l2, h2].T
        ov2 = w.W_V[l2, h2] @ w.W_O[l2, h2]
        second = {"q": qk2, "k": qk2.T, "v": ov2}[kind]
        want = (ov1 @ second).norm() / (ov1.norm() * second.norm())
        assert float(got[l1, h1, l2, h2]) == pytest.approx(float(want), rel=1e-4)
    assert float(got[1, :, 0, :].abs().max()) == 0.0  # no composition backwards


def test_baseline_is_what_random_weights_score(tiny_models):
    b = composition_baseline(tiny_models["gpt2"], "k")
    assert 0.0 < b < 0.5


@pytest.mark.slow
def test_toy_previous_token_head_k_composes_with_induction_heads(tmp_path):
    toy = headmech.load_model("toy-induction")
    prev = headmech.get_head_type("previous_token")(probe="repeated_random")
    cat = headmech.classify(toy, [prev, "induction"], n_sequences=16, half_len=40)
    (p,) = [h for h in cat.heads("previous_token") if h.layer == 0][:1]
    k = composition_scores(toy, "k")
    base = composition_baseline(toy, "k")
    for r in cat.heads("induction"):
        senders = k[0, :, 1, r.head]
        assert int(senders.argmax()) == p.head  # the previous-token head feeds every induction key
        assert float(senders[p.head]) > 2 * base
    G = graph(toy, cat, kinds=("k",), top_k=1)
    assert all(G.has_edge(str(p), str(r)) for r in cat.heads("induction"))
    assert G.nodes[str(p)]["types"] == "previous_token"
    files = save_graph(G, tmp_path)
    assert nx.read_graphml(files["graphml"]).number_of_edges() == G.number_of_edges()
    with open(files["json"]) as f:
        assert json.load(f)["nodes"]


def test_path_patching_runs_and_refuses_gqa_keys(tiny_models):
    model = tiny_models["gpt2"]
    clean = torch.tensor([[1, 5, 6, 7, 5, 6]])
    corrupt = torch.tensor([[1, 8, 9, 7, 5, 6]])
    res = path_patch(model, clean, corrupt, lambda logits: logits[0, -1, 7], HeadIndex(0, 1), "k")
    assert res.shape == (2, 4) and float(res[0].abs().max()) == 0.0 and torch.isfinite(res).all()
    G = add_path_patching_edges(
        nx.DiGraph(),
        model,
        clean,
        corrupt,
        lambda lg: lg[0, -1, 7],
        [HeadIndex(0, 1)],
        "q",
        top_k=2,
    )
    assert G.number_of_edges() == 2 and all(d["kind"] == "path-q" for *_, d in G.edges(data=True))
    # an edge's effect is the patched metric minus the corrupted one, as path_patch measured it
    base = float(model(corrupt)[0, -1, 7])
    q = path_patch(model, clean, corrupt, lambda lg: lg[0, -1, 7], HeadIndex(0, 1), "q")
    for _, v, d in G.edges(data=True):
        layer, head = (int(x) for x in v[1:].split("H"))
        assert d["score"] == pytest.approx(float(q[layer, head]) - base, abs=1e-4)
    with pytest.raises(headmech.HeadmechError, match="grouped-query"):
        path_patch(
            tiny_models["llama"], clean, corrupt, lambda lg: lg[0, -1, 7], HeadIndex(0, 1), "k"
        )


def test_circuit_cli_writes_graph_and_figure(tiny_dirs, tmp_path, capsys):
    from headmech.cli import main

    code = main(
        [
            "circuit",
            str(tiny_dirs["gpt2"]),
            "--types",
            "attention_sink,previous_token",
            "--out",
            str(tmp_path),
            "--kinds",
            "k,v",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "edges" in out
    for name in ("circuit.graphml", "circuit.json", "circuit.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert main(["circuit", str(tiny_dirs["gpt2"]), "--kinds", "x", "--out", str(tmp_path)]) == 2
