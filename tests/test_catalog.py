"""classify() and catalog.json."""

from __future__ import annotations

import json

import pytest
import torch

import headmech
from headmech.classification.classify import HeadCatalog
from headmech.core.errors import CatalogFileError, UnknownHeadTypeError


def test_classify_round_trips_through_json(tiny_models, tmp_path):
    cat = headmech.classify(tiny_models["bert"], ["previous_token"], n_sentences=10, batch_size=4)
    path = cat.save(tmp_path)
    back = HeadCatalog.load(path)
    torch.testing.assert_close(
        back["previous_token"].score, cat["previous_token"].score, atol=1e-6, rtol=0
    )
    assert back["previous_token"].heads == cat["previous_token"].heads
    assert json.loads(path.read_text())["headmech_version"] == headmech.__version__


def test_threshold_is_overridable(tiny_models):
    T = headmech.get_head_type("previous_token")
    low = headmech.classify(tiny_models["gpt2"], [T(threshold=0.0)], n_sentences=8)
    assert len(low.heads("previous_token")) == 2 * 4  # every head passes a zero threshold
    high = headmech.classify(tiny_models["gpt2"], [T(threshold=1.0)], n_sentences=8)
    assert high.heads("previous_token") == []


def test_thresholds_per_type_are_applied_and_recorded(tiny_models):
    """``thresholds={type: value}``, the command line's ``--threshold type=value``: the
    type scored at it, an instance given keeps its own object (a copy gets the threshold),
    and the catalog's provenance records them only when given."""
    m, T = tiny_models["gpt2"], headmech.get_head_type("previous_token")
    low = headmech.classify(
        m, ["previous_token"], thresholds={"previous_token": 0.0}, n_sentences=8, progress=False
    )
    assert low["previous_token"].threshold == 0.0
    assert len(low.heads("previous_token")) == 2 * 4  # every head passes a zero threshold
    assert low.provenance["settings"]["thresholds"] == {"previous_token": 0.0}
    mine = T(threshold=0.0)
    high = headmech.classify(
        m, [mine], thresholds={"previous_token": 1.0}, n_sentences=8, progress=False
    )
    assert high.heads("previous_token") == [] and mine.threshold == 0.0
    plain = headmech.classify(m, ["previous_token"], n_sentences=8, progress=False)
    assert "thresholds" not in plain.provenance["settings"]


def test_classify_shows_progress_unless_told_not_to(tiny_models, capfd):
    import inspect

    from headmech.attribution import importance
    from headmech.discover import discover
    from headmech.pruning import prune

    m = tiny_models["gpt2"]
    headmech.classify(m, ["previous_token"], n_sentences=8, n_boot=0)
    assert "prose (previous_token)" in capfd.readouterr().err  # the bar, on stderr
    headmech.classify(m, ["previous_token"], n_sentences=8, n_boot=0, progress=False)
    assert capfd.readouterr().err == ""
    for f in (headmech.classify, importance, prune, discover):  # the minute-long entry points
        assert inspect.signature(f).parameters["progress"].default is True, f.__name__


def test_python_names_suggest_a_close_name_as_the_command_line_does():
    from headmech.cli import main

    with pytest.raises(UnknownHeadTypeError, match=r"\(did you mean 'induction'\?\)$"):
        headmech.get_head_type("inducton")
    with pytest.raises(UnknownHeadTypeError, match=r"\(did you mean 'induction'\?\)$"):
        headmech.classify(None, ["inducton"])  # before the model is read
    with pytest.raises(headmech.HeadmechError) as e:
        headmech.load_model("smollm")
    assert str(e.value).startswith("unknown model 'smollm' (did you mean 'smollm2-135m'?): ")
    assert main(["classify", "smollm"]) == 2  # the command line says the same


