"""The package's layers: a module imports only its own layer and the ones below, and no
import closes a cycle.

The layers are those of the import-linter contract in pyproject.toml (``make lint`` runs
``lint-imports``), read from there so that there is one list. This test checks every
``import`` statement of every module with :mod:`ast`: at module level, inside functions
(the imports that run late, where a cycle hides best) and under ``if TYPE_CHECKING:``
(as import-linter counts them too), and it refuses what the contract allows: a cycle
among the modules of one layer (``a : b``).
"""

from __future__ import annotations

import ast
from itertools import islice
from pathlib import Path

import networkx as nx
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "headmech"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The headmech module an imported name lives in (a module, or a name in one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Every headmech module ``module`` imports, wherever the statement is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.startswith("headmech")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            if base.split(".")[0] == "headmech":  # a submodule by name, or a name in base
                found |= {_resolve(f"{base}.{a.name}") for a in node.names}
    return {m for m in found if m is not None and m != module}


GRAPH = nx.DiGraph()
GRAPH.add_nodes_from(MODULES)
GRAPH.add_edges_from((m, t) for m, p in MODULES.items() for t in _imports(m, p))


def _layers() -> list[tuple[list[str], bool]]:
    """The contract's layers, top first: ``(modules, independent)``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert contract["containers"] == ["headmech"]
    out = []
    for layer in contract["layers"]:
        sep = ":" if ":" in layer else "|"
        out.append(([f"headmech.{m.strip()}" for m in layer.split(sep)], sep == "|"))
    return out


LAYERS = _layers()


def _layer_of(module: str) -> tuple[int, str]:
    """``(index of the layer, top first; the layer's entry)`` that holds ``module``."""
    for i, (entries, _) in enumerate(LAYERS):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                return i, entry
    raise AssertionError(f"{module} is in no layer of pyproject.toml's import-linter contract")


def test_no_import_cycles() -> None:
    """No chain of imports, however late they run, comes back to where it started."""
    if not nx.is_directed_acyclic_graph(GRAPH):
        cycles = sorted(islice(nx.simple_cycles(GRAPH), 200), key=len)[:5]
        pytest.fail("import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles))


def test_every_module_has_a_layer() -> None:
    """The contract is exhaustive: a new module is placed in a layer (pyproject.toml)."""
    for module in MODULES:
        if module != "headmech":  # the package itself: the public names, from every layer
            _layer_of(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "headmech"))
def test_imports_go_down(module: str) -> None:
    """Each import stays in the module's layer or goes to a lower one; in a layer of
    independent modules (``a | b``) it stays inside its own entry."""
    here, entry = _layer_of(module)
    for target in sorted(GRAPH.successors(module)):
        assert target != "headmech", f"{module} imports the package itself (all of it)"
        there, other = _layer_of(target)
        assert there >= here, (
            f"{module} (layer {here} from the top) imports {target} of the higher layer {there}"
        )
        if there == here and LAYERS[here][1]:
            assert other == entry, f"{module} imports {target}, independent in its layer"


@pytest.mark.parametrize(
    ("low", "high"),
    [
        ("headmech.registry", "headmech.heads"),  # the head-type registry's loader
        ("headmech.checks", "headmech.models"),  # model names, catalogs: commands_base
        ("headmech.checks", "headmech.classify"),
        ("headmech.distributed", "headmech.resume"),  # a rank's per-batch units
        ("headmech.distributed", "headmech.engine"),  # merging HeadStats
        ("headmech.tasks", "headmech.task_data"),  # the encoder task's corruption
        ("headmech.bundled", "headmech.models"),  # the model folders on disk
        ("headmech.plot", "headmech.results"),  # a figure of a catalog
    ],
)
def test_the_old_cycles_stay_broken(low: str, high: str) -> None:
    """The imports that closed the package's largest cycle (through 14 modules, before the
    layers were written down) do not come back, directly or through other modules."""
    assert not nx.has_path(GRAPH, low, high), f"{low} reaches {high} again"
