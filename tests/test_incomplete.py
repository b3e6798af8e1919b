"""A run that stops after finished work keeps it: classify's finished types survive an error
or Ctrl-C in a later step (the API raises :class:`IncompleteRunError` carrying them, the
command writes them to ``catalog.partial.json`` and fails in one line), and what can fail
cheaply (the weights hash) fails before any forward pass."""

from __future__ import annotations

import importlib
import json
import shlex

import pytest

import headmech
from headmech.cli import main
from headmech.core.errors import IncompleteRunError

classify_module = importlib.import_module(
    "headmech.classification.runner"
)  # the module, not the function
validation_module = importlib.import_module(
    "headmech.classification.validation"
)  # validate_types calls its type_validation

TYPES = ["previous_token", "attention_sink", "positional"]
SIZES = {"n_sentences": 8, "batch_size": 4}


def _fail_on(name, error):
    """A ``type_validation`` that raises ``error`` for type ``name``, else validates."""
    real = validation_module.type_validation

    def validation(model, t, heads, options, n_random, *rest, **kw):
        if t.name == name:
            raise error
        return real(model, t, heads, options, n_random, *rest, **kw)

    return validation


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return headmech.load_model(str(tiny_dirs["llama"]))


def test_an_error_in_a_later_step_keeps_the_finished_types(llama, monkeypatch):
    monkeypatch.setattr(
        validation_module, "type_validation", _fail_on("positional", RuntimeError("boom"))
    )
    with pytest.raises(IncompleteRunError) as e:
        headmech.classify(llama, TYPES, validate=True, n_random=1, **SIZES)
    partial = e.value.partial
    # validated before the failure: kept, with their validation; the failed type is not
    assert sorted(partial.types) == ["attention_sink", "previous_token"]
    assert all(r.validation is not None for r in partial.types.values())
    assert partial.meta["incomplete"] == "boom"
    assert str(e.value) == "stopped after 2 of 3 type(s) (boom)"
    # the finished part equals the same types of an uninterrupted run
    monkeypatch.undo()
    whole = headmech.classify(llama, TYPES, validate=True, n_random=1, **SIZES)
    for name, r in partial.types.items():
        assert r.heads == whole[name].heads
        assert r.score.tolist() == whole[name].score.tolist()
        assert r.validation.primary.effect == whole[name].validation.primary.effect


def test_nothing_finished_is_the_plain_error(llama, monkeypatch):
    monkeypatch.setattr(
        validation_module, "type_validation", _fail_on("previous_token", RuntimeError("early"))
    )
    with pytest.raises(RuntimeError, match="early"):
        headmech.classify(llama, TYPES, validate=True, n_random=1, **SIZES)


def test_weights_hash_fails_before_any_forward(llama, monkeypatch):
    import headmech.runs.provenance as prov

    calls = []
    monkeypatch.setattr(
        classify_module,
        "_stream",
        lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(AssertionError),
    )

    def broken(model):
        raise RuntimeError("cannot hash")

    monkeypatch.setattr(prov, "weights_hash", broken)
    with pytest.raises(RuntimeError, match="cannot hash"):
        headmech.classify(llama, TYPES, **SIZES)
    assert calls == []


@pytest.mark.parametrize(
    ("error", "code", "why"),
    [(RuntimeError("disk on fire"), 1, "disk on fire"), (KeyboardInterrupt(), 130, "interrupted")],
)
def test_command_writes_the_finished_part(
    capsys, tiny_dirs, tmp_path, monkeypatch, error, code, why
):
    monkeypatch.setattr(validation_module, "type_validation", _fail_on("positional", error))
    out = tmp_path / "out"
    argv = ["classify", str(tiny_dirs["llama"]), "--types", ",".join(TYPES), "--validate"]
    argv += ["--n-random", "1", "--n-sentences", "8", "--batch-size", "4"]
    assert main([*argv, "--out", str(out)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"headmech: error: stopped after 2 of 3 type(s) ({why}); the finished part is in "
        f"{out / 'catalog.partial.json'}; "
    )
    # and how to continue: the finished units are kept (tests/test_resume.py)
    assert err[-1].endswith(f"; continue with: headmech {shlex.join(argv)} --out {out} --resume")
    data = json.loads((out / "catalog.partial.json").read_text())
    assert sorted(data["types"]) == ["attention_sink", "previous_token"]
    assert data["incomplete"] == why
    assert not (out / "catalog.json").exists()  # a partial run never poses as a whole one
