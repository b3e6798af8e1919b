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
        texts = [
            {"probe": t["probe"], "tokens": len(t["tokens"])}
            for t in (m.examples or {}).get("texts", [])
        ]  # the compare view shows two heads on the same text (their head pages' views)
        out["models"].append(
            {"name": m.name, "layers": n_layers, "heads": n_heads, "types": types, "texts": texts}
        )
    return out


def layer_page(m: Model, layer: int) -> dict[str, Any]:
    """Every head of ``layer`` on each text examples.json records all of them on (the
    ordinary texts; the first where none is whole): the tokens and, per head, its rows of
    weights in integer thousandths, with the types that label each head, as the layer view
    of the site reads them (a text per ``texts`` entry; the view switches between them)."""
    ex = m.examples or {}
    texts = ex.get("texts", [])
    if not texts:
        return {"layer": layer, "texts": [], "missing": []}
    n_heads = m.shape[1]
    names = [f"L{layer}H{h}" for h in range(n_heads)]
    recorded = ex.get("heads", {})

    def whole(i: int) -> bool:
        return all(len(recorded.get(n) or []) > i and recorded[n][i] is not None for n in names)

    chosen = [i for i in range(len(texts)) if whole(i)] or [0]
    labels = {
        n: sorted(t for t, r in m.types.items() if [layer, int(n.split("H")[1])] in r["heads"])
        for n in names
    }
    out, missing = [], []
    for i in chosen:
        heads = {}
        for n in names:
            rows = recorded.get(n)
            if rows and len(rows) > i and rows[i] is not None:
                heads[n] = [[round(float(w) * 1000) for w in r] for r in rows[i]]
            elif n not in missing:
                missing.append(n)
        t = texts[i]
        data = {"probe": t["probe"], "tokens": t["tokens"], "heads": heads, "labels": labels}
        out.append(
            {
                "probe": t["probe"],
                "n_tokens": len(t["tokens"]),
                "data": json.dumps(data, separators=(",", ":")).replace("</", "<\\/"),
            }
        )
    return {"layer": layer, "texts": out, "missing": missing}
