"""ClassifySpec: one checker for a classify run's settings, in Python and on the command line.

The spec is made once (from keywords or parsed flags) against one table, names the flag or
the keyword in its errors, is what the provenance and the resume manifest record, and a
run resolves the types, checks each threshold and hashes the weights once.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import headmech
from headmech.classification.spec import PARAMETERS, ClassifySpec, ValidationOptions
from headmech.cli import build_parser
from headmech.core.errors import HeadmechError
from headmech.core.head_index import HeadIndex


@pytest.fixture(scope="module")
def toy():
    return headmech.load_model("toy-induction")


def _parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["classify", "toy-induction", "--out", "unused", *flags])


def test_every_flag_of_the_table_is_a_flag_of_classify_and_back():
    """The table and the command line agree: each parameter's flag is one of classify's
    options, and each of classify's analysis options is in the table (the rest are where
    and how the model loads and where the result goes)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    options = {s for a in sub.choices["classify"]._actions for s in a.option_strings}
    flags = {p.flag for p in PARAMETERS.values() if p.flag is not None}
    # the repeated sequences' half length is a flag of importance and prune, not classify
    assert flags - options == {"--half-len"}
    where = {"--out", "--force", "--resume", "--device", "--dtype", "--device-map",
             "--max-memory", "--offload-folder", "-h", "--help"}  # fmt: skip
    assert options - where - flags == set()


@pytest.mark.parametrize(
    ("keywords", "flags", "python_says", "cli_says"),
    [
        ({"validate": True, "n_random": 0}, ("--validate", "--n-random", "0"),
         "n_random must be a positive integer, got 0", "--n-random must be a positive integer, got 0"),
        ({"validate": True, "n_random": 5000}, ("--validate", "--n-random", "5000"),
         "n_random must be at most 1000", "--n-random must be at most 1000"),
        ({"validate": True, "control_tokens": -1}, ("--validate", "--control-tokens", "-1"),
         "control_tokens must be an integer of at least 0", "--control-tokens must be an integer of at least 0"),
        ({"n_sequences": 0}, ("--n-sequences", "0"),
         "n_sequences must be a positive integer", "--n-sequences must be a positive integer"),
        ({"batch_size": 0}, ("--batch-size", "0"),
         "batch_size must be a positive integer", "--batch-size must be a positive integer"),
        ({"seed": -1}, ("--seed", "-1"),
         "seed must be an integer from 0", "--seed must be an integer from 0"),
        ({"types": ["induction"], "thresholds": {"induction": 2.0}},
         ("--types", "induction", "--threshold", "induction=2"),
         "the threshold of head type 'induction' must lie in its score's range",
         "--threshold induction=2: the threshold of head type 'induction' must lie"),
        ({"types": ["induction", "induction"]}, ("--types", "induction,induction"),
         "head type induction given more than once", "--types lists induction more than once"),
    ],
)  # fmt: skip
def test_one_checker_names_the_flag_or_the_keyword(keywords, flags, python_says, cli_says):
    with pytest.raises(HeadmechError) as python:
        ClassifySpec.create(**keywords)
    with pytest.raises(HeadmechError) as cli:
        ClassifySpec.from_args(_parse(*flags))
    assert python_says in str(python.value) and "--" not in str(python.value).split(":")[0]
    assert cli_says in str(cli.value)
    assert "\n" not in str(python.value) + str(cli.value)


def test_an_unknown_keyword_is_one_line_with_a_close_name():
    with pytest.raises(
        HeadmechError, match=r"unknown keyword 'n_sentence' \(did you mean 'n_sentences'\?\)"
    ):
        ClassifySpec.create(n_sentence=8)


def test_an_error_names_the_command_it_came_from():
    from headmech.discover.spec import DiscoverSpec

    with pytest.raises(HeadmechError, match=r"^discover\(\) got an unknown keyword 'n_sentence'"):
        DiscoverSpec.create(n_sentence=8)
    with pytest.raises(HeadmechError, match=r"^classify\(\) got an unknown keyword"):
        ClassifySpec.create(n_sentence=8)


