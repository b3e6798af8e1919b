"""Findings a paper can cite: matched controls, intervals, the paper's mask gradient,
provenance and byte-identical files, attribution patching checked against exact patching."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import headmech
from headmech.attribution import importance
from headmech.classification.classify import HeadCatalog, validate_heads
from headmech.core.head_index import HeadIndex
from headmech.probes import ProbeOptions
from headmech.runs.provenance import WeightsMismatchError, weights_hash
from headmech.tasks import get_task

SMALL = ProbeOptions(n_sentences=8, n_sequences=6, half_len=8, batch_size=4)


def _type(name: str, threshold: float = 0.0):
    return headmech.get_head_type(name)(threshold=threshold)


# --- 1, 2: controls ---------------------------------------------------------------------


def test_controls_are_matched_per_layer_and_recorded(tiny_models):
    model = tiny_models["llama"]
    heads = [HeadIndex(0, 1), HeadIndex(1, 3)]  # 4 x 4 - 1 other same-layer sets
    v = validate_heads(model, _type("duplicate_token"), heads, SMALL, n_random=4).to_json()
    assert v["control"] == "same_layers" and len(v["control_sets"]) == v["test"]["n"]
    assert len({frozenset(map(tuple, c)) for c in v["control_sets"]}) == len(v["control_sets"])
    for control in v["control_sets"]:
        assert sorted(layer for layer, _ in control) == [0, 1]  # per-layer counts kept
        assert {tuple(h) for h in control} != {tuple(h) for h in heads}  # a relabelling
    effects = sorted(v["random_effects"])
    assert v["random_effects"] == v["test"]["controls"]
    assert v["random_range"] == pytest.approx([effects[0], effects[-1]])
    lo, hi = v["effect_interval"]
    assert lo <= v["effect"] <= hi and lo < hi
    # the test: exceedances counted against the labelled effect, p = (1 + e) / (1 + n)
    e = sum(c >= v["effect"] for c in v["test"]["controls"])
    assert v["test"]["exceedances"] == e
    assert v["test"]["p"] == pytest.approx((1 + e) / (1 + v["test"]["n"]))


def test_a_full_layer_widens_and_every_head_labelled_has_no_control(tiny_models):
    model = tiny_models["llama"]  # 2 layers x 4 heads
    full = [HeadIndex(0, h) for h in range(4)]  # layer 0 whole: no other set there
    v = validate_heads(model, _type("duplicate_token"), full, SMALL, n_random=3).to_json()
    assert v["control"] == "layers_within_1" and len(v["control_sets"]) == 3
    assert any(h[0] == 1 for s in v["control_sets"] for h in s)
    every = [HeadIndex(la, h) for la in range(2) for h in range(4)]
    v = validate_heads(model, _type("duplicate_token"), every, SMALL, n_random=3).to_json()
    assert v["control"] == "none" and v["control_sets"] == [] and v["random_median"] is None
    assert "no control possible" in v["control_note"] and v["effect"] != 0.0
    assert v["verdict"] == "untestable here"


@pytest.mark.slow
def test_sink_score_equals_a_hand_computation_from_the_patterns(smollm2):
    """The attention-sink score, by hand: each prose sentence alone (no padding) through
    ``run_with_cache``, every head's weight on position 0 averaged over the real queries
    from position 1 on; and Gu et al.'s ε = 0.3 labels exactly the heads at or above it."""
    from headmech.probes import build_probe

    model = smollm2  # a trained model: its heads differ (a tiny random one's all sit at 1/n)
    options = {"n_sentences": 6, "batch_size": 4}
    cat = headmech.classify(model, ["attention_sink"], n_boot=0, **options)
    total = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    count = 0
    for b in build_probe("prose", model, ProbeOptions(**options)).batches:
        for row in range(b.input_ids.shape[0]):
            n = int(b.attention_mask[row].sum())
            queries = ~b.special[row, :n] & (torch.arange(n) >= 1)
            _, cache = model.run_with_cache(b.input_ids[row : row + 1, :n])
            for layer in range(model.cfg.n_layers):
                pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0].double()  # [h, q, k]
                total[layer] += pattern[:, queries, 0].sum(-1)
            count += int(queries.sum())
    want = total / count
    got = cat["attention_sink"].score.double()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float(want.std()) > 0.1  # heads differ: one constant score would fail
    n_layers, n_heads = want.shape
    labelled = {(la, h) for la in range(n_layers) for h in range(n_heads) if want[la, h] >= 0.3}
    assert 0 < len(labelled) < n_layers * n_heads
    assert {tuple(h) for h in cat.heads("attention_sink")} == labelled
    assert headmech.get_head_type("attention_sink").default_threshold == 0.3


