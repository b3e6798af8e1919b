"""The API reference (``make docs``, docs/build_api.py) documents the public surface and
nothing else: ``headmech`` and the public subpackages, each by the names its ``__all__``
declares; the library's inside (core, stream, runs, classification, publish, cli, and the
modules inside the public packages) gets no page.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# where a reader looks for the names the issue found documented nowhere
KEY_NAMES = {
    "headmech.interventions": "Intervention",
    "headmech.pruning": "michel_prune",
    "headmech.kv": "KVPlan",
    "headmech.circuits": "path_patch",
    "headmech.headtypes": "HeadType",
    "headmech.discover": "discover",
    "headmech.compare": "agreement_matrix",
    "headmech.testing": "check_head_type",
}


INTERNAL = ("core", "stream", "runs", "classification", "publish", "cli")


def public_modules() -> list[str]:
    """The documented packages: every subpackage of headmech but the internal ones."""
    found = sorted(p.parent.name for p in (ROOT / "headmech").glob("*/__init__.py"))
    return ["headmech", *(f"headmech.{p}" for p in found if p not in INTERNAL)]


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


def test_the_script_documents_the_public_packages():
    """docs/build_api.py's list is this test's: a new subpackage is public or internal on
    purpose (added to one list or the other)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import build_api
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert sorted(build_api.PUBLIC) == sorted(public_modules())
    assert {"headmech.kv", "headmech.pruning", "headmech.headtypes"} <= set(public_modules())


def test_every_public_package_has_a_page_and_no_internal_module_has_one(api):
    missing = [m for m in public_modules() if not page(api, m).is_file()]
    assert not missing, f"no API page for {', '.join(missing)}"
    pages = {
        ".".join(p.relative_to(api).with_suffix("").parts)
        for p in api.rglob("*.html")
        if p.name not in ("index.html", "search.html")
    }
    assert pages == set(public_modules()), sorted(pages ^ set(public_modules()))


@pytest.mark.parametrize("module", public_modules())
def test_a_public_package_declares_its_names(api, module):
    """Each public package says what it offers (``__all__``), every name resolves, and every
    one has an entry on the package's page."""
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    assert names, f"{module} declares no __all__"
    html = page(api, module).read_text()
    for name in names:
        assert hasattr(mod, name), f"{module}.__all__ names {name}, which it does not have"
        if not name.startswith("__"):
            assert f'id="{name}"' in html, f"{name} has no entry on {module}'s page"


@pytest.mark.parametrize("module,name", sorted(KEY_NAMES.items()))
def test_key_names_are_documented(api, module, name):
    html = page(api, module).read_text()
    assert f'id="{name}"' in html, f"{name} has no entry on {module}'s page"
