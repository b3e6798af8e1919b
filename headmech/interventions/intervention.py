"""Interventions as TransformerLens hooks, and captures of activations.

The only module (besides :mod:`headmech.stream.engine`'s reducers) that registers hook
functions: :func:`hooks` turns variants of interventions into ``fwd_hooks``,
:func:`recording` and :func:`capture` read activations.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from headmech.core.errors import HeadIndexError, HeadmechError
from headmech.core.head_index import HeadIndex, check_heads
from headmech.core.placement import model_device
from headmech.interventions.effects import SITES, Context, Effect, Uniform, heads_first
from headmech.models.loaded import loaded
from headmech.stream.engine import ProbeBatch, run_blocks

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "Intervention",
    "applied",
    "capture",
    "capture_z",
    "hooks",
    "mean_outputs",
    "pattern_edits_apply",
    "recording",
]

Hook = tuple[str, Callable[..., Any]]


@dataclass(frozen=True)
class Intervention:
    """``effect`` applied to ``heads`` at ``site`` (at position ``pos`` only, if given)."""

    heads: tuple[HeadIndex, ...]
    effect: Effect
    site: str = "z"
    pos: int | None = None

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise HeadmechError(f"unknown site '{self.site}' (have: {', '.join(SITES)})")
        if self.site not in self.effect.sites:
            raise HeadmechError(
                f"{type(self.effect).__name__} is not defined on site '{self.site}' "
                f"(only {', '.join(self.effect.sites)})"
            )
        heads = check_heads(self.heads, None, None, what="Intervention")  # pairs, none negative
        object.__setattr__(self, "heads", tuple(heads))

    @classmethod
    def on(
        cls,
        heads: Iterable[HeadIndex | Sequence[int] | str] | str,
        effect: Effect,
        site: str = "z",
        pos: int | None = None,
    ) -> Intervention:
        """Build from any iterable of heads: ``(layer, head)`` pairs, :class:`HeadIndex`
        es or ``"L18H6"`` strings (:func:`~headmech.core.head_index.check_heads`)."""
        return cls(tuple(check_heads(heads, None, None, what="Intervention")), effect, site, pos)

    @classmethod
    def all_heads(cls, model: TransformerBridge, effect: Effect, site: str = "z") -> Intervention:
        """``effect`` on every head of every layer."""
        n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
        heads = [HeadIndex(la, h) for la in range(n_layers) for h in range(n_heads)]
        return cls(tuple(heads), effect, site)

    def by_layer(self) -> dict[int, Tensor]:
        """Layer → the selected head indices (sorted, unique)."""
        out: dict[int, set[int]] = {}
        for layer, head in self.heads:
            out.setdefault(layer, set()).add(head)
        return {la: torch.tensor(sorted(hs)) for la, hs in sorted(out.items())}


def _is_causal(model: TransformerBridge) -> bool:
    return getattr(model.cfg, "attention_dir", "causal") != "bidirectional"


def hooks(
    model: TransformerBridge | None,
    variants: Sequence[Sequence[Intervention]] | Sequence[Intervention],
    *,
    strict: bool = True,
) -> list[Hook]:
    """TransformerLens ``fwd_hooks`` applying interventions.

    Args:
        model: the bridge the hooks are for (may be None when no intervention acts on
            the pattern: only pattern effects need to know the model's masking).
        variants: a list of interventions (one variant: the hooks work for any batch), or
            a list of variants for a batch stacked ``len(variants)`` times (variant ``i``
            acts on copy ``i``).
        strict: refuse pattern interventions on a bridge that ignores pattern edits
            (``False`` when only hooked statistics need to see the edit).

    Returns:
        ``(hook_name, fn)`` pairs for ``model.hooks(fwd_hooks=...)``.
    """
    as_variants = _as_variants(variants)
    groups: dict[tuple[str, int], list[tuple[int, Intervention, Tensor]]] = {}
    gated: set[int] = set()
    shape = None if model is None else (int(model.cfg.n_layers), int(model.cfg.n_heads))
    for i, ivs in enumerate(as_variants):
        for iv in ivs:
            for layer, idx in iv.by_layer().items():
                if shape is not None and (layer >= shape[0] or int(idx.max()) >= shape[1]):
                    head = next(h for h in iv.heads if h.layer >= shape[0] or h.head >= shape[1])
                    raise HeadIndexError(
                        f"{type(iv.effect).__name__} intervention on head ({head.layer}, "
                        f"{head.head}): outside the model ({shape[0]} layers x {shape[1]} heads)"
                    )
                groups.setdefault((iv.site, layer), []).append((i, iv, idx))
                if iv.effect.reads_layer_input:
                    gated.add(layer)
    on_pattern = any(site == "pattern" for site, _ in groups)
    if on_pattern and model is None:
        raise ValueError("pattern interventions need the model")
    if strict and on_pattern and not pattern_edits_apply(model):  # type: ignore[arg-type]
        raise HeadmechError(
            "attention-pattern interventions do not reach this model's output: its bridge "
            "ignores edits of hook_pattern; intervene on z (zero, mean, resample) instead"
        )
    ctx = Context(causal=model is None or _is_causal(model))
    out: list[Hook] = [(f"blocks.{la}.hook_in", _input_reader(ctx, la)) for la in sorted(gated)]
    copies = len(as_variants)
    for (site, layer), items in groups.items():
        out.append((f"blocks.{layer}.{SITES[site]}", _edit_hook(site, layer, items, copies, ctx)))
    return out


def _as_variants(
    variants: Sequence[Sequence[Intervention]] | Sequence[Intervention],
) -> list[Sequence[Intervention]]:
    """One list of interventions is one variant; a list of lists is several."""
    if variants and all(isinstance(v, Intervention) for v in variants):
        return [variants]  # type: ignore[list-item]
    return list(variants)  # type: ignore[arg-type]


def _input_reader(ctx: Context, layer: int) -> Callable[..., None]:
    def read(resid: Tensor, *, hook: Any) -> None:
        # resid: [batch, pos, d_model]
        ctx.layer_inputs[layer] = resid

    return read


def _edit_hook(
    site: str, layer: int, items: list[tuple[int, Intervention, Tensor]], copies: int, ctx: Context
) -> Callable[..., Tensor]:
    def edit(x: Tensor, *, hook: Any) -> Tensor:
        out = x.clone()
        # [copies * batch, ...] -> [copies, batch, heads, ...] (views of out)
        view = heads_first(out, site)
        view = rearrange(view, "(c b) ... -> c b ...", c=copies)
        for i, iv, idx in items:
            sel = view[i, :, idx.to(x.device)]
            if iv.pos is None:
                view[i, :, idx.to(x.device)] = iv.effect.apply(sel, layer, idx, ctx)
            else:  # one token (z, q, k, v) or query (pattern) position
                p = slice(iv.pos, (iv.pos + 1) or None)
                sel[:, :, p] = iv.effect.apply(sel, layer, idx, ctx)[:, :, p]
                view[i, :, idx.to(x.device)] = sel
        return out

    return edit


@contextlib.contextmanager
def applied(
    model: TransformerBridge,
    variants: Sequence[Sequence[Intervention]] | Sequence[Intervention],
    *,
    strict: bool = True,
) -> Iterator[TransformerBridge]:
    """Run the model with interventions: ``with applied(model, [Intervention.on(heads,
    Zero())]): model(tokens)`` (arguments as :func:`hooks`)."""
    with model.hooks(fwd_hooks=hooks(model, variants, strict=strict)):
        yield model


def pattern_edits_apply(model: TransformerBridge) -> bool:
    """Whether an edited ``hook_pattern`` changes the model's output.

    Some bridges (BERT's) let the wrapped Hugging Face attention consume the original
    pattern and discard hook edits; pattern interventions cannot work there.
    """
    record = loaded(model)
    cached = record.pattern_edits_apply
    if cached is not None:
        return bool(cached)
    ids = torch.tensor([[model.tokenizer.bos_token_id or 1, 5, 6, 7, 8]]).clamp(
        max=int(model.cfg.d_vocab) - 1
    )
    ids = ids.to(model_device(model))
    heads = [(0, h) for h in range(int(model.cfg.n_heads))]
    flat = Intervention.on(heads, Uniform(), "pattern")
    with torch.inference_mode():
        clean = model(ids)
        with warnings.catch_warnings(), applied(model, [flat], strict=False):
            warnings.simplefilter("ignore")
            edited = model(ids)
    ok = not torch.allclose(clean, edited)
    record.pattern_edits_apply = ok
    return ok


# --- reading -------------------------------------------------------------------------


@contextlib.contextmanager
def recording(model: TransformerBridge, names: Sequence[str]) -> Iterator[dict[str, Tensor]]:
    """Record the activations at hook points ``names`` during the forward passes run inside
    the block (the last pass wins); the tensors keep their autograd graph."""
    store: dict[str, Tensor] = {}

    def make(name: str) -> Callable[..., None]:
        def keep(x: Tensor, *, hook: Any) -> None:
            store[name] = x

        return keep

    with model.hooks(fwd_hooks=[(n, make(n)) for n in names]):
        yield store


def capture(
    model: TransformerBridge,
    batch: ProbeBatch,
    names: Sequence[str],
    interventions: Sequence[Intervention] = (),
) -> dict[str, Tensor]:
    """Activations at hook points ``names`` on one batch (no gradient; blocks only), in fp32
    whatever the model's dtype (analysis arithmetic runs in fp32)."""
    dev = model_device(model)
    with torch.no_grad(), applied(model, list(interventions)), recording(model, names) as store:
        run_blocks(model, batch.input_ids.to(dev), batch.attention_mask.to(dev))
    return {k: v.detach().float() for k, v in store.items()}


def capture_z(
    model: TransformerBridge, batch: ProbeBatch
) -> Float[Tensor, "n_layers batch pos n_heads d_head"]:
    """Every head's output ``hook_z`` on one batch (no gradient)."""
    names = [f"blocks.{la}.{SITES['z']}" for la in range(int(model.cfg.n_layers))]
    store = capture(model, batch, names)
    return torch.stack([store[n] for n in names])


def mean_outputs(
    model: TransformerBridge, batches: Iterable[ProbeBatch]
) -> Float[Tensor, "n_layers n_heads d_head"]:
    """Mean ``hook_z`` of every head over the real tokens of a probe (for :class:`Mean`)."""
    cfg = model.cfg
    sums = torch.zeros(int(cfg.n_layers), int(cfg.n_heads), int(cfg.d_head), dtype=torch.float64)
    count = 0
    for batch in batches:
        z = capture_z(model, batch)  # [n_layers, batch, pos, n_heads, d_head]
        real = batch.attention_mask.bool().to(z.device)
        sums += z[:, real].sum(1).double().cpu()  # [n_layers, n_heads, d_head]
        count += int(real.sum())
    return (sums / max(count, 1)).float()
