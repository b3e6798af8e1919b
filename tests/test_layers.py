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


def _contracts() -> list[tuple[str, list[tuple[list[str], bool]], bool]]:
    """The contracts, the package's first: ``(container, layers top first, exhaustive)``,
    each layer ``(modules, independent)``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    out = []
    for contract in config["tool"]["importlinter"]["contracts"]:
        assert contract["type"] == "layers"
        (container,) = contract["containers"]
        layers = []
        for layer in contract["layers"]:
            sep = ":" if ":" in layer else "|"
            layers.append(([f"{container}.{m.strip()}" for m in layer.split(sep)], sep == "|"))
        out.append((container, layers, contract.get("exhaustive", False)))
    assert out[0][0] == "headmech" and out[0][2], "the first contract: the whole package"
    return out


CONTRACTS = _contracts()
LAYERS = CONTRACTS[0][1]


def _layer_of(module: str, layers: list[tuple[list[str], bool]] = LAYERS) -> tuple[int, str]:
    """``(index of the layer, top first; the layer's entry)`` that holds ``module``."""
    for i, (entries, _) in enumerate(layers):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                return i, entry
    raise AssertionError(f"{module} is in no layer of pyproject.toml's import-linter contract")


def _inside(module: str, container: str) -> bool:
    return module.startswith(container + ".")


def test_no_import_cycles() -> None:
    """No chain of imports, however late they run, comes back to where it started."""
    if not nx.is_directed_acyclic_graph(GRAPH):
        cycles = sorted(islice(nx.simple_cycles(GRAPH), 200), key=len)[:5]
        pytest.fail("import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles))


def test_every_module_has_a_layer() -> None:
    """The exhaustive contracts (the package's, and a package's own where it says so) place
    every module: a new module goes into a layer (pyproject.toml)."""
    for container, layers, exhaustive in CONTRACTS:
        for module in MODULES:
            if exhaustive and _inside(module, container):
                _layer_of(module, layers)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "headmech"))
def test_imports_go_down(module: str) -> None:
    """Each import stays in the module's layer or goes to a lower one; in a layer of
    independent modules (``a | b``) it stays inside its own entry. The package's contract
    and each package's own (between the modules of one package) are checked alike."""
    for target in sorted(GRAPH.successors(module)):
        assert target != "headmech", f"{module} imports the package itself (all of it)"
    for container, layers, exhaustive in CONTRACTS:
        if not _inside(module, container):
            continue
        if not exhaustive and not any(
            module == e or _inside(module, e) for entries, _ in layers for e in entries
        ):
            continue
        here, entry = _layer_of(module, layers)
        for target in sorted(GRAPH.successors(module)):
            if not _inside(target, container):
                continue
            if not exhaustive and not any(
                target == e or _inside(target, e) for entries, _ in layers for e in entries
            ):
                continue
            there, other = _layer_of(target, layers)
            assert there >= here, (
                f"{module} (layer {here} of {container}) imports {target} of the higher layer"
                f" {there}"
            )
            if there == here and layers[here][1]:
                assert other == entry, f"{module} imports {target}, independent in its layer"


@pytest.mark.parametrize(
    ("low", "high"),
    [
        (
            "headmech.core.registry",
            "headmech.headtypes.registry",
        ),  # the head-type registry's loader
        ("headmech.core.checks", "headmech.models"),  # model names, catalogs: commands_base
        ("headmech.core.checks", "headmech.classification.classify"),
        ("headmech.core.distributed", "headmech.runs.resume"),  # a rank's per-batch units
        ("headmech.core.distributed", "headmech.stream.engine"),  # merging HeadStats
        ("headmech.tasks", "headmech.tasks.data"),  # the encoder task's corruption
        ("headmech.models.bundled", "headmech.models"),  # the model folders on disk
        ("headmech.core.plot", "headmech.classification.results"),  # a figure of a catalog
    ],
)
def test_the_old_cycles_stay_broken(low: str, high: str) -> None:
    """The imports that closed the package's largest cycle (through 14 modules, before the
    layers were written down) do not come back, directly or through other modules."""
    assert not nx.has_path(GRAPH, low, high), f"{low} reaches {high} again"


def test_no_module_imports_another_modules_private_names() -> None:
    """A name with a leading underscore stays in its module: what another module needs is
    public (no underscore) in the module that defines it."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("headmech"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private = [n for n in private if not n.startswith("__")]
                if private and node.module != module:
                    found.append(f"{module} imports {', '.join(private)} from {node.module}")
    assert not found, "; ".join(found)
