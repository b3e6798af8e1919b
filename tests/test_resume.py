"""Resumable runs (:mod:`headmech.runs.resume`): a run stopped at a random unit, by Ctrl-C in
process or by SIGKILL of its process, continues with ``--resume`` and writes the same
bytes as an uninterrupted run; ``--resume`` refuses other arguments or weights in one line.

The command-line tests load the tiny LLaMA once (``load_model`` patched to return it);
the SIGKILL test runs the real ``headmech`` in subprocesses, which kill themselves right
after storing a unit (deterministic, and no cleanup of any kind runs)."""

from __future__ import annotations

import importlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import headmech
from headmech.cli import main
from headmech.runs import resume
from headmech.runs.resume import STAGING, Units

validation_module = importlib.import_module("headmech.classification.validation")
runner_module = importlib.import_module("headmech.interventions.runner")
michel_module = importlib.import_module("headmech.pruning.michel")

RESULTS = {
    "classify": ("catalog.json", "heatmap.png"),
    "importance": ("importance.json", "importance.png"),
    "prune": ("pruning.json", "pruning.png"),
}
SIZES = ["--n-sentences", "8", "--batch-size", "2"]
ARGS = {
    "classify": ["--types", "previous_token,attention_sink,positional", "--validate",
                 "--n-random", "1", *SIZES],
    "importance": ["--method", "zero", *SIZES],
    "prune": ["--method", "michel", "--n-sentences", "8", "--batch-size", "4"],
}  # fmt: skip
# the function of one unit, and how many times an uninterrupted run calls it
UNIT_FUNCTIONS = {
    "classify": (validation_module, "type_validation", 3),
    "importance": (runner_module, "_run_batch", 4),
    "prune": (michel_module, "_step", 8),
}


@pytest.fixture
def cli(monkeypatch, tiny_models, tiny_dirs, capsys):
    """``run(command, out, *flags) -> (exit status, stderr)`` on the tiny LLaMA, loaded once."""
    monkeypatch.setattr(headmech.models, "load_model", lambda *a, **k: tiny_models["llama"])

    def run(command: str, out: Path, *flags: str) -> tuple[int, str]:
        argv = [command, str(tiny_dirs["llama"]), *ARGS[command], "--out", str(out), *flags]
        code = main(argv)
        return code, capsys.readouterr().err

    return run


def _bytes(out: Path, command: str) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in RESULTS[command]}


def _stop_at(monkeypatch, command: str, k: int) -> None:
    """The ``k``-th call (from 0) of the command's unit function raises KeyboardInterrupt."""
    module, name, _ = UNIT_FUNCTIONS[command]
    real, calls = getattr(module, name), []

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == k + 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, stopping)


@pytest.mark.parametrize("command", ["classify", "importance", "prune"])
def test_ctrl_c_then_resume_writes_the_same_bytes(cli, monkeypatch, tmp_path, command):
    code, _ = cli(command, tmp_path / "a")
    assert code == 0
    whole = _bytes(tmp_path / "a", command)
    assert not (tmp_path / "a" / STAGING).exists()  # gone once the result is written

    k = random.Random(command).randrange(1, UNIT_FUNCTIONS[command][2])
    with monkeypatch.context() as m:
        _stop_at(m, command, k)
        code, err = cli(command, tmp_path / "b")
    assert code == 130
    line = err.strip().splitlines()[-1]
    assert line.startswith("headmech: error: ") and "finished unit(s) kept in" in line, line
    stored = tmp_path / "b" / STAGING / command
    assert (stored / "manifest.json").is_file() and any((stored / "units").rglob("*.json"))
    assert not (tmp_path / "b" / RESULTS[command][0]).exists()

    # the line ends with the command that continues the run: run exactly that
    how = shlex.split(line.split("continue with: ", 1)[1])
    assert how[0] == "headmech" and how[-1] == "--resume"
    module, name, total = UNIT_FUNCTIONS[command]
    real, calls = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert main(how[1:]) == 0, f"stopped at unit {k}"
    assert len(calls) == total - k  # the finished units were read back, not run again
    assert _bytes(tmp_path / "b", command) == whole, f"stopped at unit {k}"
    assert not (tmp_path / "b" / STAGING).exists()
    assert not (tmp_path / "b" / "catalog.partial.json").exists()


