"""Validation on each type's own claim (headmech.classification.claims, headmech.interventions.direct_effects, the
copy_suppression task): each metric against a hand computation on a tiny model, control
sets counted, verdicts, degenerate controls on toy-induction, and the partial update of a
published catalog."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from headmech.classification.claims import control_space, n_distinct
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import get_head_type
from headmech.interventions import capture_z
from headmech.probes import ProbeOptions, build_probe
from headmech.tasks import get_task
from headmech.testing import tiny_model

ROOT = Path(__file__).resolve().parents[1] / "catalog"
SMALL = ProbeOptions(n_sentences=8, n_sequences=4, half_len=8)
DEAD = HeadIndex(1, 2)  # its output projection zeroed in the model below


@pytest.fixture(scope="module")
def dead_head_model():
    """A tiny LLaMA (2 layers, 4 heads, GQA) whose head L1H2 writes nothing: its columns
    of the output projection are 0."""
    m = tiny_model("causal", seed=33)
    attn = m.blocks[DEAD.layer].attn
    d_head = int(m.cfg.d_head)
    with torch.no_grad():
        o = attn._original_component.o_proj
        o.weight[:, DEAD.head * d_head : (DEAD.head + 1) * d_head] = 0.0
    return m


def _ioi(model):
    task = get_task("ioi", model)
    batch = task.batches(model, SMALL)[0]
    return task, batch, task.corrupt(batch, model, 0)


def test_direct_path_effect_is_the_hand_computed_logit_difference(dead_head_model):
    """Path patching to the logits = the head's corrupted-minus-clean write at the last
    token, added to the final residual, through the final norm and W_U, by hand."""
    from headmech.interventions.direct_effects import direct_path_effects
    from headmech.stream.engine import run_blocks

    m = dead_head_model
    task, batch, corrupt = _ioi(m)
    query, good, bad = task.contrast(batch)
    sets = [[HeadIndex(1, 0)], [HeadIndex(0, 3), HeadIndex(1, 1)], [DEAD]]
    clean, effects = direct_path_effects(m, batch, corrupt, (query, good, bad), sets)
    z, z_src = capture_z(m, batch), capture_z(m, corrupt)  # [layers, batch, pos, heads, d]
    with torch.no_grad():
        resid = run_blocks(m, batch.input_ids, batch.attention_mask)[query]  # [n, d_model]
        full = m(batch.input_ids, attention_mask=batch.attention_mask)[query]
        g, b = good[query], bad[query]
        rows = torch.arange(len(g))
        assert torch.allclose(clean, full[rows, b] - full[rows, g], atol=1e-4)
        for heads, got in zip(sets, effects, strict=True):
            delta = sum(
                (z_src[h.layer][query][:, h.head] - z[h.layer][query][:, h.head])
                @ m.blocks[h.layer].attn.W_O[h.head]
                for h in heads
            )
            logits = m.ln_final(resid + delta) @ m.W_U + m.b_U
            want = logits[rows, b] - logits[rows, g] - clean
            assert torch.allclose(got, want, atol=1e-4)
    assert effects[0].abs().max() > 1e-4  # a live head moves the logit difference
    assert effects[2].abs().max() < 1e-6  # the dead head does not


def test_head_direct_effects_by_hand_and_zero_for_a_dead_head(dead_head_model):
    from headmech.interventions.direct_effects import head_direct_effects
    from headmech.stream.engine import run_blocks

    m = dead_head_model
    task, batch, _ = _ioi(m)
    query, good, bad = task.contrast(batch)
    de = head_direct_effects(m, batch, (query, good, bad))  # [n, layers, heads]
    z = capture_z(m, batch)
    with torch.no_grad():
        resid = run_blocks(m, batch.input_ids, batch.attention_mask)[query]
        g, b, rows = good[query], bad[query], torch.arange(int(query.sum()))

        def ld(r):
            logits = m.ln_final(r) @ m.W_U + m.b_U
            return logits[rows, g] - logits[rows, b]

        w = z[1][query][:, 0] @ m.blocks[1].attn.W_O[0]
        assert torch.allclose(de[:, 1, 0], ld(resid) - ld(resid - w), atol=1e-4)
    assert de[:, DEAD.layer, DEAD.head].abs().max() < 1e-6
    assert de.abs().max() > 1e-4


def test_copy_task_is_the_in_context_tokens_log_probability_by_hand():
    """On toy-induction's repeated sequences the model predicts tokens of the first half:
    the copy task selects exactly the positions whose argmax is already in context, and
    its metric is minus their cross-entropy, by hand from the full logits."""
    import headmech
    from headmech.tasks.copying import CopyTask, copy_candidates

    toy = headmech.load_model("toy-induction")
    batch = build_probe("repeated_random", toy, ProbeOptions(n_sequences=4)).batches[0]
    query, target = copy_candidates(toy, batch)
    with torch.no_grad():
        logits = toy(batch.input_ids, attention_mask=batch.attention_mask)
    pred = logits.argmax(-1)
    ids, n = batch.input_ids, batch.input_ids.shape[1]
    want = torch.zeros_like(query)
    for r in range(ids.shape[0]):
        for i in range(n - 1):
            seen = zip(ids[r, : i + 1], batch.special[r, : i + 1], strict=True)
            earlier = {int(t) for t, s in seen if not s}
            want[r, i] = bool(batch.attention_mask[r, i + 1]) and int(pred[r, i]) in earlier
    assert torch.equal(query, want) and query.sum() > 10
    assert torch.equal(target[query], pred[query])
    task = CopyTask()
    extras = {**batch.extras, "copy_query": query, "copy_target": target}
    from dataclasses import replace

    sums, counts = task.metric(toy, replace(batch, extras=extras))
    logp = torch.log_softmax(logits.float(), -1).gather(-1, pred[..., None])[..., 0]
    assert torch.allclose(sums[0], (logp * query).sum(1), atol=1e-3)
    assert torch.equal(counts[0], query.sum(1).float())


def test_ablating_a_dead_head_leaves_the_claims_unchanged(dead_head_model):
    """Zero-ablating a head that writes nothing changes the induction metric (previous
    token's claim) and the copy task by 0; its direct path to the logits is 0."""
    from headmech.classification.validation import type_validation

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prev = type_validation(
            dead_head_model,
            get_head_type("previous_token")(),
            [DEAD],
            SMALL,
            2,
            {"induction": []},
        ).to_json()
        nm = type_validation(
            dead_head_model, get_head_type("name_mover")(), [DEAD], SMALL, 2
        ).to_json()
    # no induction head labelled: the primary claim (K-composition) cannot run, the
    # ablation on the induction task is the verdict shown, and the record says why
    assert prev["primary"] == "ablation" and prev["claims"] == ["k_composition", "ablation"]
    assert prev["primary_unavailable"] == {
        "k_composition": "no induction head after a labelled head (the catalog's induction labels)"
    }
    assert abs(prev["effect"]) < 1e-6 and prev["metric"].startswith("mean loss on the repeated")
    assert prev["secondary"]["k_composition"]["verdict"] == "untestable here"
    assert abs(nm["effect"]) < 1e-6 and nm["validation"] == "direct_path"
    low, high = nm["effect_interval"]  # paired over the probe's units, about the effect
    assert low <= nm["effect"] <= high and high - low < 1e-6
    assert nm["backup"]["labelled_direct_effect"] == 0.0
    # two control sets asked for: p >= 1/3 at best, whatever the effect
    assert nm["verdict"] == "inconclusive" and nm["claim"].startswith("Wang et al.")


def test_k_composition_patches_only_the_receivers_keys(dead_head_model):
    """A sender that writes nothing reaches no key (0); a live layer-0 head's write,
    patched into a layer-1 key, moves the induction metric."""
    from headmech.classification.claims import k_composition

    m = dead_head_model
    task = get_task("induction", m)
    batches = task.batches(m, SMALL)
    live = [HeadIndex(0, h) for h in range(4)]
    receivers = [HeadIndex(1, 0), HeadIndex(1, 3)]
    import headmech.interventions as interventions

    made = []
    real = interventions.Intervention

    class Spy(real):  # every intervention k_composition builds, as it builds it
        @classmethod
        def on(cls, heads, effect, site="z", pos=None):
            made.append((sorted(tuple(h) for h in heads), effect.site, site))
            return real.on(heads, effect, site, pos)

    interventions.Intervention = Spy
    try:
        effects, interval = k_composition(m, [live, []], receivers, batches, task, 0)
    finally:
        interventions.Intervention = real
    assert abs(effects[1]) < 1e-7 and abs(effects[0]) > 1e-6
    assert interval is not None and interval[0] <= effects[0] <= interval[1]
    # the patch reaches the receivers' keys alone: their KV heads (2 query heads a KV head),
    # as a path patch of the key input, never a query, value or output
    group = int(m.cfg.n_heads) // int(getattr(m.cfg, "n_key_value_heads", None) or m.cfg.n_heads)
    want = sorted({(1, r.head // group) for r in receivers})
    assert made and all(ivs == (want, "k", "k") for ivs in made), made


def test_control_space_counts_relabellings_but_the_labelled_set():
    # toy-induction: all 4 heads of layer 1 labelled, 2 x 4 heads: no other set in layer 1,
    # 69 other sets of 4 in the model (the labelled heads stay in the pool: relabellings)
    layer1 = [[1, h] for h in range(4)]
    assert control_space(layer1, 2, 4, "same_layers") == (4, 0)
    assert control_space(layer1, 2, 4, "any_layer") == (8, 69)
    assert control_space([[24, 4]], 30, 9, "same_layers") == (9, 8)
    assert control_space([[23, 0], [23, 1], [20, 0]], 30, 9, "same_layers") == (18, 36 * 9 - 1)
    # heads that may be of the type (or of its circuit) leave the pool; the labelled stay
    assert control_space([[24, 4]], 30, 9, "same_layers", [[24, 4], [24, 0]]) == (8, 7)
    assert n_distinct([[[0, 1], [0, 2]], [[0, 2], [0, 1]], [[0, 3], [0, 1]]]) == 2


def test_untestable_controls_on_toy_induction_are_said(capsys):
    """Toy-induction's induction heads fill layer 1: the same layers hold no other set,
    so the controls are drawn from both layers (69 relabellings, every one with layer-0
    heads); 3 asked for: p cannot reach 0.05, inconclusive, and the report's line says so."""
    import headmech
    from headmech.classification.validation import type_validation
    from headmech.cli.report import validation_line

    toy = headmech.load_model("toy-induction")
    heads = [HeadIndex(1, h) for h in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = type_validation(
            toy, get_head_type("induction")(), heads, ProbeOptions(n_sequences=4), 3
        )
    line = validation_line(v)
    v = v.to_json()
    assert (v["control"], v["control_pool"], v["n_possible_sets"]) == ("layers_within_1", 8, 69)
    assert v["verdict"] == "inconclusive" and v["test"]["n"] == 3
    assert v["test"]["p_min"] == pytest.approx(0.25)
    assert "only 0 distinct control set(s) exist in the labelled heads' layers" in v["control_note"]
    assert "n 3" in line and line.endswith("verdict: inconclusive")


def test_update_keeps_the_other_types_bytes(tmp_path):
    """``--types induction --update`` on toy-induction's published catalog: only that
    type's validation and the update records change."""
    from headmech.publish import main

    shutil.copytree(ROOT / "toy-induction", tmp_path / "toy-induction")
    before = json.loads((tmp_path / "toy-induction" / "catalog.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["--models", "toy-induction", "--types", "induction", "--update", "--out", str(tmp_path)]) == 0  # fmt: skip
    after = json.loads((tmp_path / "toy-induction" / "catalog.json").read_text())
    for name, entry in before["types"].items():
        if name != "induction":
            assert json.dumps(after["types"][name]) == json.dumps(entry)
    for key in ("heads", "score", "threshold"):
        assert after["types"]["induction"][key] == before["types"]["induction"][key]
    for h, row in before["types"]["induction"]["per_head"].items():  # the broad reading kept
        broad = {k: x for k, x in row.items() if k.startswith("broad_") or k == "narrow"}
        assert broad and {k: after["types"]["induction"]["per_head"][h][k] for k in broad} == broad
    # layer 1 whole: relabellings of the whole model, whose layer-0 heads include the
    # previous-token head the induction heads read (a type the toy's catalog cannot hold,
    # so its heads could not leave the pool: the record says so); some beat the labelled
    v = after["types"]["induction"]["details"]["validation"]
    assert v["verdict"] == "not validated" and v["test"]["stopped"] == "stop_after"
    assert v["circuit_not_classified"] == ["previous_token"]
    update = after["provenance"]["validation_updates"][-1]
    # seconds are rounded to 0.1: a fast machine updates the toy's type in under 0.05 s
    assert update["types"] == ["induction"] and update["seconds"]["induction"] >= 0
    run = json.loads((tmp_path / "toy-induction" / "run.json").read_text())
    assert run["updates"][-1] == update
    readme = (tmp_path / "README.md").read_text()
    assert "| `induction` | ablation |" in readme and f"n {v['test']['n']}" in readme


def test_a_stopped_update_keeps_its_finished_types(tmp_path, monkeypatch):
    """An update stopped in its second type keeps the first (a unit in
    ``.headmech-partial/update/``); run again, it reads that one back instead of measuring
    it, finishes, writes the catalog and removes the staging folder."""
    import importlib

    from headmech.publish import main

    validation = importlib.import_module("headmech.classification.validation")
    real = validation.type_validation
    shutil.copytree(ROOT / "toy-induction", tmp_path / "toy-induction")
    argv = ["--models", "toy-induction", "--types", "inactive,induction", "--update", "--out", str(tmp_path)]  # fmt: skip

    def stop_at(name):
        def run(model, head_type, *a, **k):
            if head_type.name == name:
                raise KeyboardInterrupt
            return real(model, head_type, *a, **k)

        return run

    monkeypatch.setattr(validation, "type_validation", stop_at("induction"))
    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        main(argv)
    staged = tmp_path / "toy-induction" / ".headmech-partial" / "update"
    assert [p.name for p in (staged / "units").rglob("*.json")] == ["validate-inactive.json"]
    monkeypatch.setattr(validation, "type_validation", stop_at("inactive"))  # read back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(argv) == 0
    assert not (tmp_path / "toy-induction" / ".headmech-partial").exists()
    after = json.loads((tmp_path / "toy-induction" / "catalog.json").read_text())
    assert after["provenance"]["validation_updates"][-1]["types"] == ["inactive", "induction"]
    assert after["types"]["inactive"]["details"]["validation"]["verdict"] == "no heads"
    assert after["types"]["induction"]["details"]["validation"]["test"]["n"] >= 19


def test_update_refuses_a_type_the_catalog_lacks(tmp_path, capsys):
    from headmech.publish import main

    shutil.copytree(ROOT / "toy-induction", tmp_path / "toy-induction")
    assert main(["--models", "toy-induction", "--types", "name_mover", "--update", "--out", str(tmp_path)]) == 1  # fmt: skip
    assert "has no type(s) name_mover" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--models", "toy-induction", "--update"])


def test_readme_findings_quote_the_published_catalogs():
    """Every validation the project's README and its guides (docs/*.md) quote
    (``catalog <model>/<type>: ...``) is the published catalog's, verdict included; the
    findings table (docs/findings.md) quotes one per validated SmolLM2 row and names only
    heads the catalog labels."""
    import re

    from headmech.publish.markdown import quote

    verdicts = "not validated|validated|inconclusive|untestable here|no heads|not run"
    # the README is a front page; the findings live in its guides (docs/findings.md, ...)
    pages = [ROOT.parent / "README.md", *sorted((ROOT.parent / "docs").glob("*.md"))]
    n_quotes, n_rows = 0, 0
    for page in pages:
        text, where = page.read_text(), page.relative_to(ROOT.parent)
        found = re.findall(rf"catalog ([\w.-]+)/(\w+)(?: (ablation))?: .+?: (?:{verdicts})", text)  # fmt: skip
        quoted = re.findall(rf"(catalog [\w.-]+/\w+(?: ablation)?: .+?: (?:{verdicts}))", text)
        n_quotes += len(found)
        for (model, name, part), q in zip(found, quoted, strict=True):
            want = quote(ROOT, model, name, part)
            assert q == want, f"{where} quotes {q!r}; the catalog says otherwise"
        rows = [line for line in text.splitlines() if re.match(r"\| [\w.-]+-\w+ \| \w+ \|", line)]
        n_rows += len(rows)
        for line in rows:
            model, name, heads = (c.strip() for c in line.split("|")[1:4])
            data = json.loads((ROOT / model / "catalog.json").read_text())
            labelled = {f"L{a}H{b}" for a, b in data["types"][name]["heads"]}
            assert set(re.findall(r"L\d+H\d+", heads)) <= labelled, f"{where}: {model}/{name}: {heads}"  # fmt: skip
            if model == "smollm2-135m" and labelled:
                assert f"catalog {model}/{name}: " in line, f"{where}: {model}/{name} quotes no catalog"  # fmt: skip
    assert n_quotes >= 8 and n_rows >= 8
