"""The guides of ``docs/`` (and the README) as pages of the head atlas.

Each Markdown file is rendered with mistune (tables, strikethrough) into ``guides/``: a
link to another guide becomes a link to its page (anchors kept), a link to anything else
of the repository (a module, a catalog file) becomes its path as code, so that a copied
site has no broken link; every heading gets the anchor GitHub gives it, so the guides'
``#anchors`` resolve on the site as they do in the repository.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mistune

__all__ = ["Guide", "guide_pages", "render_guide", "slug"]


@dataclass(frozen=True)
class Guide:
    """One rendered guide: its page name, title and HTML body."""

    name: str  # the page, e.g. "kv-compression.html"
    title: str
    body: str
    images: tuple[Path, ...] = ()  # the figures it shows, copied beside it as img/<name>


def slug(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"<[^>]+>", "", html.unescape(text)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _page_of(target: str, guides: set[str]) -> str | None:
    """The site page a Markdown link points to, or None where it leaves the guides."""
    path, _, anchor = target.partition("#")
    name = Path(path).name
    if path == "":
        return f"#{anchor}"
    if name == "README.md" and Path(path).parent.name not in ("", ".."):
        return None  # a folder's README (headmech/headtypes/), not the project's
    stem = "index" if name == "README.md" else name.removesuffix(".md")
    if name in guides:
        return f"{stem}.html" + (f"#{anchor}" if anchor else "")
    return None


def render_guide(text: str, guides: set[str], images: list[str] | None = None) -> tuple[str, str]:
    """``(title, body)``: a guide's Markdown as HTML, its links made the site's; the local
    figures it shows are appended to ``images`` (their paths as written) and shown from
    ``img/<file name>``."""
    renderer = _Renderer(guides, [] if images is None else images)
    markdown = mistune.create_markdown(renderer=renderer, plugins=["table", "strikethrough"])
    body = str(markdown(text))
    title = next((m for m in re.findall(r"^# (.+)$", text, re.M)), "headmech")
    return title, body


class _Renderer(mistune.HTMLRenderer):
    """mistune's HTML renderer with the site's links and GitHub's heading anchors."""

    def __init__(self, guides: set[str], images: list[str]) -> None:
        super().__init__(escape=False)
        self.guides, self.images = guides, images

    def image(self, text: str, url: str, title: str | None = None) -> str:
        if not re.match(r"^[a-z]+://", url):
            self.images.append(url)
            url = f"img/{Path(url).name}"
        return super().image(text, url, title)

    def link(self, text: str, url: str, title: str | None = None) -> str:
        if re.match(r"^[a-z]+://", url):
            return super().link(text, url, title)
        page = _page_of(url, self.guides)
        if page is None:  # a file of the repository: named, not linked
            return f'<span class="repo-path" title="{html.escape(url)}">{text}</span>'
        return super().link(text, page, title)

    def heading(self, text: str, level: int, **attrs: Any) -> str:
        return f'<h{level} id="{slug(text)}">{text}</h{level}>\n'


def guide_pages(docs: Path, readme: Path | None = None) -> list[Guide]:
    """Every ``docs/*.md`` guide (and the README as ``index.html``), rendered."""
    files = sorted(docs.glob("*.md"))
    names = {p.name for p in files} | ({"README.md"} if readme is not None else set())
    out = []
    for path in ([readme] if readme is not None else []) + files:
        images: list[str] = []
        title, body = render_guide(path.read_text(encoding="utf-8"), names, images)
        stem = "index" if path.name == "README.md" else path.stem
        found = tuple((path.parent / i).resolve() for i in images)
        out.append(Guide(f"{stem}.html", title, body, found))
    return out
