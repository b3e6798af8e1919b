"""Contributing a head type by docs/contributing-head-types.md works end to end.

The guide's own Python blocks are the contribution: the block headed
``# headmech/headtypes/<name>.py`` is the type's file, the block headed
``# tests/test_conformance.py`` its hand-written definition, and every other Python block
is run as a reader would run it. The type goes into a ``$HEADMECH_CATALOG_PATH`` folder
(where the guide says to develop it), and everything a pull request adding it must pass
is run on it: the conformance harness with its positive and negative controls, classify
on a tiny model, ``headmech types``, and, in a subprocess with the type present, the
type's tests of ``tests/test_conformance.py`` (with the hand definition added as the guide
says) and the every-type checks of ``tests/test_labels.py``. A type without its hand
definition fails with a message naming the type, its file and the dict to edit.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import headmech
from headmech.core.registry import HEAD_TYPES
from headmech.headtypes import registry as heads
from headmech.headtypes.registry import HeadType, types_in
from headmech.probes import build_probe
from headmech.stream.engine import ProbeBatch
from headmech.testing import CONTROL_OPTIONS, check_head_type, tiny_model
from headmech.testing.planting import ideal_pattern

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "contributing-head-types.md"
TYPE_FILE = re.compile(r"# headmech/headtypes/(\w+)\.py\n")
HAND_BLOCK = "# tests/test_conformance.py"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def _type_block() -> tuple[str, str]:
    """The guide's head-type file: (its module name, its code)."""
    found = [(m.group(1), b) for b in _python_blocks() if (m := TYPE_FILE.match(b))]
    assert len(found) == 1, "the guide should show exactly one head-type file"
    return found[0]


def _hand_block() -> str:
    found = [b for b in _python_blocks() if b.startswith(HAND_BLOCK)]
    assert len(found) == 1, f"the guide should show one block headed {HAND_BLOCK!r}"
    return found[0]


def _other_blocks() -> list[str]:
    return [b for b in _python_blocks() if not TYPE_FILE.match(b) and not b.startswith(HAND_BLOCK)]


@pytest.fixture(scope="module")
def contribution(tmp_path_factory) -> dict:
    """The guide's type written into a catalog-path folder, and its class (imported from
    that file, not registered)."""
    stem, code = _type_block()
    folder = tmp_path_factory.mktemp("catalog_path")
    path = folder / f"{stem}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(f"guide_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (cls,) = types_in(module)
    return {"folder": folder, "path": path, "stem": stem, "cls": cls, "name": cls.name}


@pytest.fixture
def registered(contribution, monkeypatch):
    """The type registered from its folder, as ``$HEADMECH_CATALOG_PATH`` registers it;
    the registry is restored afterwards."""
    # isolated() first loads the registry and keeps that state to restore: the folder is
    # set inside it, or an unloaded registry would load the type into the kept state (and
    # every later test of the process would see it)
    with HEAD_TYPES.isolated():
        monkeypatch.setenv(heads.CATALOG_PATH_ENV, str(contribution["folder"]))
        HEAD_TYPES.reload()
        yield contribution
        monkeypatch.delenv(heads.CATALOG_PATH_ENV)
    sys.modules.pop(f"headmech_local_catalog.{contribution['stem']}", None)


def _load_test_module(path: Path, name: str) -> ModuleType:
    """A test module of this suite loaded afresh (its parametrisation sees the registry
    as it is now)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_is_a_new_type(contribution):
    """The guide's example is not a shipped type (nor a copy of one under another name),
    its file is named after it, and it picks targets by what the tokens are."""
    cls = contribution["cls"]
    assert contribution["stem"] == cls.name
    shipped = headmech.head_types()
    assert cls.name not in shipped
    assert cls.__name__ not in {c.__name__ for c in shipped.values()}
    model = tiny_model("encoder")
    batch = build_probe(cls.probe, model, CONTROL_OPTIONS).batches[0]
    mine = ideal_pattern(cls(), batch)
    for name, other in shipped.items():
        if other.probe == cls.probe and not other.causal_only:
            try:
                theirs = ideal_pattern(other(), batch)
            except Exception:  # a type scored otherwise, or needing other extras
                continue
            assert not torch.equal(mine, theirs), f"the example duplicates {name}"
    assert "token_strings" in _type_block()[1]


def test_the_guide_blocks_run_and_pass_the_harness(contribution):
    """The type passes every conformance check (its positive and negative controls) on
    the encoder and the decoder control models; the page's other blocks run as written."""
    cls = contribution["cls"]
    check_head_type(cls, tiny_model("causal"))  # the guide's block below: the encoder
    namespace: dict = {"__name__": "guide", cls.__name__: cls}
    blocks = _other_blocks()
    assert blocks, "the guide's check block is missing"
    for i, code in enumerate(blocks):
        exec(compile(code, f"{GUIDE.name} block {i}", "exec"), namespace)
    assert "check_head_type(" in "".join(blocks), "the guide's check block is gone"


def test_the_type_is_listed_and_classifies_a_tiny_model(registered, capsys):
    """From its $HEADMECH_CATALOG_PATH folder the type is registered, ``headmech types``
    lists it, and classify (by name, as ``--types`` does) scores every head of a tiny
    model and labels none of a random one."""
    from headmech.cli import main

    name, cls = registered["name"], registered["cls"]
    assert name in headmech.head_types()
    assert main(["types"]) == 0
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if x.split() and x.split()[0] == name), None)
    assert line is not None and cls.description in line, out
    for kind in ("encoder", "causal"):
        model = tiny_model(kind)
        cat = headmech.classify(model, [name], progress=False, n_boot=0, **vars(CONTROL_OPTIONS))
        score = cat[name].score
        assert tuple(score.shape) == (2, 4) and torch.isfinite(score).all()
        assert cat.heads(name) == [], (kind, score)


