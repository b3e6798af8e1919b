"""The API reference (``make docs``): a pdoc page for every public module of headmech.

pdoc follows ``__all__``: given ``headmech`` alone it documents the names the package
re-exports and no submodule they do not name, so ``headmech.interventions``,
``headmech.pruning`` or ``headmech.kv`` got no page. Here every module is named on pdoc's
command line instead.

Public: every module and subpackage under ``headmech`` whose dotted name has no part
starting with ``_`` (``headmech._version``, ``headmech.__main__`` are left out).

    python -W error docs/build_api.py [-o docs/api]
"""

from __future__ import annotations

import argparse
import pkgutil
from pathlib import Path

import pdoc
import pdoc.extract

import headmech


def public_modules() -> list[str]:
    """``headmech`` and every public module under it, sorted."""
    found = pkgutil.walk_packages(headmech.__path__, "headmech.")
    names = [m.name for m in found if not any(p.startswith("_") for p in m.name.split("."))]
    return ["headmech", *sorted(names)]


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
