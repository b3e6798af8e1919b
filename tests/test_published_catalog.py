"""The published catalogs in ``catalog/`` match the code.

Each model's ``check.json`` is regenerated at its small size and compared with the
committed one (the CI diff: every label, count and string equal, every number within
``TOL``, since another CPU's BLAS kernels may move the sixth decimal); each ``catalog.json`` must list exactly the registered head types that fit
its model, name the bundled weights and have a heatmap per type. Any mismatch fails with
one line asking for ``make catalog``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from headmech.classification.validation import MAX_PER_HEAD, MAX_REJECTED
from headmech.core.head_index import HeadIndex
from headmech.headtypes.registry import head_types
from headmech.publish import FULL, MODELS, check_json, expected_types

ROOT = Path(__file__).resolve().parents[1] / "catalog"
FIXTURES = {
    "smollm2-135m": "smollm2",
    "gemma3-270m": "gemma3",
    "qwen2.5-coder-0.5b": "qwen25",
    "minilm-l6": "minilm",
    "toy-induction": "toy_induction",
}
# models whose checks against the loaded model run in another test file, on the model that
# file loads once (a second copy of the 1.5B model's 7 GB of float32 weights in another
# worker would not fit beside the rest of the suite): the same functions, called there
ELSEWHERE = {"qwen2.5-coder-1.5b": "tests/test_qwen15.py"}
LOADED_HERE = [m for m in MODELS if m not in ELSEWHERE]
MAX_PNG_BYTES = 200_000
# one unit of the files' 4th decimal, and the float error of that difference: another CPU than
# the one that wrote them flips a last digit (seen: an AVX2-only AMD EPYC, 0.2189 -> 0.2188);
# relative above 1, where float32's rounding grows with the value (seen: an Intel Xeon,
# SmolLM2's CRI interval bound -10.578386 -> -10.578658)
TOL = 1.5e-4


# Where the installed environment, not the code, is written: the packages' versions. A new
# release of a dependency must not fail this diff by itself (CI installs the newest within
# the pinned ranges); if it changes a number or a label, that part of the file fails.
ENVIRONMENT = {("provenance", "versions")}


def _without_environment(data: Any) -> Any:
    out = json.loads(json.dumps(data))
    for outer, inner in ENVIRONMENT:
        out.get(outer, {}).pop(inner, None)
    return out


def _stale(name: str, what: str) -> None:
    pytest.fail(f"catalog/{name}: {what}; run `make catalog`", pytrace=False)


def _read(name: str, file: str) -> Any:
    path = ROOT / name / file
    if not path.is_file():
        _stale(name, f"{file} is missing")
    return json.loads(path.read_text())


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """The JSON path where ``a`` and ``b`` first differ (``""`` if equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k} only in {'the committed file' if k in a else 'the code'}"
            if (d := _first_difference(a[k], b[k], f"{path}.{k}")) != "":
                return d
        return ""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (d := _first_difference(x, y, f"{path}[{i}]")) != "":
                return d
        return ""
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))
    if numbers and abs(a - b) <= TOL * max(1.0, abs(a), abs(b)):
        return ""
    return "" if a == b else f"{path or 'the file'}: {str(a)[:60]} committed, {str(b)[:60]} now"


def test_first_difference_names_the_path():
    a = {"types": {"x": {"heads": [[1, 2]]}}, "v": 1}
    assert _first_difference(a, json.loads(json.dumps(a))) == ""
    b = {"types": {"x": {"heads": [[1, 3]]}}, "v": 1}
    assert _first_difference(a, b).startswith(".types.x.heads[0][1]: 2 committed, 3 now")
    assert "only in the code" in _first_difference(a, {**a, "w": 2})
    assert _first_difference({"s": [0.5, True]}, {"s": [0.5 + TOL / 2, True]}) == ""
    assert _first_difference({"s": [0.5]}, {"s": [0.5 + 3 * TOL]}).startswith(".s[0]: 0.5 ")
    assert _first_difference({"s": [-10.5]}, {"s": [-10.5 - 5 * TOL]}) == ""  # relative
    assert _first_difference({"s": [-10.5]}, {"s": [-10.5 - 30 * TOL]}) != ""
    assert _first_difference({"s": [1, True]}, {"s": [1, False]}) != ""


