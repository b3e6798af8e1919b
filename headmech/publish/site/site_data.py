"""The data the site's scripts read: the search and compare index of every head's score
and verdict (:func:`atlas_index`) and a layer's heads on one recorded text
(:func:`layer_page`)."""

from __future__ import annotations

import json
from typing import Any

from headmech.publish.site.pages import Model, rejected_heads, verdict

__all__ = ["atlas_index", "layer_page"]


def atlas_index(models: list[Model]) -> dict[str, Any]:
    """The data of the site's search, compare view and clickable heatmaps: per model its
    shape and, per type, the threshold, every head's score (row-major, layer by layer;
    3 decimals) and each head's verdict code (0 below, 1 labelled, 2 rejected, 3
    borderline, 4 at or above without a recorded reason)."""
    codes = {"below": 0, "labelled": 1, "rejected": 2, "borderline": 3, "above": 4}
    out: dict[str, Any] = {"models": []}
    for m in models:
        n_layers, n_heads = m.shape
        types = {}
        for name, t in sorted(m.types.items()):
            grid = t.get("score")
            scores = [
                None if not grid or grid[la][h] is None else round(float(grid[la][h]), 3)
                for la in range(n_layers)
                for h in range(n_heads)
            ]
            v = [codes[verdict(t, (la, h))[0]] for la in range(n_layers) for h in range(n_heads)]
            reasons = {e["head"]: e["reason"] for e in rejected_heads(t)}
            types[name] = {
                "threshold": t.get("threshold"),
                "scores": scores,
                "verdicts": v,
                "reasons": reasons,
            }
        out["models"].append({"name": m.name, "layers": n_layers, "heads": n_heads, "types": types})
    return out


def layer_page(m: Model, layer: int, text: int = 0) -> dict[str, Any]:
    """Every head of ``layer`` on one recorded text (``examples.json``'s text ``text``;
    the heads it records): the tokens and, per head, its rows of weights in integer
    thousandths, as the layer view of the site reads them."""
    ex = m.examples or {}
    texts = ex.get("texts", [])
    if not texts:
        return {"layer": layer, "probe": None, "data": None, "missing": []}
    t = texts[min(text, len(texts) - 1)]
    n_heads = m.shape[1]
    heads, missing = {}, []
    for h in range(n_heads):
        rows = ex.get("heads", {}).get(f"L{layer}H{h}")
        if rows and len(rows) > text and rows[text] is not None:
            heads[f"L{layer}H{h}"] = [[round(float(w) * 1000) for w in r] for r in rows[text]]
        else:
            missing.append(f"L{layer}H{h}")
    data = json.dumps({"tokens": t["tokens"], "heads": heads}, separators=(",", ":"))
    return {
        "layer": layer,
        "probe": t["probe"],
        "n_tokens": len(t["tokens"]),
        "data": data.replace("</", "<\\/"),
        "missing": missing,
    }
