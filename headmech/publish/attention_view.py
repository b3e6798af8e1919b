"""A token-level view of one head's attention, as CircuitsVis draws it: hover or focus a
token (the query) and every token it may attend to shows the weight it receives, shaded by
it; a click (or Enter) pins the query; a button switches to reading a token as a key (the
weight each query puts on it); the full query x key pattern opens below, zoomable, each
cell's weight shown on hover. The same HTML fragment serves the site's head pages (:mod:`headmech.publish.site`) and
:func:`headmech.show` in a notebook; it needs no server and no network.

A pattern is given as rows: row ``q`` holds the weights of query ``q`` on keys ``0..q``
(a causal model) or on every key (a bidirectional one). Token text is escaped; the weights
travel as JSON (integer thousandths) inside a ``<script type="application/json">`` element.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

__all__ = ["INK_JS", "VIEW_CSS", "VIEW_JS", "top_attended", "top_pairs", "view_html"]

VIEW_CSS = """
.hm-view { --hm-fg: #1a1a1a; --hm-border: #bbb; --hm-q: #c01f20; --hm-shade: 22, 94, 166;
  font-family: ui-monospace, Menlo, Consolas, "Noto Sans Mono", "Noto Sans Mono CJK SC",
  "Noto Sans", "Noto Sans CJK SC", "Noto Sans Devanagari", monospace;
  font-size: 14px; margin: .5em 0 1em; color: var(--hm-fg); max-width: 100%; }