def test_a_dependency_release_alone_does_not_fail_the_diff():
    committed = {"provenance": {"versions": {"transformers": "5.23.0"}, "seed": 0}, "s": [0.5]}
    newer = json.loads(json.dumps(committed))
    newer["provenance"]["versions"]["transformers"] = "5.24.0"
    assert _first_difference(_without_environment(committed), _without_environment(newer)) == ""
    newer["s"] = [0.6]  # ... but what it changes in the results does
    assert _first_difference(_without_environment(committed), _without_environment(newer)) != ""
    newer = json.loads(json.dumps(committed))
    newer["provenance"]["seed"] = 1
    assert _first_difference(_without_environment(committed), _without_environment(newer)) != ""


def _unpublished(name: str, registered: set[str]) -> str | None:
    """Why ``catalog/<name>`` does not cover ``registered`` (None when it does): every type
    is in catalog.json or recorded in run.json as not applicable, and nothing else is."""
    types = set(_read(name, "catalog.json")["types"])
    skipped = set(_read(name, "run.json")["skipped"])
    if missing := sorted(registered - types - skipped):
        return f"head type(s) {', '.join(missing)} not published"
    if gone := sorted((types | skipped) - registered):
        return f"head type(s) {', '.join(gone)} published but no longer registered"
    return None


@pytest.mark.parametrize("name", MODELS)
def test_every_registered_type_is_published(name):
    """Without loading a model, so that a new type fails the fast tests too."""
    if (why := _unpublished(name, set(head_types()))) is not None:
        _stale(name, why)


def test_a_new_type_asks_for_make_catalog():
    registered = set(head_types())
    assert _unpublished("minilm-l6", registered | {"brand_new"}) == (
        "head type(s) brand_new not published"
    )
    gone = _unpublished("minilm-l6", registered - {"positional"})
    assert gone == "head type(s) positional published but no longer registered"


def test_readme_has_every_model_and_type():
    text = (ROOT / "README.md").read_text()
    for name in MODELS:
        if f"## {name} " not in text:
            _stale(name, "missing from catalog/README.md")
        for t in _read(name, "catalog.json")["types"]:
            if f"[`{t}`]({name}/heatmaps/{t}.png)" not in text:
                _stale(name, f"type {t} missing from catalog/README.md")


def test_readme_cross_model_table_is_the_catalogs():
    """The README's cross-model block is what :func:`headmech.publish.compare.readme_block` makes
    of the committed catalogs (numbers cannot drift from the files they cite)."""
    from headmech.publish.compare import BEGIN, END, readme_block

    text = (ROOT.parent / "README.md").read_text()
    got = text[text.index(BEGIN) : text.index(END) + len(END)]
    if got != readme_block(ROOT):
        _stale("README.md", "the cross-model table differs from the published catalogs")
    assert all(m in got for m in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "minilm-l6"))


def test_findings_agreement_matrices_are_the_published_files():
    """docs/findings.md's block of agreement matrices is what
    :func:`headmech.publish.agreement.findings_block` makes of the published
    ``definitions.json`` files, each computed on its catalog's weights."""
    from headmech.publish.agreement import DEFS_BEGIN, DEFS_END, findings_block, published_matrices

    matrices = published_matrices(ROOT)
    assert matrices, "no catalog/<model>/definitions.json published"
    for name, m in matrices.items():
        weights = m.provenance["model"]["weights_sha256"]
        assert weights == _read(name, "catalog.json")["provenance"]["model"]["weights_sha256"]
        assert set(m.scores) == {"wu", "qrhead", "locos", "cri", "kv"} and m.effects
        # the KV column: bench_kv_plans.py --definitions ... --report writes it
        assert set(m.kv) == set(m.scores), f"{name}: KV compression not measured"
    text = (ROOT.parent / "docs" / "findings.md").read_text()
    got = text[text.index(DEFS_BEGIN) : text.index(DEFS_END) + len(DEFS_END)]
    if got != findings_block(ROOT):
        _stale("docs/findings.md", "the agreement matrices differ from the published files")


def test_findings_cross_scale_table_is_the_catalogs():
    """docs/findings.md's cross-scale block is what :func:`headmech.publish.scale.findings_block`
    makes of the two published sizes of the family (both are published)."""
    from headmech.publish.scale import SCALE_BEGIN, SCALE_END, SCALE_FAMILY, findings_block

    text = (ROOT.parent / "docs" / "findings.md").read_text()
    got = text[text.index(SCALE_BEGIN) : text.index(SCALE_END) + len(SCALE_END)]
    block = findings_block(ROOT)
    assert block is not None and all(f"`{m}`" in block for m in SCALE_FAMILY)
    if got != block:
        _stale("docs/findings.md", "the cross-scale table differs from the published catalogs")