def test_validation_options_only_with_validate_and_settings_ignored_without_it_warn():
    assert ClassifySpec.create().validation is None
    spec = ClassifySpec.create(validate=True, control_tokens=64, alone=(3, 1))
    assert spec.validation == ValidationOptions(99, 64, (3, 1))
    assert spec.validation.test.n_max == 99 and spec.validation.test.control_tokens == 64
    with pytest.warns(UserWarning, match="--n-random is ignored without --validate"):
        ClassifySpec.from_args(_parse("--n-random", "5"))
    with pytest.warns(UserWarning, match="--alone is ignored without --validate"):
        ClassifySpec.from_args(_parse("--alone", "1,1"))
    with pytest.warns(UserWarning, match="--no-broad is ignored without --validate"):
        ClassifySpec.from_args(_parse("--no-broad"))
    assert ClassifySpec.from_args(_parse("--validate", "--no-broad")).validation == (
        ValidationOptions(99, 0, None, broad=False)
    )
    with pytest.raises(HeadmechError, match="broad must be"):
        ClassifySpec.create(validate=True, broad="no")


def test_without_broad_the_heads_are_not_read_on_ordinary_text_and_the_catalog_says_so(toy):
    """``broad=False`` (``--no-broad``) skips the reading on ordinary text: the per-head
    records get no broad entry, each type's ``details["broad"]`` says why, and the
    settings record it (the default leaves no trace, as every published catalog has it)."""
    from headmech.classification.runner import NOT_READ

    opts = dict(types=["induction"], validate=True, n_random=2, n_sequences=4, n_boot=0)
    read = headmech.classify(toy, progress=False, **opts)["induction"]
    spec = ClassifySpec.create(broad=False, **opts)
    skipped = spec.run(toy, progress=False)
    assert "broad" not in ClassifySpec.create(**opts).to_json()
    assert spec.to_json()["broad"] is False and skipped.provenance["settings"]["broad"] is False
    t = skipped["induction"]
    assert t.details["broad"] == {"note": NOT_READ}
    assert "lengths" in read.details["broad"] and read.heads == t.heads
    assert any(r.broad is not None for r in read.per_head.values())
    assert all(r.broad is None for r in t.per_head.values())
    assert t.validation.to_json() == read.validation.to_json()  # the verdicts are the same


def test_to_json_is_the_provenance_settings_and_the_manifest(toy, tmp_path):
    """What a run records as its settings is the spec's JSON (less the probe options,
    which the provenance keeps under its own key, and with the types it skipped)."""
    spec = ClassifySpec.create(
        types=["induction"], thresholds={"induction": 0.3}, n_sequences=4, n_boot=0
    )
    catalog = spec.run(toy, progress=False)
    j = spec.to_json()
    assert catalog.provenance["probe_options"] == j.pop("probe_options")
    assert catalog.provenance["settings"] == {**j, "skipped": {}}
    assert j["thresholds"] == {"induction": 0.3} and "alone" not in j
    assert dataclasses.replace(spec).to_json() == spec.to_json()  # plain data: equal specs


