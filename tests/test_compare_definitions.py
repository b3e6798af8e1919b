"""The agreement matrix of retrieval-head definitions (headmech.compare, ``headmech
compare-definitions``) on a tiny LLaMA with grouped-query attention: each set is its
definition's top k, the Jaccard overlaps and depths are the sets', every ablation is a
sequential test whose q is Benjamini-Hochberg's over the matrix, controls keep out the
definition's next k heads, the KV ranking's score is its KV head's, a stopped run resumes
from its units, and bad input is refused in one line before any score is measured.
"""

from __future__ import annotations

import json

import pytest
import torch

from headmech.classification.definitions import jaccard
from headmech.compare import AgreementMatrix, MatrixOptions, agreement_matrix
from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex, top_k

SMALL = {"k": 3, "n_questions": 6, "cri_questions": 2, "context": (200,), "kv_context": 200,
         "kv_window": 32, "n_random": 5}  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory, bpe_tokenizer):
    """A tiny LLaMA (3 layers x 4 query heads, 2 KV heads) whose 512 positions hold the
    documents probe's five documents and a 200-token needle trial."""
    from headmech.models.tiny import build_tiny

    path = tmp_path_factory.mktemp("compare") / "llama"
    return build_tiny(
        "llama", path, tokenizer=bpe_tokenizer, pad_token_id=None, n_ctx=512, n_layers=3,
        n_heads=4, n_kv_heads=2, d_model=32, d_mlp=64, seed=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model(folder):
    import headmech

    return headmech.load_model(str(folder))


@pytest.fixture(scope="module")
def matrix(model):
    options = MatrixOptions(definitions=("wu", "qrhead", "cri", "kv"), tasks=("facts",), **SMALL)
    return agreement_matrix(model, options, progress=False)


def test_sets_are_each_definitions_top_k_and_their_overlap_is_jaccards(matrix, model):
    from headmech.classification.definitions import qrhead_scores

    names = ["wu", "qrhead", "cri", "kv"]
    assert list(matrix.scores) == names
    assert all(matrix.scores[n].shape == (3, 4) for n in names)
    sets = {n: top_k(matrix.scores[n], 3) for n in names}
    assert {n: matrix.top(n) for n in names} == sets
    jac = matrix.jaccard()
    for a in names:
        for b in names:
            x, y = set(sets[a]), set(sets[b])
            assert jac[a][b] == pytest.approx(len(x & y) / len(x | y)) == jaccard(x, y)
        assert matrix.depth(a) == pytest.approx(sum(h.layer for h in sets[a]) / 3 / 2)
    assert jac["wu"]["wu"] == 1.0
    # QRHead's score is qrhead_scores itself on the same questions, CRI the cri type's
    assert torch.allclose(matrix.scores["qrhead"], qrhead_scores(model, 6))
    from headmech.compare.definitions import _documents
    from headmech.headtypes.cri import cri_scores

    cri = cri_scores(model, _documents(model, matrix.options.cri_questions, 0))["cri"]
    assert (
        torch.allclose(matrix.scores["cri"], cri) and "gold document removed" in matrix.notes["cri"]
    )


def test_the_kv_ranking_gives_each_query_head_its_kv_heads_score(matrix, model):
    from headmech.kv import hf_model, kv_importance, needle_batches, prose_batches

    grid, note = matrix.scores["kv"], matrix.notes["kv"]
    imp = kv_importance(
        hf_model(model), needle_batches(model, 200, seeds=(0,)), prose_batches(model, 200, n=1),
        window=32,
    )  # fmt: skip
    assert imp.score.shape == (3, 2) and grid.shape == (3, 4)
    for la in range(3):
        for h in range(4):
            assert grid[la, h] == pytest.approx(float(imp.score[la, h // 2]))
    assert "its 2 query heads" in note


def test_every_ablation_is_a_test_and_q_is_benjamini_hochbergs_over_the_matrix(matrix):
    from scipy.stats import false_discovery_control

    claims = [(d, t, c) for d, tasks in matrix.effects.items() for t, c in tasks.items()]
    assert [(d, t) for d, t, _ in claims] == [(d, "facts") for d in ("wu", "qrhead", "cri", "kv")]
    ps = []
    for d, _, c in claims:
        test = c["test"]
        assert 1 <= test["n"] <= 5 and test["n"] == len(test["controls"]) == len(c["control_sets"])
        e = sum(x >= test["statistic"] for x in test["controls"])
        assert test["exceedances"] == e and test["p"] == pytest.approx((1 + e) / (1 + test["n"]))
        assert c["n_heads"] == 3 and c["mode"] == "mean"
        # controls: as many heads, none of the definition's next 3 (the set's own heads
        # stay in the pool: relabellings, an exact permutation test), never the set itself
        top = top_k(matrix.scores[d], 6)
        near, own = set(top[3:]), set(top[:3])
        for s in c["control_sets"]:
            drawn = {HeadIndex(a, b) for a, b in s}
            assert len(drawn) == 3 and not drawn & near and drawn != own
        ps.append(test["p"])
    qs = false_discovery_control(ps, method="bh")
    for (_, _, c), q in zip(claims, qs, strict=True):
        assert c["test"]["q"] == pytest.approx(float(q)) and c["test"]["family"] == 4
        assert c["verdict"] in ("inconclusive", "untestable here")  # p cannot reach 0.05
    text = matrix.table()
    assert "wu on facts:" in text and "q " in text and "n " in text


def test_saved_and_read_back(matrix, tmp_path):
    path = matrix.save(tmp_path)
    assert path.name == "definitions.json" and (tmp_path / "definitions.png").is_file()
    back = AgreementMatrix.load(tmp_path)
    assert back == matrix and back.options == matrix.options
    data = json.loads(path.read_text())
    assert data["definitions"]["qrhead"]["top"] == [str(h) for h in matrix.top("qrhead")]
    assert "Query-Focused" in data["definitions"]["qrhead"]["citation"]
    assert data["provenance"]["settings"]["agreement_matrix"]["k"] == 3


def test_a_stopped_run_resumes_from_its_units(model, tmp_path):
    """Each score and each test is stored as it finishes and read back: a stored score
    changed by hand is what the resumed run's set is taken from."""
    from headmech.runs.resume import Units

    options = MatrixOptions(definitions=("qrhead", "cri"), tasks=("facts",), **SMALL)
    units = Units(tmp_path / "units")
    first = agreement_matrix(model, options, progress=False, units=units)
    assert units.saved == 4 and units.count() == 4
    stored = json.loads((tmp_path / "units" / "units" / "score" / "qrhead.json").read_text())
    stored["score"] = [[float(i * 4 + j) for j in range(4)] for i in range(3)]
    (tmp_path / "units" / "units" / "score" / "qrhead.json").write_text(json.dumps(stored))
    (tmp_path / "units" / "units" / "ablate" / "qrhead" / "facts.json").unlink()
    store = Units(tmp_path / "units")
    again = agreement_matrix(model, options, progress=False, units=store)
    assert store.saved == 1  # the one test deleted, measured again on the changed set
    assert again.top("qrhead") == [HeadIndex(2, 3), HeadIndex(2, 2), HeadIndex(2, 1)]
    assert again.effects["qrhead"]["facts"]["n_heads"] == 3
    cri, cri_first = again.effects["cri"]["facts"], first.effects["cri"]["facts"]
    assert cri["test"]["controls"] == cri_first["test"]["controls"]


def test_locos_refuses_a_model_that_answers_no_question(model):
    from headmech.compare.definitions import _locos

    with pytest.raises(InputError, match=r"answers none of 6 \(documents probe\)"):
        _locos(model, MatrixOptions(**SMALL), False)
    with pytest.raises(InputError, match=r"answers none of 6 \(nonliteral probe\)"):
        _locos(model, MatrixOptions(**SMALL, locos_probe="nonliteral"), False)
    with pytest.raises(InputError, match="unknown LOCOS probe 'needle'"):
        MatrixOptions(locos_probe="needle")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--definitions", "wu,bogus"], "unknown definition bogus; known: wu, qrhead, locos, cri, kv"),
        (["--tasks", "documents,parametric"], "unknown task parametric; known: documents, retrieval, nonliteral, literal, facts"),
        (["--definitions", "wu", "--tasks", ""], "nothing to compare: give two definitions or a task"),
        (["--k", "0"], "k must be at least 1, got 0"),
        (["--control-tokens", "-1"], "control_tokens must be 0 or more, got -1"),
        (["--k", "7"], "k=7: the sets and the heads kept from their controls (2k) need more than the model's 12 heads"),
        (["--context", "2x"], "--context '2x': expected comma-separated ints"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_before_any_score(folder, tmp_path, capsys, args, message):
    from headmech.cli import main

    status = main(["compare-definitions", str(folder), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) <= 2 and message in err[-1]
    assert not (tmp_path / "o" / "definitions.json").exists()


def test_an_encoder_is_refused(tiny_dirs, tmp_path, capsys):
    from headmech.cli import main

    status = main(["compare-definitions", str(tiny_dirs["bert"]), "--out", str(tmp_path / "o")])
    assert status != 0 and "this model is an encoder" in capsys.readouterr().err


def test_the_command_writes_the_matrix(folder, tmp_path, capsys):
    from headmech.cli import main

    out = tmp_path / "o"
    argv = ["compare-definitions", str(folder), "--definitions", "qrhead,cri", "--tasks", "facts",
            "--k", "2", "--n-questions", "6", "--cri-questions", "2", "--context", "200",
            "--n-random", "4", "--control-tokens", "40", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "qrhead on facts:" in printed and "definitions.png" in printed
    assert {p.name for p in out.iterdir()} >= {"definitions.json", "definitions.png", "run.json"}
    back = AgreementMatrix.load(out)
    assert list(back.scores) == ["qrhead", "cri"] and back.options.k == 2
    test = back.effects["qrhead"]["facts"]["test"]
    assert back.options.control_tokens == 40 and "probe sequences" in test["units"]
    assert json.loads((out / "run.json").read_text())["command"] == "compare-definitions"


def test_the_command_lines_names_are_the_librarys():
    """--help imports no torch, so the command line keeps its own copy of the names."""
    from headmech.cli.compare import DEFINITION_NAMES, TASK_NAMES
    from headmech.compare import DEFINITIONS, RECALL_TASKS

    assert tuple(DEFINITIONS) == DEFINITION_NAMES and tuple(RECALL_TASKS) == TASK_NAMES


def test_published_matrices_become_the_findings_block_and_the_compare_page(matrix, tmp_path):
    """catalog/<model>/definitions.json -> docs/findings.md's block (every set, depth,
    Jaccard and effect with p, q and n) and the atlas's compare view (the same rows)."""
    from headmech.publish import site
    from headmech.publish.agreement import (
        DEFS_BEGIN,
        DEFS_END,
        findings_block,
        matrix_rows,
        replace_defs_block,
    )  # fmt: skip

    assert findings_block(tmp_path) is None
    matrix.save(tmp_path / "tiny-a")
    block = findings_block(tmp_path)
    assert block is not None and block.startswith(DEFS_BEGIN) and block.endswith(DEFS_END)
    rows = {r["name"]: r for r in matrix_rows(matrix)}
    assert list(rows) == ["wu", "qrhead", "cri", "kv"]
    for name, r in rows.items():
        c = matrix.effects[name]["facts"]
        want = (
            f"{c['effect']:+.2f} (controls {c['random_median']:+.2f}), p {c['test']['p']:.3f}, "
            f"q {c['test']['q']:.3f}, n {c['test']['n']}: {c['verdict']}"
        )
        assert r["effects"]["facts"] == want
        line = next(x for x in block.splitlines() if x.startswith(f"| {name} | "))
        assert line.endswith(f" | {want} | not measured |")  # no KV column measured
        assert f" | {matrix.depth(name):.2f} | " in line
    text = f"before\n{DEFS_BEGIN}\nold\n{DEFS_END}\nafter"
    assert replace_defs_block(text, block) == f"before\n{block}\nafter"
    found = site._definitions(tmp_path)
    assert list(found) == ["tiny-a"] and found["tiny-a"]["rows"] == matrix_rows(matrix)
    html = (
        site._environment()
        .get_template("compare.html")
        .render(root=".", scale=None, definitions=found, models=[], types=[])
    )
    assert "Retrieval heads by competing definitions" in html and "<h3>tiny-a</h3>" in html
    assert rows["kv"]["effects"]["facts"] in html


def test_a_definitions_kv_ranking_orders_kv_heads_by_their_best_query_head(matrix):
    """For a KV plan (bench_kv_plans --definitions): KV head (l, g) scored by the highest
    score among query heads 2g and 2g + 1, by hand."""
    for name in matrix.scores:
        s = matrix.scores[name]
        best = {(la, g): max(float(s[la, 2 * g]), float(s[la, 2 * g + 1])) for la in range(3) for g in range(2)}  # fmt: skip
        order = sorted(best, key=lambda p: (-best[p], p))
        assert matrix.kv_ranking(name, 2) == order
    with pytest.raises(InputError, match="4 query heads do not split into KV groups of 3"):
        matrix.kv_ranking("wu", 3)


def test_the_kv_benchmark_plans_each_definitions_ranking(matrix, tmp_path, monkeypatch):
    """bench_kv_plans --definitions: a plan def-<name> per definition of the matrix, ranked
    by :meth:`AgreementMatrix.kv_ranking` at the model's KV group."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    sys.modules.pop("bench_kv_plans", None)
    import bench_kv_plans

    hf = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2))
    assert bench_kv_plans.definition_rankings(hf, None) == {}
    got = bench_kv_plans.definition_rankings(hf, str(matrix.save(tmp_path)))
    assert got == {f"def-{n}": matrix.kv_ranking(n, 2) for n in ("wu", "qrhead", "cri", "kv")}


def test_rescoring_a_definition_measures_it_again_and_redoes_the_family(matrix, model):
    """A definition measured again on the same weights gives the matrix back (its score,
    its set's effects, every q); a stale score (here zeros) is replaced by the measured one,
    the other definitions' records kept but their q taken over the new family."""
    import copy

    from headmech.compare.rescore import rescore_definition

    again = rescore_definition(model, matrix, "cri", progress=False)
    assert torch.equal(again.scores["cri"], matrix.scores["cri"])
    assert again.effects == matrix.effects
    assert again.provenance["rescored"][-1]["definition"] == "cri"
    stale = copy.deepcopy(matrix)
    stale.scores["cri"] = torch.zeros_like(matrix.scores["cri"])
    stale.effects["cri"]["facts"]["test"]["p"] = 1.0  # as if its old set had done nothing
    fixed = rescore_definition(model, stale, "cri", progress=False)
    assert (
        torch.equal(fixed.scores["cri"], matrix.scores["cri"]) and fixed.effects == matrix.effects
    )
    with pytest.raises(InputError, match="no definition locos"):
        rescore_definition(model, matrix, "locos", progress=False)


def test_the_kv_benchmark_writes_each_definitions_compression_into_the_matrix(
    matrix, tmp_path, monkeypatch
):
    """bench_kv_plans --definitions --report: per definition, the smallest budget whose
    def-<name> plan keeps needle recall >= 95% of the full cache's and perplexity within
    1% (compression 1 / its KV fraction), written into definitions.json; the findings block
    and the atlas's rows show it; a definition meeting no budget reads "none"."""
    import sys
    from pathlib import Path

    from headmech.compare import AgreementMatrix
    from headmech.publish.agreement import findings_block, matrix_rows

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    sys.modules.pop("bench_kv_plans", None)
    import bench_kv_plans

    def cell(recall, ppl, frac):
        return {"recall": recall, "logprob": -1.0, "perplexity": ppl,
                "plan": {"kv_fraction": frac, "n_full": 1, "window": 8}}  # fmt: skip

    evals = {"full/1/0": cell(0.9, 10.0, 1.0)}
    for i, name in enumerate(matrix.scores):  # 0: at budget 0.5; 1: never; others: 0.25
        ppl = 10.2 if i == 1 else 10.05
        evals[f"def-{name}/0.25/0"] = cell(0.9 if i else 0.5, ppl, 0.25)
        evals[f"def-{name}/0.5/0"] = cell(0.9, ppl, 0.5)
    store = {"64": {"evals": evals}, "model": "tiny"}
    path = matrix.save(tmp_path / "m")
    got = bench_kv_plans.definitions_column(store, str(path))
    names = list(matrix.scores)
    assert got[names[0]]["compression"] == 2.0 and got[names[0]]["budget"] == 0.5
    assert got[names[1]]["compression"] is None  # perplexity 2% above the full cache's
    assert got[names[2]]["compression"] == 4.0 and got[names[2]]["context"] == 64
    back = AgreementMatrix.load(path)
    assert back.kv == got
    rows = {r["name"]: r["kv"] for r in matrix_rows(back)}
    assert rows[names[0]] == "2.00x (budget 50%, 64 tokens)"
    assert rows[names[1]] == "none (no budget up to 50%, 64 tokens)"
    assert "| KV |" in findings_block(tmp_path) and rows[names[2]] in findings_block(tmp_path)
    assert matrix_rows(matrix)[0]["kv"] == "not measured"
    with pytest.raises(SystemExit, match="no context of the store measures every plan"):
        bench_kv_plans.definitions_column({"64": {"evals": {"full/1/0": cell(1, 1, 1)}}}, str(path))
    # def-<name> plans alone read no measured ranking; the catalog's plans need importance
    assert bench_kv_plans.needed_rankings("def-wu,def-kv,random,windowed") == set()
    assert bench_kv_plans.needed_rankings("union,restored") == {"importance", "restored"}
