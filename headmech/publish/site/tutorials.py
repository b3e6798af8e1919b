"""The tutorials in the head atlas: their renderings, where they come from, their frame.

``make tutorials`` commits the notebooks' small-size renderings in :data:`RENDERED`, each
stamped with its notebook's :func:`notebook_digest`; :func:`committed_tutorials` puts them in
a site that has no fresh ones (``make test`` renders fresh ones), and
:func:`frame_tutorials` gives each the atlas's navigation, the size it ran at, and links to
the other tutorials' renderings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jinja2

__all__ = [
    "RENDERED",
    "TUTORIAL_SIZE",
    "TUTORIAL_SOURCE",
    "committed_tutorials",
    "frame_tutorials",
    "notebook_digest",
]

_FRAME = re.compile(r"<!--headmech-atlas-->.*?<!--/headmech-atlas-->\n?", re.S)
RENDERED = Path("docs") / "tutorials"
"""Where ``make tutorials`` commits the tutorials' renderings (small size), relative to the
repository: ``make site`` puts them in the atlas without running the suite."""

TUTORIAL_SOURCE = "headmech-tutorial-source"
"""The ``<meta>`` naming the notebook a rendering was made from (:func:`notebook_digest`)."""


def notebook_digest(path: str | os.PathLike) -> str:
    """A notebook's cells (their types and sources, not outputs) as 16 hex digits: a
    rendering whose digest differs was made from another version of it."""
    import hashlib

    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    text = json.dumps([[c["cell_type"], "".join(c["source"])] for c in cells])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def committed_tutorials(rendered: Path, out: Path) -> None:
    """The committed renderings (``docs/tutorials``) into the site where the site has none
    of its own (``make test`` renders fresh ones into ``catalog/site/tutorials``)."""
    if not rendered.is_dir():
        return
    for page in sorted(rendered.glob("*.html")):
        if not (out / page.name).exists():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(page, out / page.name)


TUTORIAL_SIZE = "headmech-tutorial-size"
"""The ``<meta>`` a rendered tutorial carries: ``small`` (run with
``HEADMECH_TUTORIAL_SMALL=1``, as the tests run them) or ``published``."""


def frame_tutorials(env: jinja2.Environment, out: Path, common: dict[str, Any]) -> None:
    """Put the atlas's navigation and the size the notebook was run at (its
    :data:`TUTORIAL_SIZE` meta; unknown counts as reduced) at the top of each rendered
    tutorial in ``out/tutorials/`` (replacing an earlier frame)."""
    template = env.get_template("tutorial_frame.html")
    for path in sorted((out / "tutorials").glob("*.html")):
        page = _FRAME.sub("", path.read_text(encoding="utf-8"))
        size = re.search(rf'<meta name="{TUTORIAL_SIZE}" content="([a-z]+)"', page)
        frame = template.render(root="..", reduced=not size or size[1] != "published", **common)
        body = re.search(r"<body[^>]*>\n?", page)
        if body is None:
            continue  # not an nbconvert page: left as it is
        page = page[: body.end()] + frame + page[body.end() :]
        # a tutorial's link to another notebook: its rendering, where the site has one
        rendered = {p.stem for p in path.parent.glob("*.html")}
        page = re.sub(
            r'href="(?:\./)?([\w-]+)\.ipynb"',
            lambda m: f'href="{m[1]}.html"' if m[1] in rendered else m[0],  # noqa: B023
            page,
        )
        path.write_text(page, encoding="utf-8")
