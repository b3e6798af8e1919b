"""One head's attention on any text in a notebook: :func:`show`.

The same token view as the atlas's head pages (:mod:`headmech.publish.attention_view`),
with what the head writes there on a decoder (:mod:`headmech.attribution.writes`), as HTML a
notebook displays (:class:`HeadView`); ``headmech.show`` is this function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from headmech.core.errors import InputError
from headmech.publish.examples import record_examples

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = ["HeadView", "show"]


def show(model: TransformerBridge, head: Any, text: str | None = None) -> Any:
    """One head's attention on ``text`` (default: the model's example texts) as an
    interactive token view in a notebook (rendered as ``IPython.display.HTML`` is): hover or
    click a token to see its weights; under it, on a decoder, what the head writes there
    (:mod:`headmech.attribution.writes`).

    Args:
        model: a model from :func:`headmech.load_model`.
        head: ``(layer, head)``, a :class:`~headmech.HeadIndex` or ``"L1H0"``.
        text: the text to run (with the model's special tokens).

    Returns:
        A :class:`HeadView`: a notebook displays it (its ``_repr_html_``), ``.data`` is the HTML.
    """
    from headmech.core.head_index import check_heads
    from headmech.publish.attention_view import view_html
    from headmech.publish.site.writes_view import WRITES_CSS, writes_html

    (h,) = check_heads([head], int(model.cfg.n_layers), int(model.cfg.n_heads), "show")
    if text is not None and not text.strip():
        raise InputError("show() needs a non-empty text")
    texts = None
    if text is not None:
        texts = [("text", model.tokenizer(text, add_special_tokens=True)["input_ids"])]
    data = record_examples(model, [h], texts)
    writes = data.get("writes", {}).get(str(h)) or [None] * len(data["texts"])
    parts = [
        view_html(
            t["tokens"], rows, title=f"{h} on {t['probe']}", view_id=f"hm-{h}-{i}", inline=True
        )
        + writes_html(t["tokens"], w)
        for i, (t, rows, w) in enumerate(
            zip(data["texts"], data["heads"][str(h)], writes, strict=True)
        )
    ]
    style = f"<style>{WRITES_CSS}</style>" if any(writes) else ""
    return HeadView(style + "".join(parts))


class HeadView:
    """HTML that a notebook displays as it is (as ``IPython.display.HTML`` does, without
    needing IPython)."""

    def __init__(self, data: str) -> None:
        self.data = data

    def _repr_html_(self) -> str:
        return self.data

    def __repr__(self) -> str:
        return f"<HeadView: {len(self.data)} characters of HTML>"