# --- 5: mask gradient, per example ------------------------------------------------------


def test_mask_gradient_default_is_mean_of_per_example_absolute_gradients(tiny_models):
    """Michel et al.: I_h = E_x |∂L(x)/∂ξ_h|, here computed one sequence at a time by
    hand and compared with the batched default."""
    from headmech.interventions import gradients
    from headmech.probes import batch_sequences

    model = tiny_models["gpt2"]
    task = get_task("induction", model)
    batches = task.batches(model, SMALL)
    got = importance(model, "mask_gradient", task, batches=batches)
    rows = []
    for b in batches:
        for i in range(b.input_ids.shape[0]):
            one = batch_sequences([b.input_ids[i].tolist()], model.tokenizer, 1)[0]
            one.extras.update({k: v for k, v in b.extras.items() if k in ("half_len", "offset")})
            xi = torch.ones(2, 4, requires_grad=True)
            _, _, s, c = gradients(model, task, one, scale=xi)
            rows.append((xi.grad / c.sum()).abs())
    want = torch.stack(rows).mean(0)
    torch.testing.assert_close(got.score, want, atol=1e-6, rtol=1e-4)
    per_token = importance(model, "mask_gradient", task, batches=batches, per="token")
    assert not torch.allclose(per_token.score, got.score)  # the two definitions differ


# --- 6: intervals -------------------------------------------------------------------------


def test_every_catalog_score_has_a_bootstrap_interval(tiny_models):
    model = tiny_models["bert"]
    cat = headmech.classify(model, ["previous_token", "positional", "syntactic"], n_sentences=24)
    for r in cat.types.values():
        assert r.low is not None and r.high is not None, r.name
        finite = ~torch.isnan(r.score)
        assert bool((r.low[finite] <= r.high[finite]).all())
        # the interval straddles the threshold exactly for the borderline heads
        straddle = {
            HeadIndex(*lh)
            for lh in ((r.low < r.threshold) & (r.high >= r.threshold)).nonzero().tolist()
        }
        assert set(r.borderline) == straddle
    again = headmech.classify(model, ["previous_token"], n_sentences=24)
    assert torch.equal(again["previous_token"].low, cat["previous_token"].low)  # seeded
    none = headmech.classify(model, ["previous_token"], n_sentences=24, n_boot=0)
    assert (
        none["previous_token"].low is None
        and "interval" not in none.to_json()["types"]["previous_token"]
    )


# --- 7: provenance, identical bytes, round trips -------------------------------------------


def test_catalog_provenance_round_trip_and_other_weights(tiny_models, tiny_dirs, tmp_path):
    model = tiny_models["gpt2"]
    cat = headmech.classify(model, ["previous_token"], n_sentences=8)
    p = cat.provenance
    assert p["schema_version"] and p["versions"]["torch"] == torch.__version__
    assert p["model"]["weights_sha256"] == weights_hash(model) and p["model"]["dtype"] == "float32"
    assert p["probes"]["prose"]["data_sha256"] and p["probe_options"]["n_sentences"] == 8
    assert p["settings"]["types"]["previous_token"].startswith("PreviousTokenHead")
    path = cat.save(tmp_path / "a")
    assert HeadCatalog.load(path) == cat  # load(save(x)) == x
    cat.check_model(model)
    other = headmech.load_model(str(tiny_dirs["gpt2"]))  # a second load: the same weights
    cat.check_model(other)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    with pytest.raises(WeightsMismatchError, match="other weights"):
        cat.check_model(other)
    cat.check_model(other, force=True)


