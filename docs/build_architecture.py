"""The generated part of docs/architecture.md: the packages, layer by layer, and every
module's first docstring sentence, from the import-linter contracts of pyproject.toml.

The page keeps its written parts (the data flow, the files, the scale); what lies between
:data:`BEGIN` and :data:`END` is this script's, and ``tests/test_docs.py`` fails when it
is stale. ``make docs`` runs it.

    python docs/build_architecture.py [--check]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- packages and layers: written by docs/build_architecture.py; do not edit -->"
END = "<!-- end of the packages and layers -->"


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    para = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", para).replace("``", "`")  # RST to Markdown
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)(?<! al)(?<!vs)[.!?])(\s|$)", para)
    return (match.group(1) if match else para) or "(no docstring)"


def _path(dotted: str) -> Path:
    base = ROOT / Path(*dotted.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return config["tool"]["importlinter"]["contracts"]


def _entries(layer: str) -> tuple[list[str], str]:
    sep = ":" if ":" in layer else "|"
    return [m.strip() for m in layer.split(sep)], sep


def _modules(package: Path) -> list[Path]:
    """A package's modules and subpackages, the package's own ``__init__`` left out."""
    found = [p for p in sorted(package.glob("*.py")) if p.name != "__init__.py"]
    found += [d / "__init__.py" for d in sorted(package.iterdir()) if (d / "__init__.py").exists()]
    return sorted(found, key=lambda p: p.parent.name if p.name == "__init__.py" else p.stem)


def _inner_layers(container: str) -> str | None:
    for c in contracts()[1:]:
        if c["containers"] == [container]:
            return " > ".join(
                f" {sep} ".join(f"`{m}`" for m in names)
                for names, sep in map(_entries, c["layers"])
            )
    return None


def generated() -> str:
    """The packages and layers section, Markdown."""
    top = contracts()[0]
    lines = [
        BEGIN,
        "## Packages, layer by layer",
        "",
        "A module imports its own layer and the ones below, never one above, not even inside",
        "a function or for type checking, and no import closes a cycle: the import-linter",
        "contracts of `pyproject.toml` (`make lint` runs `lint-imports`; `tests/test_layers.py`",
        "reads them and also refuses cycles inside a layer). Inside a package the same rule",
        "holds between its modules where the package has a contract of its own (its layers",
        "are given top first, `>` between layers, `|` between modules that may not import",
        "each other). Top first:",
        "",
    ]
    for i, layer in enumerate(top["layers"], 1):
        names, _ = _entries(layer)
        for name in names:
            dotted = f"headmech.{name}"
            path = _path(dotted)
            rel = path.relative_to(ROOT)
            is_package = path.name == "__init__.py"
            shown = f"headmech/{name}/" if is_package else str(rel)
            lines.append(f"### {i}. `{shown}`")
            lines.append("")
            lines.append(first_sentence(path))
            lines.append("")
            if is_package:
                inner = _inner_layers(dotted)
                if inner:
                    lines += [f"Layers inside: {inner}.", ""]
                lines += ["| module | what it is |", "|---|---|"]
                for mod in _modules(path.parent):
                    label = f"{mod.parent.name}/" if mod.name == "__init__.py" else mod.name
                    what = first_sentence(mod).replace("|", r"\|")
                    lines.append(f"| `{label}` | {what} |")
                lines.append("")
    lines.append(END)
    return "\n".join(lines)


def updated(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + generated() + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when the page is stale")
    args = parser.parse_args(argv)
    text = PAGE.read_text(encoding="utf-8")
    new = updated(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is stale: run python docs/build_architecture.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    print(f"{PAGE}: {generated().count(chr(10)) + 1} generated lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
