"""Composition scores against a hand computation; the graph keeps one edge per kind;
path patching through the intervention layer equals TransformerLens' exact direct-path
patch (and the bridge's own KV-head fork under grouped-query attention); the toy
induction circuit is found, by weights and causally."""

from __future__ import annotations

import json

import networkx as nx
import pytest
import torch

import headmech
from headmech.circuits import (
    Circuit,
    add_path_patching_edges,
    composition_baseline,
    composition_scores,
    graph,
    path_patch,
    path_patch_scores,
    save_graph,
)
from headmech.models.weights import head_weights
from headmech.probes import ProbeOptions


@pytest.fixture(scope="session")
def toy():
    """The trained 2-layer attention-only toy (cached; trained on first use)."""
    return headmech.load_model("toy-induction")


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
def test_toy_previous_token_head_k_composes_with_induction_heads(toy, tmp_path):
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
    assert all(G.has_edge(str(p), str(r), key="k") for r in cat.heads("induction"))
    assert G.nodes[str(p)]["types"] == "previous_token"
    files = save_graph(G, tmp_path)
    assert nx.read_graphml(files["graphml"]).number_of_edges() == G.number_of_edges()
    with open(files["json"]) as f:
        assert json.load(f)["nodes"]


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


# --- the graph: one edge per kind --------------------------------------------------------


def test_a_pair_keeps_one_edge_per_composition_kind(tiny_models, tmp_path):
    model = tiny_models["gpt2"]
    q, k = composition_scores(model, "q"), composition_scores(model, "k")
    bq, bk = composition_baseline(model, "q"), composition_baseline(model, "k")
    G = graph(model, kinds=("q", "k"), top_k=4, min_ratio=0.5)
    assert isinstance(G, nx.MultiDiGraph)
    both = [
        (h1, h2)
        for h1 in range(4)
        for h2 in range(4)
        if q[0, h1, 1, h2] >= 0.5 * bq and k[0, h1, 1, h2] >= 0.5 * bk
    ]
    assert both, "no pair above threshold for both kinds"
    for h1, h2 in both:
        u, v = f"L0H{h1}", f"L1H{h2}"
        edges = G.get_edge_data(u, v)  # key -> data
        assert sorted(edges) == ["k", "q"]  # a DiGraph would keep only the later kind
        assert edges["q"]["score"] == pytest.approx(float(q[0, h1, 1, h2]), abs=1e-5)
        assert edges["k"]["score"] == pytest.approx(float(k[0, h1, 1, h2]), abs=1e-5)
        assert edges["k"]["ratio"] == pytest.approx(float(k[0, h1, 1, h2]) / bk, abs=1e-3)
    # both survive GraphML and node-link JSON, and the figure draws parallel edges
    files = Circuit(G, "tiny").save(tmp_path)
    back = nx.read_graphml(files["graphml"])
    assert back.is_multigraph() and back.number_of_edges() == G.number_of_edges()
    u, v = f"L0H{both[0][0]}", f"L1H{both[0][1]}"
    assert back.number_of_edges(u, v) == 2
    with open(files["json"]) as f:
        data = json.load(f)
    assert data["multigraph"] and len(data["edges"]) == G.number_of_edges()
    assert (tmp_path / "circuit.png").stat().st_size > 0
    ratios = [d["ratio"] for *_, d in Circuit(G).edges()]
    assert ratios == sorted(ratios, reverse=True) and len(ratios) == G.number_of_edges()


# --- path patching -----------------------------------------------------------------------


def _prompt_pair(model):
    """Three random prompts, the corrupted ones differing in four early tokens; the metric
    is the loss of the token after the first corrupted one, at the last position."""
    from headmech.attribution.patching import prompt_pair_task

    g = torch.Generator().manual_seed(1)
    clean = torch.randint(10, 1000, (3, 12), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2:6] = torch.randint(10, 1000, (3, 4), generator=g)

    def metric(logits):
        return -logits[:, -1].log_softmax(-1)[torch.arange(3), clean[:, 3]].mean()

    task, _, corrupt_batch = prompt_pair_task(model, clean, corrupt, metric)
    return task, clean, corrupt, metric, corrupt_batch


