"""The API reference (``make docs``, docs/build_api.py) has a page for every public module.

Public, as this test states it independently of the script: every module and subpackage
found by walking ``headmech`` with pkgutil whose dotted name has no part starting with an
underscore (``headmech._version`` and ``headmech.__main__`` are the ones left out).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import headmech

ROOT = Path(__file__).resolve().parents[1]

# where a reader looks for the names the issue found documented nowhere
KEY_NAMES = {
    "headmech.interventions": "Intervention",
    "headmech.pruning": "michel_prune",
    "headmech.kv": "KVPlan",
    "headmech.circuits.path_patching": "path_patch",
    "headmech.discover": "discover",
    "headmech.testing": "check_head_type",
}


def public_modules() -> list[str]:
    walked = [m.name for m in pkgutil.walk_packages(headmech.__path__, "headmech.")]
    return ["headmech", *(n for n in walked if not any(p.startswith("_") for p in n.split(".")))]


def _built_after_the_sources(folder: Path) -> bool:
    """Whether ``make docs`` left a reference in ``folder`` newer than every source of it."""
    index = folder / "index.html"
    if not index.exists():
        return False
    sources = [*(ROOT / "headmech").rglob("*.py"), ROOT / "docs" / "build_api.py"]
    return index.stat().st_mtime >= max(p.stat().st_mtime for p in sources)


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Path:
    """The reference built as ``make docs`` builds it: any pdoc warning is an error. ``make
    test`` builds docs/api/ just before pytest (``-W error`` too), so it is read from there
    when it is newer than every source; else it is built here."""
    if _built_after_the_sources(ROOT / "docs" / "api"):
        return ROOT / "docs" / "api"
    out = tmp_path_factory.mktemp("api")
    done = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "docs" / "build_api.py"), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def page(api: Path, module: str) -> Path:
    return api / (module.replace(".", "/") + ".html")


def test_the_rule_finds_the_subpackages():
    found = set(public_modules())
    assert {"headmech.headtypes.induction", "headmech.kv.plan", "headmech.pruning"} <= found
    assert not {"headmech._version", "headmech.__main__"} & found


def test_every_public_module_has_a_page(api):
    missing = [m for m in public_modules() if not page(api, m).is_file()]
    assert not missing, f"no API page for {', '.join(missing)}"


@pytest.mark.parametrize("module,name", sorted(KEY_NAMES.items()))
def test_key_names_are_documented(api, module, name):
    html = page(api, module).read_text()
    assert f'id="{name}"' in html, f"{name} has no entry on {module}'s page"