def _with_hand_definition(source: str, name: str) -> str:
    """``tests/test_conformance.py`` as the guide says to edit it: the hand-written
    function beside the others, its entry in ``HAND``."""
    block = _hand_block()
    (function,) = re.findall(r"^def (\w+)\(", block, re.M)
    assert f'"{name}": {function},' in GUIDE.read_text(), "the guide names the HAND entry"
    start = source.index("HAND: dict[")
    end = source.index("\n}\n", start)
    return (
        source[:start]
        + block
        + "\n\n"
        + source[start:end]
        + f'\n    "{name}": {function},'
        + source[end:]
    )


@pytest.mark.end_to_end  # a fresh process: make test runs it, make test-fast leaves it
def test_the_pull_request_tests_pass_with_the_type(contribution, tmp_path):
    """With the type present and the hand definition added, the type's tests of
    tests/test_conformance.py (harness, hand definition, planted head) and the every-type
    tests pass in pytest, run as CI runs them."""
    name = contribution["name"]
    tests = tmp_path / "tests"
    tests.mkdir()
    source = (ROOT / "tests" / "test_conformance.py").read_text()
    (tests / "test_conformance.py").write_text(_with_hand_definition(source, name))
    (tests / "test_labels.py").write_text((ROOT / "tests" / "test_labels.py").read_text())
    env = {**os.environ, heads.CATALOG_PATH_ENV: str(contribution["folder"])}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    files = ["tests/test_conformance.py", "tests/test_labels.py"]
    args = ["-v", "-n", "0", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), *files]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-k", f"{name} or every_type"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    # 7 harness checks, 2 hand-definition tests, 1 every-type test of each file
    assert passed >= 11 and "failed" not in out, out[-2000:]
    for test in ("test_ideal_pattern_equals_the_hand_written_definition",
                 "test_head_planted_by_hand_is_found_first",
                 "test_head_type_conformance"):  # fmt: skip
        assert re.search(rf"::{test}\[{name}[\]-].* PASSED", out), (test, out[-2000:])


def test_a_type_without_its_hand_definition_fails_naming_it(registered):
    """Before its HAND entry, the new type fails test_every_type_has_a_hand_definition and
    its own hand tests with one message naming the type, its file, and the dict and file
    to edit; nothing else in tests/test_conformance.py asks for it (ATTENTION_SCORED is
    derived)."""
    name = registered["name"]
    conformance = _load_test_module(ROOT / "tests" / "test_conformance.py", "conformance_now")
    assert name in conformance.TYPES and name in conformance.ATTENTION_SCORED
    expected = [f"head type '{name}'", str(registered["path"]), "HAND",
                "tests/test_conformance.py", f'"{name}": _{name}']  # fmt: skip
    with pytest.raises(AssertionError) as every:
        conformance.test_every_type_has_a_hand_definition()
    for text in expected:
        assert text in str(every.value), (text, str(every.value))
    for test in (conformance.test_ideal_pattern_equals_the_hand_written_definition,
                 conformance.test_head_planted_by_hand_is_found_first):  # fmt: skip
        with pytest.raises(pytest.fail.Exception) as failed:
            test(name)
        assert all(text in str(failed.value) for text in expected), str(failed.value)


def test_token_strings_spell_each_position():
    """Probe batches carry the tokenizer's strings (for types about kinds of tokens); a
    batch built by hand has none unless given the tokenizer; a batch with other ids
    spells its own; head() and to() keep them."""
    from dataclasses import replace

    model = tiny_model("encoder")
    tok = model.tokenizer
    batch = build_probe("prose", model, CONTROL_OPTIONS).batches[0]
    strings = batch.token_strings
    assert strings is not None and len(strings) == batch.input_ids.shape[0]
    for row, ids in zip(strings, batch.input_ids.tolist(), strict=True):
        assert row == tok.convert_ids_to_tokens(ids)
    assert strings[0][0] == "[CLS]" and batch.token_strings is strings  # spelled once
    assert batch.head(1).token_strings == strings[:1]
    assert batch.to("cpu").token_strings == strings
    other = replace(batch, input_ids=batch.input_ids.flip(1))
    assert other.token_strings[0] == list(reversed(strings[0]))
    ids = torch.tensor([tok("Yes, it is.")["input_ids"]])
    by_hand = ProbeBatch(ids, torch.ones_like(ids), torch.zeros_like(ids, dtype=torch.bool))
    assert by_hand.token_strings is None
    spelled = ProbeBatch(ids, torch.ones_like(ids), ids == tok.cls_token_id, tokenizer=tok)
    assert spelled.token_strings == [["[CLS]", "yes", ",", "it", "is", ".", "[SEP]"]]
    assert "tokenizer" not in repr(spelled)


def test_a_type_can_pick_targets_by_token(contribution):
    """The guide's type, on a batch built by hand: the tokens after a period or comma
    attend to it; without the tokenizer the type says what it needs."""
    cls: type[HeadType] = contribution["cls"]
    tok = tiny_model("encoder").tokenizer
    ids = torch.tensor([tok("One, two. Three")["input_ids"]])  # [CLS] one , two . three [SEP]
    special = torch.isin(ids, torch.tensor(tok.all_special_ids))
    batch = ProbeBatch(ids, torch.ones_like(ids), special, tokenizer=tok)
    t = cls().targets(batch)[0]
    assert t.nonzero().tolist() == [[3, 2], [4, 2], [5, 2], [5, 4]]
    with pytest.raises(ValueError, match="tokenizer"):
        cls().targets(ProbeBatch(ids, torch.ones_like(ids), special))