@pytest.fixture(scope="module")
def strong_models(tmp_path_factory, bpe_tokenizer):
    """3-layer GPT-2 and LLaMA (GQA: 2 KV heads) with weights ~N(0, 0.5²), so path effects
    are of order 0.1 (the tiny fixtures' are ~1e-6: agreement there would prove nothing)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("strong")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=len(bpe_tokenizer), n_positions=64, n_embd=32, n_layer=3, n_head=4,
                initializer_range=0.5,
            )
        )  # fmt: skip
        llama = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, initializer_range=0.5,
            )
        )  # fmt: skip
    out = {}
    for name, hf in (("gpt2", gpt2), ("llama", llama)):
        hf.save_pretrained(root / name)
        bpe_tokenizer.save_pretrained(root / name)
        out[name] = headmech.load_model(str(root / name))
    return out


@pytest.mark.parametrize("component", ["q", "k", "v"])
def test_path_patching_equals_transformer_lens_direct_path(strong_models, tiny_models, component):
    """Denoising path patching = TransformerLens' get_act_patch_direct_path (which patches
    the clean write into the corrupted run through the bridge's split Q/K/V forks)."""
    from transformer_lens.patching import get_act_patch_direct_path

    from headmech.interventions import evaluate

    for model in (strong_models["gpt2"], tiny_models["gpt2"]):
        task, clean, corrupt, metric, corrupt_batch = _prompt_pair(model)
        base = evaluate(model, task, [corrupt_batch])
        largest = 0.0
        strong = model is strong_models["gpt2"]  # all senders; the tiny model: one
        for sender in [(0, h) for h in range(4)] + [(1, 2)] if strong else [(0, 1)]:
            names = f"blocks.{sender[0]}.attn.hook_z"
            _, cc = model.run_with_cache(clean, names_filter=lambda n, names=names: n == names)
            _, xc = model.run_with_cache(corrupt, names_filter=lambda n, names=names: n == names)
            want = get_act_patch_direct_path(
                model, corrupt, cc, xc, metric, *sender, component, verbose=False
            ).cpu()
            got = path_patch(model, task, sender, component=component, direction="denoising")
            later = slice(sender[0] + 1, None)
            assert torch.isnan(got[: sender[0] + 1]).all()  # not after the sender: unmeasured
            torch.testing.assert_close(base - got[later], want[later], atol=1e-4, rtol=0)
            largest = max(largest, float((want[later] - base).abs().max()))
        if strong:
            assert largest > 0.05  # the agreement is about real effects


@pytest.mark.parametrize("component", ["k", "v"])
def test_gqa_key_value_receivers_are_kv_heads(strong_models, component):
    """Under grouped-query attention a k/v receiver is its KV head: query heads of a group
    get the same effect, and it equals adding the sender's write to that KV head's input
    in the bridge's own split-QKV fork (which has one input per KV head)."""
    from headmech.interventions import evaluate

    model = strong_models["llama"]
    task, clean, corrupt, metric, corrupt_batch = _prompt_pair(model)
    base = evaluate(model, task, [corrupt_batch])
    z = "blocks.0.attn.hook_z"
    _, cc = model.run_with_cache(clean, names_filter=lambda n: n == z)
    _, xc = model.run_with_cache(corrupt, names_filter=lambda n: n == z)
    sender = 1
    delta = (cc[z][:, :, sender] - xc[z][:, :, sender]) @ model.blocks[0].attn.W_O[sender]

    def add(kv):
        def f(x, hook):
            x = x.clone()
            x[:, :, kv] += delta
            return x

        return f

    got = path_patch(model, task, (0, sender), component=component, direction="denoising")
    want = torch.full_like(got, float("nan"))
    model.set_use_split_qkv_input(True)
    try:
        for layer in (1, 2):
            for kv in range(2):
                name = f"blocks.{layer}.attn.hook_{component}_input"
                with torch.no_grad():
                    want[layer, 2 * kv : 2 * kv + 2] = float(
                        metric(model.run_with_hooks(corrupt, fwd_hooks=[(name, add(kv))]))
                    )
    finally:
        model.set_use_split_qkv_input(False)
    torch.testing.assert_close(base - got[1:], want[1:], atol=1e-4, rtol=0)
    assert float((want[1:] - base).abs().max()) > 0.05
    assert torch.equal(got[1:, 0], got[1:, 1]) and torch.equal(got[1:, 2], got[1:, 3])


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_path_patch_effect_recomputes_the_hooked_inputs(tiny_models, kind):
    """PathPatch with Δ = 0 recomputes q/k/v from the layer input (ln1 for pre-norm models,
    the raw residual for BERT; before rotary for LLaMA) and changes nothing."""
    from headmech.interventions import Intervention, PathPatch, capture
    from headmech.interventions.effects import heads_first
    from headmech.tasks import get_task

    model = tiny_models[kind]
    batch = get_task("lm", model).batches(model, ProbeOptions(n_sentences=4))[0]
    names = ["blocks.1.hook_in", "blocks.1.attn.hook_q", "blocks.1.attn.hook_k"]
    names += ["blocks.1.attn.hook_v", "blocks.1.hook_out"]
    clean = capture(model, batch, names)
    zero = torch.zeros(*batch.input_ids.shape, int(model.cfg.d_model))
    for site in "qkv":
        effect = PathPatch(model, zero, site)
        n = clean[f"blocks.1.attn.hook_{site}"].shape[2]  # KV heads for k/v under GQA
        idx = torch.arange(n)
        again = effect.read(clean["blocks.1.hook_in"], 1, idx)  # [batch, n, pos, d_head]
        want = heads_first(clean[f"blocks.1.attn.hook_{site}"], site)
        torch.testing.assert_close(again, want, atol=1e-5, rtol=0)
        iv = Intervention.on([(1, h) for h in range(n)], effect, site)
        out = capture(model, batch, ["blocks.1.hook_out"], [iv])["blocks.1.hook_out"]
        torch.testing.assert_close(out, clean["blocks.1.hook_out"], atol=1e-5, rtol=0)
    wrong = Intervention.on([(1, 0)], PathPatch(model, zero, "q"), "k")  # q weights on k
    with pytest.raises(headmech.HeadmechError, match="recomputed"):
        capture(model, batch, ["blocks.1.hook_out"], [wrong])


