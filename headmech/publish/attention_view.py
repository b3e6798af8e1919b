"""A token-level view of one head's attention, as CircuitsVis draws it: hover or click a
token (the query) and every token it may attend to shows the weight it receives, shaded by
it. The same HTML fragment serves the site's head pages (:mod:`headmech.publish.site`) and
:func:`headmech.show` in a notebook; it needs no server and no network.

A pattern is given as rows: row ``q`` holds the weights of query ``q`` on keys ``0..q``
(a causal model) or on every key (a bidirectional one). Token text is escaped; the weights
travel as JSON (integer thousandths) inside a ``<script type="application/json">`` element.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

__all__ = ["VIEW_CSS", "VIEW_JS", "top_attended", "view_html"]

VIEW_CSS = """
.hm-view { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; margin: .5em 0 1em; }
.hm-view .hm-title { font-family: sans-serif; font-weight: 600; margin-bottom: .3em; }
.hm-view .hm-tokens { line-height: 3.4; }
.hm-view .hm-tok { position: relative; display: inline-block; padding: 0 2px; margin: 1px;
  border: 1px solid #ddd; border-radius: 3px; cursor: pointer; white-space: pre; }
.hm-view .hm-tok.hm-query { outline: 2px solid #d62728; }
.hm-view .hm-w { position: absolute; left: 0; top: calc(100% + 1px); font-size: 9px; color: #555;
  line-height: 1; pointer-events: none; }
.hm-view .hm-status { font-family: sans-serif; font-size: 12px; color: #333; margin-top: .2em; }
"""
"""The view's style sheet (the site links it, :func:`view_html` inlines it on request)."""

VIEW_JS = r"""
(function () {
  function shade(w) { return "rgba(31, 119, 180, " + Math.min(1, w).toFixed(3) + ")"; }
  function init(root) {
    if (root.dataset.ready) return;
    root.dataset.ready = "1";
    // weights travel as integer thousandths (a third smaller than "0.123")
    var rows = JSON.parse(root.querySelector("script.hm-data").textContent).map(
      function (r) { return r.map(function (w) { return w / 1000; }); });
    var toks = root.querySelectorAll(".hm-tok");
    toks.forEach(function (t) { t.dataset.text = t.textContent; });
    var status = root.querySelector(".hm-status");
    function select(q) {
      var row = rows[q];
      toks.forEach(function (t, k) {
        var old = t.querySelector(".hm-w");
        if (old) old.remove();
        t.classList.toggle("hm-query", k === q);
        if (k < row.length) {
          t.style.background = shade(row[k]);
          var w = document.createElement("span");
          w.className = "hm-w";
          w.textContent = row[k].toFixed(3);
          t.appendChild(w);
        } else {
          t.style.background = "";
        }
      });
      var best = 0;
      for (var k = 1; k < row.length; k++) if (row[k] > row[best]) best = k;
      status.textContent = "query " + q + " " + JSON.stringify(toks[q].dataset.text) +
        ": most attention (" + row[best].toFixed(3) + ") on token " + best + " " +
        JSON.stringify(toks[best].dataset.text);
      root.dataset.query = String(q);
    }
    toks.forEach(function (t, q) {
      t.addEventListener("mouseenter", function () { select(q); });
      t.addEventListener("click", function () { select(q); });
    });
  }
  window.headmechView = init;
  document.querySelectorAll(".hm-view").forEach(init);
})();
"""
"""Script that makes every ``.hm-view`` on the page interactive (idempotent)."""


def _json_in_script(value: object) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>`` can close it early)."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def view_html(
    tokens: Sequence[str],
    rows: Sequence[Sequence[float]],
    *,
    title: str = "",
    view_id: str = "hm-view",
    inline: bool = False,
) -> str:
    """The HTML of one head's view on one text.

    Args:
        tokens: the text's tokens as strings (escaped here).
        rows: row ``q``: the weights query ``q`` puts on keys ``0..len(row)-1``.
        title: a heading above the tokens (escaped).
        view_id: the element's id (unique on its page).
        inline: also inline :data:`VIEW_CSS` and :data:`VIEW_JS` (a notebook cell);
            the site links them once instead.
    """
    if len(rows) != len(tokens):
        raise ValueError(f"{len(rows)} rows of weights for {len(tokens)} tokens")
    spans = "".join(f'<span class="hm-tok">{html.escape(t) or "&#8203;"}</span>' for t in tokens)
    milli = [[round(float(w) * 1000) for w in row] for row in rows]
    body = (
        f'<div class="hm-view" id="{html.escape(view_id, quote=True)}">'
        f'<div class="hm-title">{html.escape(title)}</div>'
        f'<div class="hm-tokens">{spans}</div>'
        '<div class="hm-status">hover or click a token to see the weights it puts on the others</div>'
        f'<script type="application/json" class="hm-data">{_json_in_script(milli)}</script>'
        "</div>"
    )
    if inline:
        body = f"<style>{VIEW_CSS}</style>{body}<script>{VIEW_JS}</script>"
    return body


def top_attended(
    tokens: Sequence[str], rows: Sequence[Sequence[float]], k: int = 5
) -> list[tuple[int, str, float]]:
    """The ``k`` key positions that receive the most attention, as a share of all the
    queries' attention (each query's weights sum to 1): ``(position, token, share)``,
    largest first."""
    n = len(tokens)
    total = [0.0] * n
    for row in rows:
        for key, w in enumerate(row):
            total[key] += float(w)
    means = [(i, tokens[i], round(total[i] / max(len(rows), 1), 3)) for i in range(n)]
    return sorted(means, key=lambda x: (-x[2], x[0]))[:k]
