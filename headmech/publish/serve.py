"""``headmech serve MODEL``: any text, any head or layer, in the browser, on this machine.

A local web server (Tornado) that loads the model once. Its page takes a text and a head
(``L18H6``) or a layer (``L18``) and shows, for a head, the attention view of the atlas
(:func:`headmech.publish.attention_view.view_html`), what the head writes there
(:mod:`headmech.attribution.writes`, decoders) and its pattern scores on the text
(:func:`text_scores`); for a layer, every head's view. It binds to 127.0.0.1 unless told
otherwise. A bad input (an empty or too long text, a head or layer outside the model) is
answered with a one-line message and status 400, never a server error.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headmech.core.errors import HeadmechError, InputError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["MAX_TOKENS", "Server", "render", "start", "text_scores"]

MAX_TOKENS = 512
"""The longest text the page shows (tokens, special tokens included)."""


def text_scores(ids: list[int], pattern: Any) -> dict[str, float]:
    """A head's pattern scores on one text, as the pattern-defined types measure them on
    their probes: the mean weight of a query on the previous token (previous-token heads),
    on earlier copies of its own token (duplicate-token heads, queries with a copy), on
    the token after an earlier copy (induction heads, the same queries) and on the first
    token (attention sinks)."""
    n = len(ids)
    prev = [float(pattern[q, q - 1]) for q in range(1, n)]
    dup, ind = [], []
    for q in range(n):
        copies = [k for k in range(q) if ids[k] == ids[q]]
        if copies:
            dup.append(sum(float(pattern[q, k]) for k in copies))
            ind.append(sum(float(pattern[q, k + 1]) for k in copies if k + 1 < q + 1))
    out = {
        "previous_token": _mean(prev),
        "attention_sink": _mean([float(pattern[q, 0]) for q in range(1, n)]),
    }
    out |= {"duplicate_token": _mean(dup), "induction": _mean(ind)}
    return {k: v for k, v in out.items() if v is not None}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _target(model: TransformerBridge, what: str) -> tuple[int, list[int]]:
    """``L18H6`` -> (18, [6]); ``L18`` -> (18, every head); else an InputError."""
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    m = re.fullmatch(r"\s*L(\d+)(?:H(\d+))?\s*", what or "", re.I)
    if m is None:
        raise InputError(f"name a head as L3H1 or a layer as L3, got {what!r}")
    layer = int(m[1])
    if layer >= n_layers:
        raise InputError(f"layer {layer} is outside the model ({n_layers} layers)")
    if m[2] is None:
        return layer, list(range(n_heads))
    if int(m[2]) >= n_heads:
        raise InputError(f"head {m[2]} is outside the model ({n_heads} heads a layer)")
    return layer, [int(m[2])]


def render(model: TransformerBridge, text: str, what: str) -> dict[str, Any]:
    """The page's answer for ``text`` and a head or layer ``what``: ``{"html", "tokens",
    "scores"}`` (InputError on bad input)."""
    import torch

    from headmech.attribution.writes import head_writes
    from headmech.core.head_index import HeadIndex
    from headmech.interventions import capture
    from headmech.models import model_info
    from headmech.publish.attention_view import view_html
    from headmech.publish.examples import writes_record
    from headmech.publish.site.writes_view import writes_html
    from headmech.stream.engine import ProbeBatch

    if not text or not text.strip():
        raise InputError("type a text first")
    layer, heads = _target(model, what)
    ids = model.tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ids) > MAX_TOKENS:
        raise InputError(f"the text is {len(ids)} tokens; at most {MAX_TOKENS} here")
    if len(ids) < 2:
        raise InputError("type at least two tokens")
    t = torch.tensor([ids])
    special = torch.isin(t, torch.tensor(sorted(set(model.tokenizer.all_special_ids))))
    name = f"blocks.{layer}.attn.hook_pattern"
    pattern = capture(model, ProbeBatch(t, torch.ones_like(t), special), [name])[name][0]
    tokens = [str(model.tokenizer.decode([i])).replace("\n", "\\n") for i in ids]
    try:
        writes = head_writes(model, ids, [HeadIndex(layer, h) for h in heads])
    except HeadmechError:  # an encoder: no next token to write to
        writes = {}
    parts, scores = [], {}
    causal = model_info(model).causal
    for h in heads:
        p = pattern[h]
        rows = [
            [round(float(w), 3) for w in p[q, : q + 1 if causal else len(ids)]]
            for q in range(len(ids))
        ]
        w = writes.get(HeadIndex(layer, h))
        parts.append(
            view_html(
                tokens,
                rows,
                title=f"L{layer}H{h}",
                view_id=f"serve-L{layer}H{h}",
                ids=ids,
                inline=True,
            )
            + (writes_html(tokens, writes_record(model.tokenizer, w)) if w is not None else "")
        )
        scores[f"L{layer}H{h}"] = text_scores(ids, p)
    return {"html": _score_table(scores) + "".join(parts), "tokens": tokens, "scores": scores}


_SCORED = ("previous_token", "duplicate_token", "induction", "attention_sink")


def _score_table(scores: dict[str, dict[str, float]]) -> str:
    """The heads' pattern scores on the text as an HTML table (a row per head)."""
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td>"
        + "".join(f"<td>{s.get(t, float('nan')):.3f}</td>" for t in _SCORED)
        + "</tr>"
        for k, s in scores.items()
    )
    head = "".join(f"<th>{t}</th>" for t in _SCORED)
    return f'<table class="scores"><tr><th>head</th>{head}</tr>{rows}</table>'