def test_path_patching_api(strong_models, tiny_models):
    """Scores for many senders = path_patch per sender; edges carry the measured effect;
    bad input is refused in one line."""
    model = strong_models["gpt2"]
    task, *_ = _prompt_pair(model)
    scores = path_patch_scores(model, task, "q")  # [l1, h1, l2, h2]
    assert scores.shape == (3, 4, 3, 4) and torch.isnan(scores[2]).all()
    assert torch.isnan(scores[1, :, :2]).all() and torch.isfinite(scores[1, :, 2]).all()
    for h in range(4):
        one = path_patch(model, task, (0, h), component="q")
        torch.testing.assert_close(scores[0, h], one, equal_nan=True, atol=1e-6, rtol=0)
    some = path_patch(model, task, (0, 1), [(1, 2)], "v")
    assert torch.isfinite(some[1, 2]) and int(torch.isnan(some).sum()) == 11
    by_name = path_patch(model, task, "L0H1", ["L1H2"], "v")  # heads as the CLI names them
    torch.testing.assert_close(by_name, some, equal_nan=True, atol=0, rtol=0)
    G = graph(model, kinds=("q",), top_k=4, min_ratio=0.0)
    n_before = G.number_of_edges()
    add_path_patching_edges(G, model, task, [(0, 1)], "q", top_k=2, min_ratio=0.0)
    path_edges = [(u, v, d) for u, v, d in G.edges(data=True) if d["kind"] == "path-q"]
    assert G.number_of_edges() == n_before + 2 and len(path_edges) == 2
    effects = scores[0, 1, 1:].flatten()  # receivers L1H0 .. L2H3
    top = {f"L{1 + i // 4}H{i % 4}" for i in effects.abs().topk(2).indices.tolist()}
    for u, v, d in path_edges:
        assert u == "L0H1" and v in top
        if G.has_edge(u, v, key="q"):  # beside the composition edge, not over it
            assert G.number_of_edges(u, v) == 2
        layer, head = (int(x) for x in v[1:].split("H"))
        assert (
            d["effect"] == d["score"] == pytest.approx(float(scores[0, 1, layer, head]), abs=1e-5)
        )
        assert d["ratio"] == pytest.approx(abs(d["effect"]) / d["baseline"], rel=1e-2)
        assert d["baseline"] == pytest.approx(float(effects.abs().mean()), abs=1e-5)
    # default: edges at least as strong as the mean |effect| of every edge measured
    senders = [(0, 0), (0, 1), (1, 2)]
    H = add_path_patching_edges(nx.MultiDiGraph(), model, task, senders, "k", top_k=8)
    k = path_patch_scores(model, task, "k", senders=senders)
    measured = torch.stack([k[s] for s in senders])
    mean = float(measured[~torch.isnan(measured)].abs().mean())
    strong = int((measured.abs() >= mean).sum())  # NaN compares False
    assert H.number_of_edges() == strong and 0 < strong < int((~torch.isnan(measured)).sum())
    for *_, d in H.edges(data=True):
        assert d["ratio"] >= 1.0 and d["baseline"] == pytest.approx(mean, abs=1e-5)
    with pytest.raises(headmech.HeadmechError, match="not a head after"):
        path_patch(model, task, (1, 0), [(0, 2)])
    with pytest.raises(headmech.HeadmechError, match="q, k or v"):
        path_patch(model, task, (0, 0), component="z")  # type: ignore[arg-type]
    with pytest.raises(headmech.HeadmechError, match="prompt_pair_task"):
        path_patch(model, torch.ones(1, 4, dtype=torch.long), (0, 0))  # the old signature
    with pytest.raises(headmech.HeadmechError, match="MultiDiGraph"):
        add_path_patching_edges(nx.DiGraph(), model, task, [(0, 1)])
    with pytest.raises(headmech.HeadmechError, match="post-norm"):
        path_patch(tiny_models["bert"], "lm", (0, 0))