def test_cross_model_table_flags_differing_probe_sizes(tmp_path):
    """The table's first row gives each model's probe sizes and largest number of control
    sets, as its provenance records them, flagged with a note below when they differ;
    catalogs published at one size are not flagged."""
    import shutil

    from headmech.publish.compare import ProbeSize, cross_model_table, probe_sizes

    sizes = probe_sizes(ROOT, ["smollm2-135m", "qwen2.5-coder-0.5b"])
    assert sizes["smollm2-135m"] == ProbeSize(128, 16, (300, 700, 1100, 1500), 99)
    assert sizes["qwen2.5-coder-0.5b"] == ProbeSize(48, 12, (300, 700, 1100), 99)
    table = cross_model_table(ROOT, ["smollm2-135m", "qwen2.5-coder-0.5b"])
    row = table.splitlines()[2]
    assert row.startswith("| *probe sizes* | ⚠ 128 sentences, 16 sequences, haystacks 300-1500")
    assert "⚠ The models were published at different probe sizes" in table
    for name in ("a", "b"):  # one catalog twice: one size
        (tmp_path / name).mkdir()
        for f in ("catalog.json", "run.json"):
            shutil.copy(ROOT / "smollm2-135m" / f, tmp_path / name / f)
    same = cross_model_table(tmp_path, ["a", "b"])
    assert "⚠" not in same and "| *probe sizes* | 128 sentences" in same


def test_cross_scale_rows_match_depths_by_hand():
    """Two published models as the two sizes (the mechanics; the family's own pair is
    qwen2.5-coder-0.5b and 1.5b): per type, the larger model's labelled heads within one
    layer of the smaller (in relative depth) of one of its labelled heads, and the share
    of the larger model's layers where that holds, counted here by hand."""
    from headmech.publish.scale import cross_scale_rows, cross_scale_table, scale_findings

    small, large = "smollm2-135m", "qwen2.5-coder-0.5b"
    rows = cross_scale_rows(ROOT, small, large)
    a, b = _read(small, "catalog.json"), _read(large, "catalog.json")
    tol = 1 / 29  # one of SmolLM2's 30 layers
    for name in ("induction", "retrieval", "name_mover"):
        da = [la / 29 for la, _ in a["types"][name]["heads"]]
        db = [la / 23 for la, _ in b["types"][name]["heads"]]
        near = [d for d in db if any(abs(d - e) <= tol + 1e-9 for e in da)]
        layers = [la / 23 for la in range(24) if any(abs(la / 23 - e) <= tol + 1e-9 for e in da)]
        r = rows[name]
        assert (r.matched, len(r.large_depths)) == (len(near), len(db))
        assert r.chance == pytest.approx(len(layers) / 24)
        assert r.same_depth() == f"{len(near)} of {len(db)} (chance {len(layers) / 24:.2f})"
    assert (
        rows["induction"].band(True)
        == f"{min(db_ := [la / 23 for la, _ in b['types']['induction']['heads']]):.2f}-{max(db_):.2f}"
    )
    table = cross_scale_table(ROOT, small, large)
    assert table.splitlines()[2].startswith("| *probe sizes* | ⚠ 128 sentences")
    assert any(
        line.startswith(f"- induction heads: {small} {len(a['types']['induction']['heads'])} (")
        for line in scale_findings(ROOT, small, large)
    )


def test_compare_page_shows_the_cross_scale_table_when_both_sizes_are_published(tmp_path):
    """The atlas's compare view gets the family's cross-scale table once both of its sizes
    are published (here the 0.5B catalog stands in for the larger one too), none before."""
    import shutil

    from headmech.publish import site
    from headmech.publish.scale import SCALE_FAMILY

    small, large = SCALE_FAMILY
    (tmp_path / small).mkdir()
    for f in ("catalog.json", "run.json"):
        shutil.copy(ROOT / small / f, tmp_path / small / f)
    assert site._scale(tmp_path) is None
    shutil.copytree(tmp_path / small, tmp_path / large)
    scale = site._scale(tmp_path)
    assert (
        scale is not None
        and scale["same_size"]
        and list(scale["rows"]) == sorted(_read(small, "catalog.json")["types"])
    )
    html = (
        site._environment()
        .get_template("compare.html")
        .render(root=".", scale=scale, definitions={}, models=[], types=[])
    )
    assert f"One family at two sizes: {small} and {large}" in html and "⚠" not in html
    n = len(_read(small, "catalog.json")["types"]["induction"]["heads"])
    assert f"<td>{n} of {n} (chance " in html  # the same catalog: every head at its own depth


