"""The command line answers before importing torch: the committed registry index.

``headmech --help``, ``types``, ``models`` and a mistyped name are answered from
:mod:`headmech.core.registry_index` (names, summaries, what ``types`` prints), so they
take a fraction of a second instead of the seconds torch and transformers take to import
(benchmarks/bench_cli.py times them). Here: the index is what the loaded registries hold,
those commands do not import torch, and where something besides the built-ins can be in a
registry (an entry point, a ``$HEADMECH_CATALOG_PATH`` folder, an explicit registration)
the index is not trusted alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from headmech.core import registry
from headmech.core.registry_index import INDEX


def test_the_committed_index_is_the_loaded_registries():
    """Regenerate with ``make index``."""
    from headmech.core.index import build_index

    assert build_index() == INDEX


PROBE = """
import sys
from headmech.cli import main
code = main({argv!r})
heavy = sorted(m for m in ("torch", "transformers", "transformer_lens", "matplotlib") if m in sys.modules)
print("HEAVY=" + ",".join(heavy) + f" CODE={{code}}")
"""


@pytest.mark.parametrize(
    ("argv", "code", "said"),
    [
        (["types"], 0, "induction"),
        (["models"], 0, "smollm2-135m"),
        (["classify", "smollm2-13m"], 2, "did you mean 'smollm2-135m'"),
        (["classify", "smollm2-135m", "--types", "inductoin"], 2, "did you mean 'induction'"),
        (["importance", "smollm2-135m", "--method", "nope"], 2, "unknown method 'nope'"),
        (["prune", "nomodel", "--method", "michel"], 2, "unknown model 'nomodel'"),
    ],
)
def test_listing_and_mistyped_names_import_no_torch(argv, code, said):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=120
    )
    last = out.stdout.strip().splitlines()[-1]
    assert last == f"HEAVY= CODE={code}", (last, out.stderr[-500:])
    assert said in out.stdout + out.stderr


def test_help_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=["--help"]).replace("code = main", "code = 0\ntry:\n    main")
         .replace("])\nheavy", "])\nexcept SystemExit:\n    pass\nheavy")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "HEAVY= CODE=0" in out.stdout, out.stderr[-500:]
    assert "classify" in out.stdout


def test_the_index_gives_way_to_anything_besides_the_built_ins(monkeypatch, tmp_path):
    """A registry with an explicit registration lists it beside the index's entries; with
    $HEADMECH_CATALOG_PATH set the head types are loaded, not read from the index; a name
    the index does not know is an error that lists the known names, without loading."""
    r = registry.Registry("methods", builtins=("headmech.attribution",))
    r.register("my_method", lambda *a: None, summary="a test")
    assert "my_method" in r.names() and set(INDEX["methods"]) < set(r.names())
    assert r.metadata()["my_method"] == {"summary": "a test"}
    assert not r._loaded  # still from the index
    with pytest.raises(Exception, match="unknown method 'zer'.*my_method.*did you mean 'zero'"):
        r.entry("zer")
    assert not r._loaded
    r.get("my_method")
    assert r._loaded
    types = registry.Registry(
        "head_types", builtins=(), extra_env="HEADMECH_CATALOG_PATH", describe=lambda c: {}
    )
    assert types._indexed() is not None
    monkeypatch.setenv("HEADMECH_CATALOG_PATH", str(tmp_path))
    assert types._indexed() is None


def test_types_prints_the_same_from_the_index_and_the_classes(capsys):
    """``headmech types`` from the index equals its output from the loaded classes."""
    from headmech.cli import main

    assert main(["types", "--verbose"]) == 0
    from_index = capsys.readouterr().out
    registry.HEAD_TYPES.load()
    assert registry.HEAD_TYPES._indexed() is None
    assert main(["types", "--verbose"]) == 0
    assert capsys.readouterr().out == from_index
    assert json.dumps(INDEX["head_types"]["induction"]["threshold"]) == "0.4"


def test_entries_load_what_the_index_only_names():
    """In a fresh process the names come from the index and the entries, which carry the
    objects, from the loaded registry: the same names either way."""
    code = (
        "from headmech.core.registry import HEAD_TYPES, METHODS\n"
        "names = HEAD_TYPES.names(), METHODS.names()\n"
        "assert not HEAD_TYPES._loaded\n"
        "got = [e.name for e in HEAD_TYPES.entries()], [e.name for e in METHODS.entries()]\n"
        "assert names == got, (names, got)\n"
        "from headmech.headtypes.registry import resolve_types\n"
        "print(len(resolve_types(None)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip() == str(len(INDEX["head_types"]))


def test_the_plugin_scan_runs_once_a_group(monkeypatch):
    """A command asks the registries several times; the installed entry points of a group
    are scanned once (a fake finder gets its own scan)."""
    from headmech.core import registry

    calls = []

    def finder(group):
        calls.append(group)
        return []

    monkeypatch.setattr(registry, "entry_points", finder)
    for _ in range(3):
        assert registry._has_plugins("headmech.test_group", registry.entry_points) is False
    assert calls == ["headmech.test_group"]