_KILLING = """
import os, signal, sys
from headmech.runs import resume
from headmech.cli import main

after, saved, real = int(os.environ["KILL_AFTER"]), [], resume.Units.save

def save(self, path, record):
    real(self, path, record)
    saved.append(path)
    if len(saved) == after:
        os.kill(os.getpid(), signal.SIGKILL)

resume.Units.save = save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.end_to_end
def test_sigkill_then_resume_writes_the_same_bytes(cli, tiny_dirs, tmp_path):
    procs = {}
    for command in RESULTS:  # the three killed runs at once: their start-up overlaps
        argv = [command, str(tiny_dirs["llama"]), *ARGS[command], "--out", str(tmp_path / command)]
        env = {**os.environ, "KILL_AFTER": str(random.Random(command).randrange(1, 4))}
        env["OMP_NUM_THREADS"] = "1"
        procs[command] = subprocess.Popen(
            [sys.executable, "-c", _KILLING, *argv], env=env, stderr=subprocess.PIPE
        )
    for command, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == -signal.SIGKILL, err.decode()[-2000:]
        stored = tmp_path / command / STAGING / command
        assert (stored / "manifest.json").is_file() and any((stored / "units").rglob("*.json"))
        assert not any(stored.rglob("*.tmp"))  # killed after a rename: no half-written unit
    for command in RESULTS:
        code, err = cli(command, tmp_path / command, "--resume")
        assert code == 0, err
        cli(command, tmp_path / f"{command}-whole")
        assert _bytes(tmp_path / command, command) == _bytes(tmp_path / f"{command}-whole", command)


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("headmech: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_resume_refuses_other_arguments_and_weights(cli, monkeypatch, tiny_models, tmp_path):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _stop_at(m, "importance", 2)
        assert cli("importance", out)[0] == 130
    # a plain rerun would throw the finished units away: refused, naming both ways on
    code, err = cli("importance", out)
    line = _one_error(err)
    assert code == 2 and "holds an unfinished importance run" in line
    assert "continue it with --resume, or start over with --force" in line
    # other arguments
    code, err = cli("importance", out, "--resume", "--seed", "1")
    assert code == 2 and "was started with --seed 0, this one has 1" in _one_error(err)
    # other weights (the same arguments)
    with monkeypatch.context() as m:
        m.setattr(headmech.models, "load_model", lambda *a, **k: tiny_models["gpt2"])
        code, err = cli("importance", out, "--resume")
    assert code == 2 and "was made with other weights" in _one_error(err)
    # nothing to resume elsewhere
    code, err = cli("importance", tmp_path / "empty", "--resume")
    assert code == 2 and "holds no unfinished importance run" in _one_error(err)
    # --force starts over (and finishes: the staging area goes)
    assert cli("importance", out, "--force")[0] == 0
    assert not (out / STAGING).exists() and (out / "importance.json").is_file()


# --- the library: every kind of unit ---------------------------------------------------

TINY = {"n_sentences": 8, "batch_size": 2}


def _importance(model, method, units, **kw):
    from headmech.attribution import importance
    from headmech.probes import ProbeOptions

    r = importance(model, method, "lm", probe_options=ProbeOptions(**TINY), units=units, **kw)
    return json.dumps(r.to_dict(), sort_keys=True)


def _prune(model, method, units, **kw):
    from headmech.probes import ProbeOptions
    from headmech.pruning import prune

    r = prune(model, method, "lm", probe_options=ProbeOptions(**TINY), units=units, **kw)
    return json.dumps(r.to_dict(), sort_keys=True)


CASES = {  # run, method, options, units stored by an uninterrupted run
    "mask_gradient": (_importance, "mask_gradient", {}, 4),
    "attribution_patching": (_importance, "attribution_patching", {"check_heads": 2}, 8),
    "dla": (_importance, "dla", {}, 4),
    "l0": (_prune, "l0", {"lams": (0.1, 1.0, 3.0), "steps": 2}, 3),
    "mae": (_prune, "mae", {"rounds": 1, "gate_steps": 1, "model_steps": 1}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_units_read_back_give_the_same_result(tiny_models, monkeypatch, tmp_path, case):
    run, method, kw, n_units = CASES[case]
    model = tiny_models["llama"]
    whole = run(model, method, None, **kw)
    units = Units(tmp_path / "units")
    real, saved = Units.save, []

    def save(self, path, record):  # Ctrl-C once k units are stored
        if len(saved) == k:
            raise KeyboardInterrupt
        real(self, path, record)
        saved.append(path)

    k = random.Random(case).randrange(1, n_units)
    with monkeypatch.context() as m:
        m.setattr(Units, "save", save)
        with pytest.raises(KeyboardInterrupt):
            run(model, method, units, **kw)
    assert units.count() == k
    assert run(model, method, units, **kw) == whole
    assert units.replayed == k and units.count() == n_units


def test_exact_encoding_round_trips():
    import torch

    from headmech.core.head_index import HeadIndex

    value = {
        "t": torch.tensor([[0.1, float("nan")], [float("inf"), -0.0]]),
        "b": torch.tensor([1.5, 2.25], dtype=torch.bfloat16),
        "e": torch.zeros(0, 3, dtype=torch.float64),
        "heads": [HeadIndex(1, 2), (3, 4)],
        "keys": {1: "a", "__tensor__": 2},
        "x": [0.1 + 0.2, 1e-310, None, True, 3],
    }
    back = resume.decode(json.loads(json.dumps(resume.encode(value))))
    assert torch.equal(back["t"].nan_to_num(7.0), value["t"].nan_to_num(7.0))
    assert str(back["t"][1, 1].item()) == "-0.0"
    assert back["b"].dtype == torch.bfloat16 and torch.equal(back["b"], value["b"])
    assert back["e"].shape == (0, 3) and back["e"].dtype == torch.float64
    assert back["heads"] == value["heads"] and type(back["heads"][0]) is HeadIndex
    assert type(back["heads"][1]) is tuple and back["keys"] == value["keys"]
    assert back["x"] == value["x"]
    with pytest.raises(TypeError):
        resume.encode(object())


# --- make catalog (python -m headmech.publish) -----------------------------------------


@pytest.fixture
def tiny_publish(monkeypatch, tiny_models):
    """``publish_model("toy-induction", ...)`` on the tiny LLaMA at tiny sizes."""
    from headmech import publish

    small = publish.Size(
        n_sentences=8, n_sequences=2, context=(80,), n_random=1, n_boot=4,
        extra={"batch_size": 4, "half_len": 8},
    )  # fmt: skip
    monkeypatch.setitem(publish.FULL, "toy-induction", small)
    monkeypatch.setattr(publish, "CHECK", publish.Size(**{**small.__dict__, "validate": False}))
    monkeypatch.setattr(headmech.models, "load_model", lambda *a, **k: tiny_models["llama"])
    return publish


def _published(folder: Path) -> dict[str, bytes]:
    files = [folder / "catalog.json", folder / "check.json", *(folder / "heatmaps").glob("*.png")]
    return {p.name: p.read_bytes() for p in files}


@pytest.mark.end_to_end
def test_make_catalog_stopped_and_resumed_writes_the_same_bytes(
    tiny_publish, monkeypatch, tmp_path, capsys
):
    publish, real = tiny_publish, Units.save
    saved: list = []

    def save(self, path, record):  # counts the units stored; Ctrl-C once k are stored
        if len(saved) == k:
            raise KeyboardInterrupt
        real(self, path, record)
        saved.append(path)

    def run(out: str, *flags: str) -> int:
        return publish.main(["--models", "toy-induction", "--out", str(tmp_path / out), *flags])

    k = -1
    monkeypatch.setattr(Units, "save", save)
    assert run("a") == 0
    total, whole = len(saved), _published(tmp_path / "a" / "toy-induction")
    assert total >= 4 and not (tmp_path / "a" / "toy-induction" / STAGING).exists()

    saved.clear()
    k = random.Random("publish").randrange(1, total - 1)
    assert run("b") == 130
    assert "CATALOG_ARGS=--resume" in capsys.readouterr().err.strip().splitlines()[-1]
    folder = tmp_path / "b" / "toy-induction"
    assert not (folder / "catalog.json").exists()
    assert Units(folder / STAGING / "publish").count() > 0  # (inner units go with their outer)
    # a plain rerun would throw the finished units away: refused in one line, before loading
    with pytest.raises(SystemExit) as e:
        run("b")
    assert e.value.code == 2 and "holds an unfinished publish run" in capsys.readouterr().err

    saved.clear()
    k = -1
    assert run("b", "--resume") == 0
    assert len(saved) < total  # finished units were read back, not computed again
    assert _published(folder) == whole and not (folder / STAGING).exists()
    # --resume where nothing is unfinished starts afresh, not an error
    assert run("b", "--resume") == 0 and _published(folder) == whole
