"""The walk of a run's settings through the code: where `headmech classify --validate` takes them.

Traces one ``headmech classify toy-induction --types induction --validate`` with
:func:`sys.setprofile` and keeps every call into headmech whose arguments carry the run's
settings: the parsed arguments, the spec (``ClassifySpec``, its ``ProbeOptions`` and
``ValidationOptions``, the Monte Carlo test's ``TestOptions``) or a keyword of
``classify`` given a value (``types``, ``thresholds``, ``validate``, ``n_random``,
``control_tokens``, ``alone``, ``n_boot`` and the probe options). Each such call is a
*stop*. It prints:

- stops, and the files and packages they are in;
- climbs: a stop in a higher layer of the package stack (pyproject's
  ``[tool.importlinter]`` "headmech layers") than the stop before it;
- returns: a stop in a file left earlier (not the file of the stop before it).

Run it on any checkout (``PYTHONPATH=<checkout> python docs/walk.py``) to compare; the
numbers of the last house change are in docs/architecture.md, "The walk".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

SETTINGS_CLASSES = {"Namespace", "ClassifySpec", "ProbeOptions", "ValidationOptions", "TestOptions"}
KEYWORDS = {
    "types", "thresholds", "validate", "n_random", "control_tokens", "alone", "n_boot",
    "corpus", "n_sentences", "n_sequences", "half_len", "batch_size", "seed",
    "needle_lengths", "needle_depths", "probe_options",
}  # fmt: skip


def _layers(pyproject: Path) -> dict[str, int]:
    """Top-level package -> its layer (0: the top) from the import contract."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    stack = next(c for c in contracts if c["name"] == "headmech layers")["layers"]
    out: dict[str, int] = {}
    for i, layer in enumerate(stack):
        for name in layer.replace("|", ":").split(":"):
            out[name.strip()] = i
    return out


def _carries(frame: Any) -> bool:
    """Whether the called function's arguments carry the run's settings."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(n) for n in names]
    if code.co_flags & 0x08:  # **kwargs
        kw = frame.f_locals.get(code.co_varnames[len(names) + bool(code.co_flags & 0x04)], {})
        if isinstance(kw, dict):
            names = (*names, *kw)
            values = [*values, *kw.values()]
    for name, value in zip(names, values, strict=True):
        if type(value).__name__ in SETTINGS_CLASSES:
            return True
        if name in KEYWORDS and value is not None and name != "self":
            return True
    return False


# functions that call back the function they were given: a resumable run's unit runs its
# caller's compute (headmech.runs.resume.unit); a re-entry through them is declared
CALLBACKS = {"runs/resume.py:unit"}
chains: list[list[tuple[str, str]]] = []  # per stop: the headmech frames above it, outermost first


def _chain(frame: Any, package: str) -> list[tuple[str, str]]:
    """The headmech frames on the stack down to ``frame``: (file, function), outermost first."""
    out = []
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(package):
            out.append((path[len(package) + 1 :], frame.f_code.co_name))
        frame = frame.f_back
    return out[::-1]


def walk(argv: list[str], root: Path) -> list[tuple[str, str]]:
    """The stops of ``headmech *argv``: (file relative to headmech/, function)."""
    from headmech.cli import main

    package = str(root / "headmech")
    stops: list[tuple[str, str]] = []
    chains.clear()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(package) or frame.f_code.co_name.startswith("<"):
            return
        try:
            if _carries(frame):
                stops.append((path[len(package) + 1 :], frame.f_code.co_name))
                chains.append(_chain(frame, package))
        except Exception:  # a frame half-built: not a stop
            return

    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"headmech {' '.join(argv)} failed ({code})")
    return stops


@dataclasses.dataclass
class Figures:
    """The walk's figures."""

    stops: int
    files: int
    packages: int
    climbs: int
    returns: int
    path: list[str]
    reentries: list[str] = dataclasses.field(default_factory=list)


def figures(stops: list[tuple[str, str]], layers: dict[str, int]) -> Figures:
    """Stops, files, packages, climbs back up a layer, returns to a file already left."""

    def package(file: str) -> str:
        return file.split("/")[0].removesuffix(".py") if "/" in file else file.removesuffix(".py")

    climbs = returns = 0
    left: set[str] = set()
    for (a, _), (b, _) in zip(stops, stops[1:], strict=False):
        if layers.get(package(b), 99) < layers.get(package(a), 99):
            climbs += 1
        if b != a:
            left.add(a)
            if b in left:
                returns += 1
    files = {f for f, _ in stops}
    path = [f"{f}:{fn}" for f, fn in stops]
    reentries: set[str] = set()
    for chain in chains:
        seen: list[str] = []
        for (fa, na), (fb, nb) in zip(chain, chain[1:], strict=False):
            pa, pb = package(fa), package(fb)
            if pb != pa and pb in seen + [pa]:
                reentries.add(f"{fa}:{na} -> {fb}:{nb}")
            if not seen or seen[-1] != pa:
                seen.append(pa)
    return Figures(
        len(stops), len(files), len({package(f) for f in files}), climbs, returns, path,
        sorted(reentries),
    )  # fmt: skip


def main() -> None:
    """Print the walk's figures (``--json``: and every stop) for this checkout."""
    import headmech

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print every stop as JSON too")
    a = p.parse_args()
    root = Path(headmech.__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as out:
        argv = ["classify", "toy-induction", "--types", "induction", "--validate",
                "--n-random", "3", "--n-sequences", "4", "--out", out]  # fmt: skip
        stops = walk(argv, root)
    f = figures(stops, _layers(root / "pyproject.toml"))
    print(
        f"{root}: {f.stops} stops in {f.files} files across {f.packages} packages, "
        f"{f.climbs} climbs back up a layer, {f.returns} returns to a file already left, "
        f"{len(f.reentries)} calls on the way down that re-enter a package left above"
    )
    for edge in f.reentries:
        declared = edge.split(" -> ")[0] in CALLBACKS
        print(f"  re-enters: {edge}" + ("  (a declared callback)" if declared else ""))
    if a.json:
        print(json.dumps(dataclasses.asdict(f), indent=1))


if __name__ == "__main__":
    main()
