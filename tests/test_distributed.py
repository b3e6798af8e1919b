"""torchrun: two gloo processes shard the probe batches and all_reduce the per-head sums;
the catalog equals the single-process one (scores to 1e-5, same labels and intervals) and
rank 0 alone writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

TYPES = "positional,previous_token,attention_sink,syntactic"
# exact (the batched runner) and gradient methods: each rank runs its share of the batches
METHODS = ["zero", "mask_gradient", "attribution_patching", "dla", "lrp"]


# Every torchrun command of this module in one launch: the two ranks run the commands one
# after another (``headmech.cli.main``, what ``python -m headmech`` runs), so the launcher's
# and the ranks' start-up (imports, the process group) is paid once, not once a command
# (7 launches took ~85 s of the module's ~90 s on the 2-core CI machine)
_COMMANDS = """
import json, sys

from headmech.cli import main

for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.exit(code)
"""


def _torchrun(commands: list[list[str]], nproc: int, script) -> None:
    """The commands under torchrun with ``nproc`` processes, in one launch."""
    script.write_text(_COMMANDS)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc-per-node", str(nproc), str(script), json.dumps(commands)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launcher, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _commands(tiny_dirs) -> dict[str, list[str]]:
    """What each check runs (without ``--out``)."""
    # catalogs: the prose types (spaCy parses included) on the tiny LLaMA: random weights,
    # so no type labels heads; the scores, intervals and the clean run's metric must agree
    catalogs = ["classify", str(tiny_dirs["llama"]), "--types", TYPES, "--n-sentences", "24"]
    catalogs += ["--batch-size", "4", "--validate", "--n-random", "2"]
    # labelled: the trained toy model, whose induction and duplicate-token heads are
    # labelled: the validation ablates them and their controls, with large effects to agree on
    labelled = ["classify", "toy-induction", "--types", "induction,duplicate_token"]
    labelled += ["--n-sequences", "12", "--batch-size", "4", "--validate", "--n-random", "2"]
    out = {"catalogs": catalogs, "labelled": labelled}
    for method in METHODS:
        args = ["importance", str(tiny_dirs["llama"]), "--method", method, "--task", "induction"]
        out[method] = args + ["--n-sequences", "8", "--half-len", "8", "--batch-size", "2"]
    return out


@pytest.fixture(scope="module")
def results(tiny_dirs, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Per check: the result file of the single-process reference (in this process) and of
    two gloo processes under torchrun (every check's command in the same launch)."""
    from headmech.cli import main

    root = tmp_path_factory.mktemp("dist")
    commands = _commands(tiny_dirs)
    for name, args in commands.items():
        assert main([*args, "--out", str(root / name / "one")]) == 0
    launched = [[*args, "--out", str(root / name / "two")] for name, args in commands.items()]
    _torchrun(launched, 2, root / "commands.py")
    out = {}
    for name, args in commands.items():
        file = "catalog.json" if args[0] == "classify" else "importance.json"
        one, two = (json.loads((root / name / d / file).read_text()) for d in ("one", "two"))
        out[name] = (one, two)
    return out


@pytest.mark.parametrize("which", ["catalogs", "labelled"])
def test_two_gloo_processes_equal_one(results, which):
    one, two = results[which]
    assert one["types"].keys() == two["types"].keys()
    for name, t in one["types"].items():
        u = two["types"][name]
        assert "interval" in t, name  # the bootstrap runs on the merged per-sequence sums
        pairs = [(t["score"], u["score"])]
        pairs += [(t["interval"][k], u["interval"][k]) for k in ("low", "high")]
        for a, b in pairs:
            a, b = (torch.tensor(x, dtype=torch.float64) for x in (a, b))
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0, equal_nan=True)
        assert u["heads"] == t["heads"] and u.get("borderline") == t.get("borderline"), name
        if "validation" in t["details"]:  # ablation effects: evaluate() sharded too
            v, w = t["details"]["validation"], u["details"]["validation"]
            assert v["effect"] == pytest.approx(w["effect"], abs=1e-5), name
            assert v["random_effects"] == pytest.approx(w["random_effects"], abs=1e-5), name
    assert one["provenance"] == two["provenance"]  # same probes, same weights
    if which == "labelled":  # labelled heads whose ablation matters, in both runs
        v = one["types"]["induction"]["details"]["validation"]
        assert one["types"]["induction"]["heads"] and v["effect"] > 1.0
        assert min(abs(e) for e in v["random_effects"]) > 0.1  # (the toy's layer-0 controls
        # matter too: issue "findings that hold up")


@pytest.mark.parametrize("method", METHODS)
def test_two_gloo_processes_importance_equals_one(results, method):
    one, two = results[method]
    a, b = (torch.tensor(x["score"], dtype=torch.float64) for x in (one, two))
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    if "interval" in one:  # per-sequence parts gathered in batch order: same bootstrap
        for k in ("low", "high"):
            x, y = (torch.tensor(d["interval"][k], dtype=torch.float64) for d in (one, two))
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    if one.get("metric_clean") is not None:
        assert two["metric_clean"] == pytest.approx(one["metric_clean"], abs=1e-6)


def test_a_single_process_merges_nothing():
    from headmech.core.distributed import merge_stats, shard, world
    from headmech.stream.engine import HeadStats

    s = HeadStats(2, 4)
    assert world() == (0, 1) and merge_stats(s, [4]) is s and shard([1, 2, 3]) == [1, 2, 3]