def test_cross_model_cells_read_the_catalog():
    """A cell: count and share of the labelled heads, their median relative depth, the
    validation effect vs the controls' median; n/a with the reason for a decoder type on
    an encoder."""
    from headmech.publish.compare import cross_model_rows

    rows = cross_model_rows(ROOT, ["smollm2-135m", "minilm-l6"])
    data = _read("smollm2-135m", "catalog.json")["types"]["induction"]
    cell = rows["induction"]["smollm2-135m"]
    assert cell.n_heads == len(data["heads"]) and cell.share == len(data["heads"]) / 270
    depths = sorted(la / 29 for la, _ in data["heads"])
    assert cell.depth == (depths[(len(depths) - 1) // 2] + depths[len(depths) // 2]) / 2
    assert cell.effect == data["details"]["validation"]["effect"]
    assert cell.control == data["details"]["validation"]["random_median"]
    assert rows["induction"]["minilm-l6"].text() == "n/a (encoder)"


@pytest.fixture(scope="module")
def toy_induction():
    import headmech

    return headmech.load_model("toy-induction")


# The three costliest types at the check size are regenerated on one real model each, the
# one where they cost less (CPU seconds on one thread): function vectors (a suffix pass per
# head: SmolLM2's 270 heads 77 s, Gemma 3's 72 heads 33 s) on Gemma 3; name movers (23 s
# against 36 s) and copy suppression (21 s against 35 s; vocabulary-wide OV circuits, Gemma
# 3's 262k tokens) on SmolLM2. Every other type, and every type of the other models, on
# each; `make catalog` regenerates them all.
NOT_REGENERATED = {
    "smollm2-135m": {"function_vector"},
    # induction and semantic induction ablate each candidate head (12 s and 9 s of Gemma 3's
    # 35 s on one thread, 19 s and 14 s of Qwen2.5's 37 s): regenerated on SmolLM2, where
    # they cost 2 s each; the types read from attention alone are regenerated on all three
    # concordance (448 short prompts) and qrhead (each question twice) are regenerated on
    # SmolLM2 alone, as are subject and relation (Gemma 3 refuses them: not in its check.json)
    # and cri (a backward pass and a patched pass per head and question: 14 s on SmolLM2)
    "gemma3-270m": {
        "concordance", "copy_suppression", "cri", "induction", "name_mover", "qrhead",
        "semantic_induction",
    },
    # Qwen2.5's forward costs about 4x SmolLM2's (a 151k-token unembedding): the types read
    # from attention on its probes are regenerated, those with a pass per head or a
    # vocabulary-wide OV circuit are left to SmolLM2 and Gemma 3
    "qwen2.5-coder-0.5b": {
        "concordance", "copy_suppression", "cri", "function_vector", "inactive", "induction", "name_mover",
        "negative_name_mover", "qrhead", "relation", "s_inhibition", "semantic_induction", "subject",
        "successor", "syntactic",
    },
}  # fmt: skip
# a model whose check.json costs minutes (Qwen2.5-Coder-1.5B: 975 s on two threads, each
# head ablated at 3x the 0.5B model's forward) regenerates only these types, read from
# attention on its probes (about 40 s on one thread); the rest are regenerated on the
# smaller models of the same family and the others
REGENERATED_ONLY = {
    "qwen2.5-coder-1.5b": {"concept_induction", "duplicate_token", "positional", "previous_token"},
}


def _regenerated(name: str, published: set[str]) -> set[str]:
    """The types of ``name``'s check.json the tests regenerate."""
    if name in REGENERATED_ONLY:
        return published & REGENERATED_ONLY[name]
    return published - NOT_REGENERATED.get(name, set())


def _part(data: dict[str, Any], types: set[str], probes: set[str]) -> dict[str, Any]:
    """What the ``types`` (on the ``probes``) write in a check.json: their results, the
    settings and the probes' records."""
    out = json.loads(json.dumps(data))
    out["types"] = {k: v for k, v in out["types"].items() if k in types}
    settings = out["provenance"]["settings"]
    settings["types"] = {k: v for k, v in settings["types"].items() if k in types}
    if "skipped" in settings:  # the reasons of the types that did not run (Gemma: subject)
        settings["skipped"] = {k: v for k, v in settings["skipped"].items() if k in types}
    out["provenance"]["probes"] = {
        k: v for k, v in out["provenance"]["probes"].items() if k in probes
    }
    return out


def test_every_type_of_check_json_is_regenerated_on_some_model():
    published = {n: set(_read(n, "check.json")["types"]) for n in MODELS}
    regenerated = set().union(*(_regenerated(n, t) for n, t in published.items()))
    assert regenerated == set().union(*published.values())
    for name, left in NOT_REGENERATED.items():
        assert left <= published[name], name  # names of types that are there to leave out
    for name, only in REGENERATED_ONLY.items():
        assert only <= published[name] and name not in NOT_REGENERATED, name
    data = _read("smollm2-135m", "check.json")
    part = _part(data, {"induction"}, {"repeated_random"})
    assert list(part["types"]) == ["induction"] and list(part["provenance"]["probes"]) == [
        "repeated_random"
    ]
    assert _first_difference(part, _part(data, {"induction", "positional"}, set())) != ""


def test_every_published_model_is_checked_against_its_weights():
    assert sorted(FIXTURES) == sorted(LOADED_HERE) and set(ELSEWHERE) <= set(MODELS)
    for name, where in ELSEWHERE.items():
        text = (ROOT.parent / where).read_text()
        assert "check_json_regenerates(" in text and "catalog_is_current(" in text, name


def check_json_regenerates(name: str, model: Any) -> dict[str, Any]:
    """The CI diff: the committed small-size catalog equals what the code produces now
    (but for the types of :data:`NOT_REGENERATED`, or those not in
    :data:`REGENERATED_ONLY`, checked on another real model). Returns what it produced."""
    committed = _without_environment(json.loads((ROOT / name / "check.json").read_text()))
    only = None
    if name in NOT_REGENERATED or name in REGENERATED_ONLY:
        only = _regenerated(name, set(committed["types"]))
    now = _without_environment(json.loads(check_json(model, only)))
    if only is not None:
        committed = _part(committed, only, set(now["provenance"]["probes"]))
    if (where := _first_difference(committed, now)) != "":
        _stale(name, f"check.json differs from what the code produces now ({where})")
    return now


def catalog_is_current(name: str, model: Any) -> None:
    """catalog.json holds exactly the registered types that fit ``model``, was computed on
    its weights, has a heatmap per type and a validation of every type."""
    from headmech.runs.provenance import weights_hash

    data = _read(name, "catalog.json")
    want = expected_types(model)
    if sorted(data["types"]) != want:
        _stale(name, f"catalog.json has types {sorted(data['types'])}, the registry {want}")
    if data["provenance"]["model"]["weights_sha256"] != weights_hash(model):
        _stale(name, "catalog.json was computed on other weights than the bundled model's")
    pngs = {p.stem: p.stat().st_size for p in (ROOT / name / "heatmaps").glob("*.png")}
    if sorted(pngs) != want:
        _stale(name, f"heatmaps/ has {sorted(pngs)}, the catalog {want}")
    assert max(pngs.values()) < MAX_PNG_BYTES
    for t, r in data["types"].items():
        v = r["details"].get("validation")
        assert v is not None and v["n_heads"] == len(r["heads"]), f"{name}/{t} not validated"


@pytest.mark.slow
@pytest.mark.parametrize("name", LOADED_HERE)
def test_check_json_regenerates(name, request):
    check_json_regenerates(name, request.getfixturevalue(FIXTURES[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", LOADED_HERE)
def test_published_catalog_is_current(name, request):
    catalog_is_current(name, request.getfixturevalue(FIXTURES[name]))


def _at_or_above(t: dict[str, Any], grid: Any) -> set[tuple[int, int]]:
    return {
        (la, h)
        for la, row in enumerate(grid)
        for h, v in enumerate(row)
        if v is not None and v >= t["threshold"]
    }


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("file", ["catalog.json", "check.json"])
def test_every_head_at_or_above_a_threshold_is_labelled_or_listed_with_its_reason(name, file):
    data = _read(name, file)
    for t_name, t in data["types"].items():
        above = _at_or_above(t, t["score"])
        labelled = {(a, b) for a, b in t["heads"]}
        listed = {HeadIndex.parse(e["head"]) for e in t.get("not_labelled", [])}
        assert labelled <= above, (name, t_name, "a labelled head below the threshold")
        assert above == labelled | {tuple(h) for h in listed}, (name, t_name)
        assert all(e["reason"] and "no reason given" not in e["reason"] for e in t["not_labelled"])


@pytest.mark.parametrize("name", MODELS)
def test_no_control_set_holds_a_head_that_may_be_of_the_type(name):
    """Controls come from heads below the threshold whose interval does not reach it,
    neither labelled nor rejected; and every labelled head measured alone is recorded."""
    data = _read(name, "catalog.json")
    for t_name, t in data["types"].items():
        v = t["details"].get("validation") or {}
        if v.get("validation") == "sink_dose":  # bins of every head's score: no exclusion
            continue
        may_be = _at_or_above(t, t["score"]) | _at_or_above(
            t, (t.get("interval") or {}).get("high", [])
        )
        # relabellings: a control set may keep labelled heads, never another head that may be
        # of the type, nor the labelled set itself
        labelled = {(a, b) for a, b in t["heads"]}
        drawn = {(a, b) for s in v.get("control_sets") or [] for a, b in s}
        assert not drawn & (may_be - labelled), (name, t_name, sorted(drawn & may_be))
        assert labelled not in [{(a, b) for a, b in s} for s in v.get("control_sets") or []]
        measured = {
            h for h, e in t.get("per_head", {}).items() if "effect" in e and e.get("labelled")
        }
        if v.get("effect") is not None and t["heads"]:
            cap = (FULL[name].alone or (MAX_PER_HEAD, MAX_REJECTED))[0]
            want = min(len(t["heads"]), cap)
            assert len(measured) == want, (name, t_name, len(measured), want)
            if want < len(t["heads"]):  # the reader is told how many were
                assert v["per_head_note"].startswith(f"{want} of {len(t['heads'])} labelled")


def _claims(v: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    kind = v.get("primary") or v.get("validation")
    return [(kind, v), *(v.get("secondary") or {}).items()]


@pytest.mark.parametrize("name", MODELS)
def test_every_verdict_is_a_test_with_its_n_p_and_q(name):
    """Issue 60's bar: every claim of a published catalog records n, exceedances, p and q;
    p is (1 + exceedances) / (1 + n); q is Benjamini-Hochberg's over the catalog's claims;
    validated <=> q <= 0.05 and the effect's interval beyond 0 (inactive heads: within
    their tolerance); no verdict rests on fewer control sets than its p needs (a test
    stops at n_max, at 5 exceedances, or with every distinct set drawn)."""
    from scipy.stats import false_discovery_control

    data = _read(name, "catalog.json")
    tests = []
    for t_name, t in data["types"].items():
        v = t["details"]["validation"]
        for kind, c in _claims(v):
            test = c.get("test")
            if not test:
                assert c["verdict"] in ("no heads", "untestable here", "not run"), (t_name, kind)
                continue
            tests.append((t_name, kind, c, test))
            assert {"n", "exceedances", "p", "q"} <= set(test), (t_name, kind)
            assert test["n"] == len(test["controls"])
            e = sum(
                (x >= test["statistic"]) if c["expected"] == "raise" or kind == "sink_dose"
                else (x <= test["statistic"]) if c["expected"] == "lower"
                else abs(x) <= abs(test["statistic"])
                for x in test["controls"]
            )  # fmt: skip
            assert test["exceedances"] == e, (t_name, kind)
            assert test["p"] == pytest.approx((1 + e) / (1 + test["n"]), abs=1e-6)
            assert test["p"] >= test["p_min"] - 1e-9
            stopped = {
                "n_max": test["n"] == test["n_max"],
                "stop_after": e >= test["stop_after"],
                "space": test["n"] == test["n_possible"],
            }
            assert stopped[test["stopped"]], (t_name, kind, test["stopped"])
            if kind != "sink_dose":
                assert len(c["control_sets"]) == test["n"], (t_name, kind)
    qs = false_discovery_control([t["p"] for *_, t in tests], method="bh") if tests else []
    for (t_name, kind, c, test), q in zip(tests, qs, strict=True):
        assert test["q"] == pytest.approx(float(q), abs=1e-6) and test["family"] == len(tests)
        iv, expected = c.get("effect_interval"), c["expected"]
        if expected == "little":
            beyond = abs(c.get("relative_effect", 1.0)) <= c.get("tolerance", 0.01)
        else:
            beyond = iv is not None and (iv[0] > 0 if expected == "raise" else iv[1] < 0)
        if test["p_min"] > 0.05:
            assert c["verdict"] in ("inconclusive", "untestable here"), (t_name, kind)
        else:
            want = "validated" if test["q"] <= 0.05 and beyond else "not validated"
            assert c["verdict"] == want, (name, t_name, kind, c["verdict"], test["q"], iv)