def test_a_head_type_class_without_a_name_is_named_with_its_file():
    from headmech.core.errors import PluginError
    from headmech.headtypes.registry import HeadType, register

    class ContributedHead(HeadType):
        description = "a contributed type that forgot its name"

    needle = (
        "head type class test_a_head_type_class_without_a_name_is_named_with_its_file.<locals>"
        '.ContributedHead has no `name`: add the class attribute name = "contributed"'
    )
    for call in (
        lambda: register(ContributedHead),
        lambda: headmech.classify(None, [ContributedHead]),
        lambda: headmech.classify(None, [ContributedHead()]),
    ):
        with pytest.raises(PluginError) as e:
            call()
        assert str(e.value).startswith(needle) and "\n" not in str(e.value)
        assert str(e.value).endswith("tests/test_catalog.py")

    class Inherits(headmech.get_head_type("induction")):
        pass

    with pytest.raises(PluginError, match="Inherits defines no `name` of its own"):
        register(Inherits)


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("previous_token", -0.2),
        ("previous_token", 1.01),
        ("syntactic", -1.5),
        ("function_vector", 2.0),
    ],
)
def test_a_threshold_outside_the_score_range_is_a_one_line_error(name, bad):
    from headmech.core.errors import ArgumentError

    T = headmech.get_head_type(name)
    with pytest.raises(ArgumentError, match=rf"threshold of head type '{name}' must lie in") as e:
        T(threshold=bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"model": {"name": "m"}}),
        json.dumps(
            {
                "model": {"name": "m", "n_layers": 1, "n_heads": 2},
                "types": {"x": {"threshold": 0.5, "score": [[0.1]], "heads": []}},
            }
        ),
    ],
    ids=["syntax", "missing-keys", "bad-shape"],
)
def test_corrupt_catalog_file(tmp_path, content):
    p = tmp_path / "catalog.json"
    p.write_text(content)
    with pytest.raises(CatalogFileError) as e:
        HeadCatalog.load(p)
    assert "\n" not in str(e.value)


def test_unknown_type():
    with pytest.raises(UnknownHeadTypeError, match="previous_token"):
        headmech.get_head_type("nope")


def test_duplicate_registration_is_refused():
    """Registration is explicit: defining a class registers nothing; registering a second
    class under a taken name is refused and leaves the first in place."""
    from headmech.core.registry import HEAD_TYPES
    from headmech.headtypes.registry import HeadType, register

    class Again(HeadType):
        name = "previous_token"

    class Fresh(HeadType):
        name = "fresh_test_type"
        description = "a test"

    assert "fresh_test_type" not in headmech.head_types()
    with pytest.raises(ValueError, match="already registered"):
        register(Again)
    assert headmech.get_head_type("previous_token") is not Again
    with HEAD_TYPES.isolated():
        register(Fresh)
        assert headmech.get_head_type("fresh_test_type") is Fresh
    assert "fresh_test_type" not in headmech.head_types()


@pytest.mark.slow
def test_minilm_previous_token_heads(minilm):
    """MiniLM has a head that attends almost only to the previous token (BERT-like)."""
    cat = headmech.classify(minilm, ["previous_token"], n_sentences=64)
    heads = cat.heads("previous_token")
    assert heads, cat.table()
    best = heads[0]
    assert float(cat["previous_token"].score[best]) > 0.9
    assert cat["previous_token"].details["argmax_hit_rate"][str(best)] > 0.9
    # most heads are not previous-token heads
    assert len(heads) < 0.2 * 6 * 12


def test_engine_matches_transformerlens_detector(tiny_models):
    """On TL's own definition (every row, BOS included), the streamed `rows` statistic
    equals TL's detect_head "mul" score; our previous_token type differs only by
    excluding special tokens as targets."""
    from transformer_lens.head_detector import detect_head

    from headmech.probes import batch_sequences
    from headmech.stream.engine import stream_statistics, target_reducer

    model = tiny_models["gpt2"]
    text = "The cat sat on the mat because the mat was warm."
    ids = model.to_tokens(text)[0].tolist()
    want = detect_head(model, text, "previous_token_head")
    (batch,) = batch_sequences([ids], model.tokenizer, 1)

    def tl_targets(b):
        return (torch.arange(b.input_ids.shape[1]) - 1).expand_as(b.input_ids)

    stats = stream_statistics(model, [batch], [target_reducer("tl", tl_targets)])
    torch.testing.assert_close(stats.mean("tl.rows"), want.float(), atol=1e-5, rtol=1e-4)
    ours = stream_statistics(model, [batch], headmech.get_head_type("previous_token")().reducers())
    # excluding the BOS target removes exactly A[1, 0] from each head's numerator
    _, cache = model.run_with_cache(torch.tensor([ids]))
    for layer in range(2):
        a10 = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, 1, 0]
        torch.testing.assert_close(
            ours.mean("previous_token.rows")[layer],
            want[layer].float() - a10 / len(ids),
            atol=1e-5,
            rtol=1e-4,
        )


