"""Many KV plans evaluated at once, each layer run once per distinct prefix of plans.

Plans that agree on layers ``0..l-1`` give the same hidden state at the input of layer
``l``: :func:`evaluate_many` runs the plans as a tree over the layers (one branch per
distinct layer plan), so the shared layers are computed once per batch and each plan is
charged only for the layers after its first difference. Every result equals
:func:`~headmech.kv.masks.evaluate` of that plan alone.

What it saves depends on where the plans differ: one-windowed-head plans
(:func:`~headmech.kv.importance.kv_importance`) share every layer before their head's
(about half the work for a deep model), and Gemma 3's plans, which differ only in its
global layers 5, 11 and 17, share layers 0-4 always and each global layer's branch below
it.

A layer is skipped by giving the decoder layer module an identity ``forward`` for the
run (the layers' own order, masks and rotary tables are unchanged); the first layer of a
branch starts from the stored hidden state, and the output of a branch's last layer is
kept before the final norm.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from headmech.core.errors import UnsupportedModelError
from headmech.kv.attention import attention_modules, hf_model, planned
from headmech.kv.masks import KVEval, needle_scores, plan_summary, prose_nll
from headmech.kv.plan import KVPlan
from headmech.stream.engine import ProbeBatch

__all__ = ["evaluate_many", "layer_keys"]

Key = tuple[Any, ...]


def layer_keys(plan: KVPlan | None, n_layers: int) -> list[Key]:
    """Per layer, what decides its computation: which KV heads are full, and the sinks
    and window of the others (nothing when every head is full, as for no plan)."""
    if plan is None:
        return [("full",)] * n_layers
    out: list[Key] = []
    for layer in range(n_layers):
        row = tuple(bool(x) for x in plan.full[layer])
        out.append(("full",) if all(row) else (row, plan.sinks, plan.window))
    return out


def decoder_layers(hf: Any) -> nn.ModuleList:
    """The Hugging Face model's list of decoder layers (the one holding the attention
    modules, in order)."""
    mods = attention_modules(hf)
    for m in hf.base_model.modules():
        if not isinstance(m, nn.ModuleList) or len(m) != len(mods):
            continue
        if all(any(a is x for x in layer.modules()) for layer, a in zip(m, mods, strict=True)):
            return m
    raise UnsupportedModelError(f"{type(hf).__name__}: cannot find its list of decoder layers")


@contextlib.contextmanager
def _segment(
    layers: nn.ModuleList, start: int, stop: int, hidden: Tensor | None, kept: list[Tensor]
) -> Iterator[None]:
    """Only layers ``start..stop-1`` compute; ``start`` takes ``hidden`` (None: the
    embeddings), and ``stop - 1``'s output is appended to ``kept``."""

    def skip(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states

    def first(forward: Any) -> Any:
        def run(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return forward(hidden if hidden is not None else hidden_states, *args, **kwargs)

        return run

    def last(forward: Any) -> Any:
        def run(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            out = forward(hidden_states, *args, **kwargs)
            kept.append(out)
            return out

        return run

    try:
        for i, layer in enumerate(layers):
            if not start <= i < stop:
                layer.forward = skip
                continue
            fwd = layer.forward
            fwd = first(fwd) if i == start else fwd
            layer.forward = last(fwd) if i == stop - 1 else fwd
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def evaluate_many(
    model: Any,
    plans: Sequence[KVPlan | None],
    needle: Sequence[ProbeBatch] = (),
    prose: Sequence[ProbeBatch] = (),
    *,
    progress: bool = False,
) -> list[KVEval]:
    """:func:`~headmech.kv.masks.evaluate` of every plan in ``plans`` (None: the full
    cache), in order, sharing the layers where plans agree. Identical plans are run once.
    ``seconds`` of each result is its share of the total time (the total over the
    distinct plans)."""
    hf = hf_model(model)
    n_layers = len(attention_modules(hf))
    keys = [layer_keys(p, n_layers) for p in plans]
    distinct: dict[tuple[Key, ...], int] = {}
    for i, k in enumerate(keys):
        distinct.setdefault(tuple(k), i)
    reps = sorted(distinct.values())
    context = max((int(b.input_ids.shape[1]) for b in [*needle, *prose]), default=0)
    results = {i: KVEval(plan_summary(plans[i], context)) for i in reps}
    layers = decoder_layers(hf)
    t0 = time.perf_counter()
    with torch.inference_mode():
        _run(model, plans, keys, reps, layers, needle, prose, results, progress)
    for r in results.values():
        r.seconds = (time.perf_counter() - t0) / len(reps)
    return [results[distinct[tuple(k)]] for k in keys]


def _run(
    model: Any,
    plans: Sequence[KVPlan | None],
    keys: list[list[Key]],
    reps: list[int],
    layers: nn.ModuleList,
    needle: Sequence[ProbeBatch],
    prose: Sequence[ProbeBatch],
    results: dict[int, KVEval],
    progress: bool,
) -> None:
    """Every batch through the tree of plans, each plan's scores added to its result."""
    hf = hf_model(model)
    t0 = time.perf_counter()
    for n, batch in enumerate([*needle, *prose]):
        is_needle = n < len(needle)
        for i, hidden in _tree(model, plans, keys, reps, layers, batch):
            if is_needle:
                results[i].trials += needle_scores(hf, batch, hidden)
            else:
                nll, count = prose_nll(hf, batch, hidden)
                results[i].nll_sum += nll
                results[i].n_tokens += count
        if progress:
            print(f"evaluate_many: batch {n + 1}/{len(needle) + len(prose)} "
                  f"({time.perf_counter() - t0:.0f}s)")  # fmt: skip


def _tree(
    model: Any,
    plans: Sequence[KVPlan | None],
    keys: list[list[Key]],
    group: list[int],
    layers: nn.ModuleList,
    batch: ProbeBatch,
) -> Iterator[tuple[int, Tensor]]:
    """``(plan index, final hidden state)`` for each plan of ``group`` on ``batch``."""
    n_layers = len(layers)

    def split(members: list[int], layer: int) -> list[list[int]]:
        out: dict[Key, list[int]] = {}
        for i in members:
            out.setdefault(keys[i][layer], []).append(i)
        return list(out.values())

    def descend(
        members: list[int], start: int, hidden: Tensor | None
    ) -> Iterator[tuple[int, Tensor]]:
        # ``members`` agree on every layer up to ``start`` included
        stop = start + 1
        while stop < n_layers and len({keys[i][stop] for i in members}) == 1:
            stop += 1
        kept: list[Tensor] = []
        dev = next(layers.parameters()).device
        with planned(model, plans[members[0]]) as hf, _segment(layers, start, stop, hidden, kept):
            out = hf.base_model(
                input_ids=batch.input_ids.to(dev),
                attention_mask=batch.attention_mask.to(dev),
                use_cache=False,
            ).last_hidden_state
        if stop == n_layers:
            for i in members:
                yield i, out
            return
        del out  # only the branch point's hidden state is kept while descending
        for sub in split(members, stop):
            yield from descend(sub, stop, kept[0])

    for sub in split(group, 0):
        yield from descend(sub, 0, None)