@dataclass
class Server:
    """A running server: its address, and how to stop it (a thread's, for tests and
    notebooks; the command line runs it in the foreground)."""

    url: str
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _app(model: TransformerBridge, name: str) -> Any:
    import tornado.web

    page = _PAGE.replace("{{NAME}}", html.escape(name)).replace("{{CSS}}", _css())

    class Index(tornado.web.RequestHandler):
        def get(self) -> None:
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.write(page)

    class View(tornado.web.RequestHandler):
        def get(self) -> None:
            self.set_header("Content-Type", "application/json")
            try:
                out = render(model, self.get_argument("text", ""), self.get_argument("head", ""))
            except HeadmechError as e:  # bad input: one line, 400
                self.set_status(400)
                out = {"error": str(e).splitlines()[0]}
            except Exception as e:  # anything else: still one line, never a trace
                self.set_status(400)
                out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            self.write(json.dumps(out))

    return tornado.web.Application([(r"/", Index), (r"/api/view", View)])


def _css() -> str:
    from headmech.publish.site.writes_view import WRITES_CSS

    return WRITES_CSS


def start(model: TransformerBridge, name: str, host: str = "127.0.0.1", port: int = 0) -> Server:
    """The server in a background thread (``port`` 0: a free one); ``Server.url`` says
    where."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        import tornado.httpserver
        import tornado.netutil

        sockets = tornado.netutil.bind_sockets(port, address=host)
        server = tornado.httpserver.HTTPServer(_app(model, name))
        server.add_sockets(sockets)
        box["port"], box["loop"] = sockets[0].getsockname()[1], loop
        ready.set()
        loop.run_forever()
        server.stop()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(30):
        raise HeadmechError("the server did not start")
    return Server(f"http://{host}:{box['port']}/", box["loop"], thread)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>headmech serve: {{NAME}}</title>
<style>body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1100px}
textarea{width:100%;font:inherit}.error{color:#b00020}table.scores td,table.scores th{border:1px solid #ccc;padding:2px 6px}
code.tok{background:#f2f2f2;white-space:pre}{{CSS}}</style></head>
<body><h1>{{NAME}}: any text, any head</h1>
<form id="form"><p><label for="text">Text</label><br>
<textarea id="text" name="text" rows="4">When Mary and John went to the store, John gave a drink to</textarea></p>
<p><label for="head">Head (L3H1) or layer (L3): </label><input id="head" name="head" value="L0H0" size="8">
<button type="submit">Show</button> <span id="status" role="status"></span></p></form>
<div id="out"></div>
<script>
document.getElementById("form").addEventListener("submit", function (e) {
  e.preventDefault();
  var status = document.getElementById("status"), out = document.getElementById("out");
  status.textContent = "running...";
  status.className = "";
  var q = new URLSearchParams({text: document.getElementById("text").value, head: document.getElementById("head").value});
  fetch("api/view?" + q).then(function (r) { return r.json(); }).then(function (d) {
    if (d.error) { status.textContent = d.error; status.className = "error"; return; }
    status.textContent = d.tokens.length + " tokens";
    out.innerHTML = d.html;
    out.querySelectorAll("script:not([type]), script[type='text/javascript']").forEach(function (s) {
      var n = document.createElement("script"); n.textContent = s.textContent; s.replaceWith(n);
    });  // innerHTML does not run scripts: the views' own, run once inserted (data stays JSON)
  }).catch(function (err) { status.textContent = String(err); status.className = "error"; });
});
</script></body></html>
"""