def test_importance_and_pruning_round_trip(tiny_models, tmp_path):
    from headmech.attribution import ImportanceResult
    from headmech.pruning import PruningResult, prune

    model = tiny_models["llama"]
    r = importance(model, "zero", "induction", probe_options=SMALL)
    assert ImportanceResult.load(r.save(tmp_path / "i")) == r
    assert "seconds" not in json.loads((tmp_path / "i" / "importance.json").read_text())
    pr = prune(model, "michel", "induction", probe_options=SMALL, fraction=0.5)
    assert PruningResult.load(pr.save(tmp_path / "p")) == pr


@pytest.mark.parametrize(
    "argv",
    [
        ["classify", "MODEL", "--types", "previous_token,positional", "--n-sentences", "8"],
        ["importance", "MODEL", "--method", "zero", "--task", "lm", "--n-sentences", "8"],
        [
            "prune",
            "MODEL",
            "--method",
            "michel",
            "--task",
            "lm",
            "--n-sentences",
            "8",
            "--steps",
            "2",
        ],
    ],
    ids=["classify", "importance", "prune"],
)
def test_rerunning_a_command_writes_the_same_bytes(tiny_dirs, tmp_path, argv):
    from headmech.cli import main

    outs = []
    for k in range(2):
        out = tmp_path / f"run{k}"
        args = [str(tiny_dirs["bert"]) if a == "MODEL" else a for a in argv]
        assert main([*args, "--out", str(out)]) == 0
        outs.append(out)
    # run.json is the run record (seconds, tokens/s, peak memory): the one file that differs
    run = json.loads((outs[0] / "run.json").read_text())
    assert run["probe_tokens"] > 0 and run["peak_memory_mb"] > 0 and run["seconds"]["compute"] > 0
    files = sorted(p.name for p in outs[0].glob("*.json") if p.name != "run.json")
    assert files
    for name in files:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
        data = json.loads((outs[0] / name).read_text())
        prov = data.get("provenance") or data["graph"]["provenance"]  # circuit: node-link
        assert prov["model"]["weights_sha256"] and prov["versions"]["transformers"]


# --- 4: attribution patching checked, patching on encoders ---------------------------------


def test_attribution_patching_reports_its_agreement_and_encoders_patch(tiny_models):
    model = tiny_models["bert"]  # encoder: the lm task's corruption is random tokens
    exact = importance(model, "patching", "lm", probe_options=SMALL)
    assert float(exact.score.abs().max()) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        approx = importance(model, "attribution_patching", "lm", probe_options=SMALL)
    a = approx.details["agreement"]
    assert len(a["heads"]) == 8 and len(a["exact"]) == 8
    # the exact values it reports are exact patching's, head by head
    for (layer, head), value in zip(a["heads"], a["exact"], strict=True):
        assert value == pytest.approx(float(exact.score[layer, head]), abs=1e-5)


@pytest.mark.slow
def test_attribution_patching_warns_on_toy_induction():
    """The toy's previous-token head L0H3: attribution patching ~0 where exact patching
    moves the loss by ~5; the run must say so (the ranks may agree: the scale does not)."""
    toy = headmech.load_model("toy-induction")
    opts = ProbeOptions(n_sequences=8, half_len=16, batch_size=8)
    with pytest.warns(UserWarning, match="disagrees with exact patching"):
        r = importance(toy, "attribution_patching", "induction", probe_options=opts)
    a = r.details["agreement"]
    exact = dict(zip(map(tuple, a["heads"]), a["exact"], strict=True))
    assert exact[(0, 3)] > 1.0 and abs(float(r.score[0, 3])) < 0.5 * exact[(0, 3)]
    assert a["scale"] < 0.1


@pytest.mark.slow
def test_prune_picks_the_task_that_fits_the_model(tmp_path):
    """`headmech prune toy-induction` with no --task: the toy reads no prose, so the
    model's own task (induction) is used rather than failing on `lm`."""
    from headmech.cli import main

    out = tmp_path / "p"
    argv = ["prune", "toy-induction", "--method", "michel", "--steps", "1", "--n-sequences", "4"]
    assert main([*argv, "--half-len", "8", "--out", str(out)]) == 0
    assert json.loads((out / "pruning.json").read_text())["task"] == "induction"