# --- the toy induction circuit, causally -------------------------------------------------


@pytest.mark.slow
def test_toy_previous_token_head_feeds_the_induction_keys(toy):
    """Path patching on the induction task (noising with the task's corruption): the
    previous-token head L0H3 is what the layer-1 induction heads' keys read. Its edge into
    every induction key costs 0.076-0.130 nats (the shipped toy); L0H1 (second by
    K-composition) 0.009-0.028; L0H0 and L0H2 at most 0.009 either way, under a tenth of
    L0H3's into the same key; no layer-0 head feeds the induction queries (at most 0.012).
    Patched into all four keys at once, L0H3's path costs ~5.5 nats: all of its
    activation-patching effect."""
    from headmech.headtypes.previous_token import PreviousTokenHead

    opts = dict(n_sequences=16, half_len=40)
    cat = headmech.classify(toy, [PreviousTokenHead(probe="repeated_random"), "induction"], **opts)
    (p,) = [h for h in cat.heads("previous_token") if h.layer == 0][:1]
    induction = cat.heads("induction")
    assert p == (0, 3) and len(induction) == 4
    probe = ProbeOptions(**opts, batch_size=16)
    k = path_patch_scores(toy, "induction", "k", probe_options=probe)[0, :, 1]  # [sender, recv]
    q = path_patch_scores(toy, "induction", "q", probe_options=probe)[0, :, 1]
    for r in induction:
        into = k[:, r.head]
        others = torch.cat([into[: p.head], into[p.head + 1 :]])
        assert int(into.argmax()) == p.head
        assert float(into[p.head]) > 0.05 and float(into[p.head]) > 2.5 * float(others.max())
        assert float(into[1]) > 0.005  # L0H1's key path is real, if small
        assert float(into[[0, 2]].abs().max()) < 0.1 * float(into[p.head])
    assert float(q.abs().max()) < 0.02  # queries: the current token, not a layer-0 head
    # jointly: L0H3's path into all four induction keys is its whole effect on the task
    from headmech.interventions import Intervention, Patch, PathPatch, capture, evaluate
    from headmech.tasks import get_task

    task = get_task("induction", toy)
    (batch,) = task.batches(toy, probe)
    corrupt = task.corrupt(batch, toy, 0)  # path_patch_scores' corruption (seed 0, batch 0)
    z = "blocks.0.attn.hook_z"
    z_clean, z_corrupt = capture(toy, batch, [z])[z], capture(toy, corrupt, [z])[z]
    delta = (z_corrupt - z_clean)[:, :, p.head] @ toy.blocks[0].attn.W_O[p.head]
    clean = evaluate(toy, task, [batch])
    keys = Intervention.on(induction, PathPatch(toy, delta, "k"), "k")
    everywhere = Intervention.on([p], Patch({0: z_corrupt}))
    joint = evaluate(toy, task, [batch], [keys]) - clean
    full = evaluate(toy, task, [batch], [everywhere]) - clean
    assert joint > 4.0 and abs(joint - full) < 0.05 * full
    assert joint > 8 * float(k[p.head].sum())  # redundant heads: far more than the edges' sum