HEAD_TYPE_FILE = '''import torch
from headmech.headtypes.registry import HeadType


class {cls}(HeadType):
    """Attends to position 0.

    References:
        Nobody 2025.
    """

    name = "{name}"
    reference = "Nobody 2025"
    citation = "Nobody 2025, a test"
    description = "attends to the first token"

    def targets(self, batch):
        return torch.zeros_like(batch.input_ids).masked_fill(batch.special, -1)
'''


def test_entry_point_head_types_are_discovered(tmp_path, monkeypatch):
    """A third-party package registers a type through the `headmech.head_types` group."""
    from importlib.metadata import EntryPoint

    from headmech.core import registry

    text = HEAD_TYPE_FILE.format(cls="FirstTokenHead", name="first_token_test")
    (tmp_path / "thirdparty_heads.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    group = registry.HEAD_TYPES.group
    assert group == "headmech.head_types"
    registry.HEAD_TYPES.load()
    ep = EntryPoint("first_token_test", "thirdparty_heads:FirstTokenHead", group)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == ep.group else [])
    with registry.HEAD_TYPES.isolated():
        registry.HEAD_TYPES.reload()
        types = headmech.head_types()
        assert "first_token_test" in types and "previous_token" in types
        from headmech.testing import check_head_type

        check_head_type(types["first_token_test"])  # a contributed type passes the harness
    assert "first_token_test" not in headmech.head_types()


@pytest.mark.parametrize("kind", ["tasks", "methods", "pruning_methods", "models", "probes"])
def test_every_extension_point_takes_plugins(tmp_path, monkeypatch, kind):
    """Each registry loads its entry-point group, so a plug-in package can add a task, a
    method, a pruning method, a model or a probe, not only a head type; a plug-in that
    fails to import is a one-line error naming it."""
    from importlib.metadata import EntryPoint

    from headmech.core import registry

    reg = {
        "tasks": registry.TASKS,
        "methods": registry.METHODS,
        "pruning_methods": registry.PRUNING_METHODS,
        "models": registry.MODELS,
        "probes": registry.PROBES,
    }[kind]
    assert reg.group == f"headmech.{kind}"
    reg.load()  # the built-ins, before the fake entry points below
    (tmp_path / f"plugin_{kind}.py").write_text('def thing(*args):\n    """A plug-in."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint("plugged", f"plugin_{kind}:thing", reg.group)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == reg.group else [])
    with reg.isolated():
        reg.reload()
        assert "plugged" in reg.names() and reg.get("plugged").__doc__ == "A plug-in."
        assert "plugged: A plug-in" in reg.help()
    assert "plugged" not in reg
    broken = EntryPoint("broken", "no_such_module_xyz:thing", reg.group)
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [broken] if group == reg.group else []
    )
    with reg.isolated(), pytest.raises(headmech.HeadmechError, match="broken.*fails to load"):
        reg.reload()
        reg.names()


def test_catalog_path_folders_are_discovered(tmp_path, monkeypatch):
    """A type in a $HEADMECH_CATALOG_PATH folder is found by discovery and the CLI; a
    broken file there is a one-line error."""
    from headmech.cli import main
    from headmech.core.registry import HEAD_TYPES
    from headmech.headtypes import registry as heads

    text = HEAD_TYPE_FILE.format(cls="FirstTokenPathHead", name="first_token_path")
    (tmp_path / "first_token_path.py").write_text(text)
    with HEAD_TYPES.isolated():  # the state kept to restore is loaded before the folder is set
        monkeypatch.setenv(heads.CATALOG_PATH_ENV, str(tmp_path))
        HEAD_TYPES.reload()
        assert "first_token_path" in headmech.head_types()
        # loading again is idempotent: the same definition, registered again
        assert heads.load_catalog_folder(tmp_path) == ["first_token_path"]
        assert len([n for n in headmech.head_types() if n == "first_token_path"]) == 1
        HEAD_TYPES.reload()
        assert main(["types"]) == 0
        (tmp_path / "broken.py").write_text("def broken(:\n")
        HEAD_TYPES.reload()
        with pytest.raises(headmech.HeadmechError, match="broken.py: SyntaxError"):
            headmech.head_types()
        HEAD_TYPES.reload()
        assert main(["types"]) == 2
    monkeypatch.delenv(heads.CATALOG_PATH_ENV)
    HEAD_TYPES.reload()
    assert "first_token_path" not in headmech.head_types()