@media (prefers-color-scheme: dark) {
  .hm-view { --hm-fg: #eee; --hm-border: #666; --hm-q: #ff7b72; --hm-shade: 88, 166, 255; }
}
.hm-view .hm-title { font-family: system-ui, "Noto Sans", sans-serif; font-weight: 600; margin-bottom: .3em; }
.hm-view .hm-tokens { display: flex; flex-wrap: wrap; gap: 3px; align-items: flex-start; }
.hm-view .hm-tok { display: inline-flex; flex-direction: column; align-items: center;
  min-width: 1.2em; padding: 1px 3px; border: 1px solid var(--hm-border); border-radius: 3px;
  cursor: pointer; white-space: pre; max-width: 100%; overflow-wrap: anywhere; }
.hm-view .hm-tok:focus-visible { outline: 3px solid #f5a623; outline-offset: 1px; }
.hm-view .hm-tok.hm-query { outline: 2px solid var(--hm-q); }
.hm-view .hm-tok.hm-pinned { outline-width: 3px; }
.hm-view .hm-w { display: block; font-size: 11px; line-height: 1.2; padding: 0 1px; margin-top: 1px;
  color: inherit; background: rgba(128, 128, 128, .18); border-radius: 2px;
  font-variant-numeric: tabular-nums; pointer-events: none; }
.hm-view .hm-status { font-family: system-ui, "Noto Sans", sans-serif; font-size: 13px; margin-top: .4em; }
.hm-view .hm-matrix { overflow-x: auto; }
.hm-view .hm-matrix canvas { display: block; image-rendering: pixelated; border: 1px solid var(--hm-border); cursor: crosshair; }
.hm-view .hm-flip, .hm-view .hm-zoom { font: 13px system-ui, "Noto Sans", sans-serif; margin: .4em 0 0; }
.hm-view .hm-cell { font-family: system-ui, "Noto Sans", sans-serif; font-size: 13px; min-height: 1.4em; }
"""
"""The view's style sheet (the site links it, :func:`view_html` inlines it on request)."""

INK_JS = r"""
// text that stays readable on its shade: the shade (weight w, colour "r, g, b") blended over
// the page's background, then light or dark text by the blend's luminance (WCAG contrast of at
// least 4.58 either way). Shared by the view (VIEW_JS) and the site's own script (site.js).
function headmechInk(w, rgbText) {
  if (!headmechInk.page) {
    var m = /rgba?\(([^)]+)\)/.exec(getComputedStyle(document.body).backgroundColor || "");
    var v = m ? m[1].split(",").map(parseFloat) : [];
    headmechInk.page = v.length >= 3 && !(v.length > 3 && v[3] === 0) ? v.slice(0, 3) : [255, 255, 255];
  }
  var page = headmechInk.page, rgb = rgbText.split(",").map(parseFloat), a = Math.min(1, w);
  var lum = [0, 1, 2].map(function (i) {
    var c = (rgb[i] * a + page[i] * (1 - a)) / 255;
    return c <= 0.03928 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4);
  });
  var L = 0.2126 * lum[0] + 0.7152 * lum[1] + 0.0722 * lum[2];
  return L < 0.179 ? "#fff" : "#000";
}
"""
"""The readable-text rule of a shaded token, one copy for the view and the site's script."""

VIEW_JS = (
    INK_JS
    + r"""
(function () {
  function init(root) {
    if (root.dataset.ready) return;
    root.dataset.ready = "1";
    var shadeRgb = getComputedStyle(root).getPropertyValue("--hm-shade").trim() || "31, 119, 180";
    function shade(w) { return "rgba(" + shadeRgb + ", " + Math.min(1, w).toFixed(3) + ")"; }

    var ink = headmechInk;
    // weights travel as integer thousandths (a third smaller than "0.123")
    var data = JSON.parse(root.querySelector("script.hm-data").textContent);
    var ids = data.ids || null;
    var rows = (data.rows || data).map(
      function (r) { return r.map(function (w) { return w / 1000; }); });
    // a site's page may leave the tokens to a shared script (assets/texts.js):
    // <div class="hm-tokens" data-ref="model/0"> and window.HEADMECH_TEXTS["model/0"]
    var strip = root.querySelector(".hm-tokens");
    if (strip.dataset.ref && !strip.children.length) {
      ((window.HEADMECH_TEXTS || {})[strip.dataset.ref] || []).forEach(function (text) {
        var s = document.createElement("span");
        s.className = "hm-tok";
        s.textContent = text || "\u200b";
        strip.appendChild(s);
      });
    }
    var toks = root.querySelectorAll(".hm-tok");
    var status = root.querySelector(".hm-status");
    var pinned = -1;
    toks.forEach(function (t, k) {
      var text = t.textContent;
      t.dataset.text = text;
      var label = "token " + k + ": " + JSON.stringify(text) + (ids ? ", id " + ids[k] : "");
      t.title = label;
      t.setAttribute("aria-label", label);
      t.setAttribute("role", "button");
      t.setAttribute("aria-pressed", "false");
      t.tabIndex = 0;
    });
    function clear() {
      toks.forEach(function (t) {
        var old = t.querySelector(".hm-w");
        if (old) old.remove();
        t.classList.remove("hm-query");
        t.style.background = "";
        t.style.color = "";
      });
      status.textContent = "hover or focus a token to see the weights it puts on the others; click or press Enter to pin it";
      delete root.dataset.query;
    }
    // reading: "query" (a token's row: the weight it puts on each key) or "key" (a token's
    // column: the weight each query puts on it)
    var reading = "query";
    function weight(q, k) { var r = rows[q]; return k < r.length ? r[k] : null; }
    function select(q) {
      toks.forEach(function (t, k) {
        var old = t.querySelector(".hm-w");
        if (old) old.remove();
        t.classList.toggle("hm-query", k === q);
        var w = reading === "query" ? weight(q, k) : weight(k, q);
        if (w !== null) {
          t.style.background = shade(w);
          t.style.color = ink(w, shadeRgb);
          var label = document.createElement("span");
          label.className = "hm-w";
          label.setAttribute("aria-hidden", "true");
          label.textContent = w.toFixed(3);
          t.appendChild(label);
        } else {
          t.style.background = "";
          t.style.color = "";
        }
      });
      var best = -1, bw = -1;
      for (var k = 0; k < toks.length; k++) {
        var w = reading === "query" ? weight(q, k) : weight(k, q);
        if (w !== null && w > bw) { best = k; bw = w; }
      }
      var who = reading === "query" ? "query " : "key ";
      var what = reading === "query" ? ": most attention (" : ": most attention from query " + best + " (";
      status.textContent = (pinned === q ? "pinned: " : "") + who + q + " " +
        JSON.stringify(toks[q].dataset.text) + what + bw.toFixed(3) + ")" +
        (reading === "query" ? " on token " + best + " " + JSON.stringify(toks[best].dataset.text) : "");
      root.dataset.query = String(q);
      root.dataset.reading = reading;
    }
    function pin(q) {
      pinned = pinned === q ? -1 : q;
      toks.forEach(function (t, k) {
        t.classList.toggle("hm-pinned", k === pinned);
        t.setAttribute("aria-pressed", k === pinned ? "true" : "false");
      });
      root.dataset.pinned = String(pinned);
      if (pinned >= 0) select(pinned); else select(q);
      // an atlas page's address keeps the pinned query (#view-2=14), so a view can be shared
      if (document.body.dataset.root && root.id && window.history.replaceState) {
        var here = location.hash.slice(1), mine = here.split("=")[0] === root.id;
        if (pinned >= 0) history.replaceState(null, "", "#" + root.id + "=" + pinned);
        else if (mine) history.replaceState(null, "", location.pathname + location.search);
      }
    }
    toks.forEach(function (t, q) {
      t.addEventListener("mouseenter", function () { if (pinned < 0) select(q); });
      t.addEventListener("focus", function () { if (pinned < 0) select(q); });
      t.addEventListener("click", function () { pin(q); });
      t.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); pin(q); }
        else if (e.key === "Escape" && pinned >= 0) { pin(pinned); clear(); }
        else if (e.key === "ArrowRight" && q + 1 < toks.length) toks[q + 1].focus();
        else if (e.key === "ArrowLeft" && q > 0) toks[q - 1].focus();
      });
    });
    root.querySelector(".hm-tokens").addEventListener("mouseleave", function () {
      if (pinned >= 0) select(pinned);
    });
    // query -> keys or key <- queries: which way a selected token is read
    var flip = document.createElement("button");
    flip.type = "button";
    flip.className = "hm-flip";
    flip.setAttribute("aria-pressed", "false");
    flip.textContent = "reading: query → keys (switch to key ← queries)";
    flip.addEventListener("click", function () {
      reading = reading === "query" ? "key" : "query";
      flip.setAttribute("aria-pressed", reading === "key" ? "true" : "false");
      flip.textContent = reading === "query" ? "reading: query → keys (switch to key ← queries)"
        : "reading: key ← queries (switch to query → keys)";
      root.dataset.reading = reading;
      if (pinned >= 0) select(pinned); else if (root.dataset.query) select(+root.dataset.query);
    });
    root.insertBefore(flip, status);
    // the full query x key pattern, drawn on demand; zoom it, hover a cell for its weight
    var details = document.createElement("details");
    details.className = "hm-matrix";
    details.innerHTML = "<summary>full query × key pattern (rows: queries)</summary>";
    var canvas = document.createElement("canvas");
    var n = toks.length, cell = Math.max(3, Math.min(10, Math.floor(320 / n)));
    canvas.width = canvas.height = n * cell;
    canvas.style.width = n * cell + "px";
    canvas.setAttribute("role", "img");
    canvas.setAttribute("aria-label", "attention pattern, " + n + " queries by " + n + " keys; click a row to pin that query");
    var zoom = document.createElement("label");
    zoom.className = "hm-zoom";
    zoom.innerHTML = "zoom <input type=range min=1 max=6 step=1 value=1 aria-label=\"zoom the pattern\">";
    zoom.querySelector("input").addEventListener("input", function (e) {
      canvas.style.width = n * cell * +e.target.value + "px";
    });
    var cellInfo = document.createElement("div");
    cellInfo.className = "hm-cell";
    cellInfo.setAttribute("aria-live", "polite");
    details.appendChild(zoom);
    details.appendChild(canvas);
    details.appendChild(cellInfo);
    canvas.addEventListener("mousemove", function (e) {
      var box = canvas.getBoundingClientRect();
      var q = Math.floor((e.clientY - box.top) / box.height * n);
      var k = Math.floor((e.clientX - box.left) / box.width * n);
      if (q < 0 || q >= n || k < 0 || k >= n) return;
      var w = weight(q, k);
      cellInfo.textContent = "query " + q + " " + JSON.stringify(toks[q].dataset.text) + " → key " +
        k + " " + JSON.stringify(toks[k].dataset.text) + ": " + (w === null ? "masked" : w.toFixed(3));
    });
    details.addEventListener("toggle", function () {
      if (!details.open || canvas.dataset.drawn) return;
      canvas.dataset.drawn = "1";
      var ctx = canvas.getContext("2d");
      rows.forEach(function (r, q) {
        r.forEach(function (w, k) { ctx.fillStyle = shade(w); ctx.fillRect(k * cell, q * cell, cell, cell); });
      });
    });
    canvas.addEventListener("click", function (e) {
      var box = canvas.getBoundingClientRect();
      var q = Math.floor((e.clientY - box.top) / box.height * n);
      if (q >= 0 && q < n) pin(q);
    });
    root.insertBefore(details, status.nextSibling);
    var shared = /^#([\w-]+)=(\d+)$/.exec(location.hash);  // an address that pins a query
    if (shared && shared[1] === root.id && +shared[2] < toks.length) {
      pin(+shared[2]);
      root.scrollIntoView();
    }
  }
  window.headmechView = init;
  document.querySelectorAll(".hm-view").forEach(init);
})();
"""
)
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
    ids: Sequence[int] | None = None,
    text_ref: str | None = None,
) -> str:
    """The HTML of one head's view on one text.

    Args:
        tokens: the text's tokens as strings (escaped here).
        rows: row ``q``: the weights query ``q`` puts on keys ``0..len(row)-1``.
        title: a heading above the tokens (escaped).
        view_id: the element's id (unique on its page).
        inline: also inline :data:`VIEW_CSS` and :data:`VIEW_JS` (a notebook cell);
            the site links them once instead.
        ids: the tokens' ids, shown with each token on hover (where recorded).
        text_ref: leave the tokens out of the HTML: the script reads them from
            ``window.HEADMECH_TEXTS[text_ref]`` (the site shares each text between the
            pages of a model's heads, a script of its own).
    """
    if len(rows) != len(tokens):
        raise ValueError(f"{len(rows)} rows of weights for {len(tokens)} tokens")
    spans = "".join(f'<span class="hm-tok">{html.escape(t) or "&#8203;"}</span>' for t in tokens)
    strip = '<div class="hm-tokens">'
    if text_ref is not None:
        spans, strip = "", f'<div class="hm-tokens" data-ref="{html.escape(text_ref, quote=True)}">'
    milli: object = [[round(float(w) * 1000) for w in row] for row in rows]
    if ids is not None:
        milli = {"rows": milli, "ids": [int(i) for i in ids]}
    body = (
        f'<div class="hm-view" id="{html.escape(view_id, quote=True)}">'
        f'<div class="hm-title">{html.escape(title)}</div>'
        f"{strip}{spans}</div>"
        '<div class="hm-status" role="status" aria-live="polite">hover or click a token to see the '
        "weights it puts on the others</div>"
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


def top_pairs(
    tokens: Sequence[str], rows: Sequence[Sequence[float]], k: int = 5
) -> list[tuple[int, str, int, str, float]]:
    """The ``k`` query -> key pairs with the largest weights, the first token left out as a
    key (where most heads park attention: a sink, not a pair that drives a pattern score):
    ``(query, its token, key, its token, weight)``, largest first."""
    pairs = [(q, k_, float(w)) for q, row in enumerate(rows) for k_, w in enumerate(row) if k_ > 0]
    pairs.sort(key=lambda x: (-x[2], x[0], x[1]))
    return [(q, tokens[q], k_, tokens[k_], round(w, 3)) for q, k_, w in pairs[:k]]