def test_a_classify_resolves_types_checks_thresholds_and_hashes_weights_once(toy, monkeypatch):
    import accelerate.utils

    import headmech.headtypes.base as base
    import headmech.headtypes.registry as registry

    calls = {"resolve": 0, "threshold": 0, "hash": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(registry, "resolve_types", counted("resolve", registry.resolve_types))
    monkeypatch.setattr(registry, "checked_threshold", counted("threshold", base.checked_threshold))
    from headmech.models.loaded import loaded

    loaded(toy).weights_hash = None  # hashed afresh by this run
    align = accelerate.utils.align_module_device
    monkeypatch.setattr(accelerate.utils, "align_module_device", counted("hash", align))
    headmech.classify(
        toy, ["induction", "duplicate_token"], thresholds={"induction": 0.3}, validate=True,
        n_random=2, alone=(1, 0), n_sequences=4, half_len=8, n_boot=0, progress=False,
    )  # fmt: skip
    tensors = len({id(t) for t in [*toy.parameters(), *toy.buffers()]})
    assert calls["resolve"] == 1 and calls["threshold"] == 1
    assert 0 < calls["hash"] <= tensors  # one pass over the weights, not three


def test_resume_names_the_flag_of_a_changed_setting(tmp_path):
    """A resumed classify is compared on the spec's JSON: a changed probe size (nested in
    probe_options) is named by its flag."""
    from headmech.cli.base import staging

    first = _parse("--n-sequences", "4")
    first.out, first.resume = str(tmp_path), False
    store = staging(first, "classify", ClassifySpec.from_args(first))
    store.save(["scores-x"], {"done": True})  # one finished unit and the manifest
    again = _parse("--n-sequences", "5", "--resume")
    again.out = str(tmp_path)
    with pytest.raises(HeadmechError, match=r"was started with --n-sequences 4, this one has 5"):
        staging(again, "classify", ClassifySpec.from_args(again))


def _method_args(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([command, "toy-induction", "--out", "unused", *flags])


def test_importance_and_prune_specs_check_once_in_python_and_on_the_command_line():
    """One checker for the method runs too: a method's options typed and checked, the
    probe sizes' flags named, pruning's own flags turned into its options."""
    from headmech.attribution.spec import ImportanceSpec
    from headmech.pruning.spec import PruneSpec

    spec = ImportanceSpec.from_args(
        _method_args("importance", "--method", "patching", "-o", "chunk=4", "--n-sequences", "6")
    )
    same = ImportanceSpec.create("patching", "induction", probe_options=spec.probe, chunk=4, seed=0)
    assert spec.task == "induction" and spec.options.chunk == 4 and spec.probe.n_sequences == 6
    assert spec.to_json() == same.to_json() and spec.to_json()["options"]["chunk"] == 4
    with pytest.raises(HeadmechError, match="--n-sequences must be a positive integer, got 0"):
        ImportanceSpec.from_args(
            _method_args("importance", "--method", "zero", "--n-sequences", "0")
        )
    with pytest.raises(HeadmechError, match=r"option 'chunk' must be a positive integer, got 0"):
        ImportanceSpec.create("patching", chunk=0)
    with pytest.raises(HeadmechError, match=r"unknown method 'zer'.*did you mean 'zero'"):
        ImportanceSpec.create("zer")
    with pytest.raises(HeadmechError, match="n_boot must be an integer of at least 0"):
        ImportanceSpec.create("zero", n_boot=-1)
    michel = PruneSpec.from_args(_method_args("prune", "--method", "michel", "--fraction", "0.2"))
    assert michel.options.fraction == 0.2 and michel.task == "induction"
    with pytest.raises(HeadmechError, match=r"--fraction must be a number in \(0, 1\]"):
        PruneSpec.from_args(_method_args("prune", "--method", "michel", "--fraction", "2"))
    with pytest.warns(UserWarning, match="--lams: only for --method l0"):
        PruneSpec.from_args(_method_args("prune", "--method", "michel", "--lams", "1"))
    l0 = PruneSpec.from_args(_method_args("prune", "--method", "l0", "-o", "steps=7"))
    assert l0.options.steps == 7 and l0.options.lams == (0.01, 0.1, 1.0, 3.0, 10.0)


def test_circuit_and_discover_specs_check_once_in_python_and_on_the_command_line():
    from headmech.circuits.spec import CircuitSpec
    from headmech.discover.spec import DiscoverSpec

    spec = CircuitSpec.from_args(_method_args("circuit", "--kinds", "k,q", "--top-k", "2"))
    assert spec.kinds == ("k", "q") and spec.top_k == 2 and spec.classify is not None
    assert spec.to_json() == CircuitSpec.create(kinds=("k", "q"), top_k=2).to_json()
    with pytest.raises(HeadmechError, match=r"^--top-k must be a positive integer, got 0$"):
        CircuitSpec.from_args(_method_args("circuit", "--top-k", "0"))
    with pytest.raises(HeadmechError, match=r"^top_k must be a positive integer, got 0$"):
        CircuitSpec.create(top_k=0)
    with pytest.raises(HeadmechError, match="min_ratio must be a positive number"):
        CircuitSpec.create(min_ratio=-1)
    d = DiscoverSpec.from_args(
        _method_args("discover", "--clusters", "3", "--types", "induction", "--n-sequences", "5")
    )
    assert d.n_clusters == 3 and [t.name for t in d.classify.types] == ["induction"]
    assert d.classify.probe.n_sequences == 5 and d.classify.n_boot == 0
    with pytest.raises(HeadmechError, match=r"^--clusters must be an integer of at least 2"):
        DiscoverSpec.from_args(_method_args("discover", "--clusters", "1"))
    with pytest.raises(HeadmechError, match=r"^n_clusters must be an integer of at least 2"):
        DiscoverSpec.create(n_clusters=1)
    with pytest.raises(HeadmechError, match=r"k_range must be \(low, high\)"):
        DiscoverSpec.create(k_range=(5, 3))
    with pytest.raises(HeadmechError, match=r"unknown probe 'prsoe'.*did you mean 'prose'"):
        DiscoverSpec.create(attention_probe="prsoe")


def test_the_kv_plan_spec_checks_once_in_python_and_on_the_command_line():
    from headmech.kv.spec import KVPlanSpec

    spec = KVPlanSpec.from_args(_method_args("kv-plan", "--heads", "L1H2,0:3", "--window", "64"))
    assert spec.heads == (HeadIndex(1, 2), HeadIndex(0, 3)) and spec.window == 64
    assert spec == KVPlanSpec.create(heads=["L1H2", (0, 3)], window=64)
    with pytest.raises(HeadmechError, match=r"^--window must be a positive integer, got 0$"):
        KVPlanSpec.from_args(_method_args("kv-plan", "--heads", "L1H2", "--window", "0"))
    with pytest.raises(HeadmechError, match=r"^give exactly one of catalog and heads$"):
        KVPlanSpec.create()
    with pytest.raises(HeadmechError, match=r"^--budget needs --catalog and --context"):
        KVPlanSpec.from_args(_method_args("kv-plan", "--heads", "L1H2", "--budget", "0.5"))
    with pytest.raises(HeadmechError, match=r"fill is 'heads' or 'window'"):
        KVPlanSpec.create(heads=["L0H0"], fill="both")


def test_a_toy_plan_from_named_heads_is_the_plan_from_heads(toy):
    from headmech.kv import KVPlan
    from headmech.kv.spec import KVPlanSpec

    plan = KVPlanSpec.create(heads=["L1H2"], sinks=2, window=16).run(toy)
    assert plan == KVPlan.from_heads(toy, ["L1H2"], sinks=2, window=16, source={"kind": "heads"})


@pytest.mark.slow
def test_the_walk_enters_each_package_once_on_every_chain_of_calls(tmp_path):
    """docs/walk.py's criterion: on the call stack of every call that carries the run's
    settings, no package is re-entered on the way down except through a declared callback
    (a resumable run's unit)."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(headmech.__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("headmech_docs_walk", root / "docs" / "walk.py")
    walk = importlib.util.module_from_spec(spec)
    sys.modules["headmech_docs_walk"] = walk  # dataclasses look their module up
    spec.loader.exec_module(walk)
    argv = ["classify", "toy-induction", "--types", "induction", "--validate",
            "--n-random", "3", "--n-sequences", "4", "--out", str(tmp_path)]  # fmt: skip
    stops = walk.walk(argv, root)
    layers = walk._layers(root / "pyproject.toml")
    f = walk.figures(stops, layers)
    assert f.stops > 50 and f.packages >= 8  # it traced the whole run
    assert f.reentries, "the resume callback is on the path; a tracer that sees none is broken"
    assert {e.split(" -> ")[0] for e in f.reentries} <= walk.CALLBACKS, f.reentries
    calls = [p.split(":")[1] for p in f.path]
    assert calls.count("resolve_types") == 1
