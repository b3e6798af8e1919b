"""The API reference (``make docs``): a pdoc page for every public module of headmech.

The public surface, on purpose: ``headmech`` itself and the subpackages a user or a
contributor imports (:data:`PUBLIC`), each documented by the names its ``__init__``
declares in ``__all__`` (pdoc follows ``__all__``, so a package's internal modules get no
page). The other packages (core, stream, runs, classification, publish, cli) are the
library's inside: what they offer a user is re-exported by ``headmech`` or a public package.

    python -W error docs/build_api.py [-o docs/api]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pdoc
import pdoc.extract



PUBLIC = (
    "headmech",
    "headmech.models",
    "headmech.probes",
    "headmech.tasks",
    "headmech.interventions",
    "headmech.headtypes",
    "headmech.attribution",
    "headmech.pruning",
    "headmech.circuits",
    "headmech.discover",
    "headmech.compare",
    "headmech.kv",
    "headmech.testing",
)
"""The documented packages: the public surface."""


def public_modules() -> list[str]:
    """The documented modules: :data:`PUBLIC`."""
    return list(PUBLIC)


def specs(modules: list[str]) -> list[str]:
    """``modules`` less those a spec before them already adds (pdoc walks a package's
    submodules that its ``__all__`` names; naming one again is a warning)."""
    out: list[str] = []
    added: set[str] = set()
    for name in modules:
        if name not in added:
            out.append(name)
            added.update(pdoc.extract.walk_specs([name]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", "--out", type=Path, default=Path("docs/api"))
    args = parser.parse_args(argv)
    # no source listings: half the size and time (the code is in the repository)
    pdoc.render.configure(docformat="google", show_source=False)
    pdoc.pdoc(*specs(public_modules()), output_directory=args.out)
    print(f"API reference: {args.out / 'index.html'} ({len(public_modules())} modules)")


if __name__ == "__main__":
    main()
