"""Per-head statistics and the probe batches they are computed on.

:class:`ProbeBatch` is one padded batch of probe data; :class:`HeadStats` holds named
per-head sums and counts that merge by addition (batches, probes, ranks) and keep
per-sequence sums for resampling. Both are re-exported by :mod:`headmech.stream.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headmech.core.errors import PluginError

__all__ = ["HeadStats", "ProbeBatch"]


@dataclass
class ProbeBatch:
    """One padded batch of probe data (right padding).

    Attributes:
        input_ids: token ids.
        attention_mask: 1 for real tokens, 0 for padding.
        special: True at special tokens (BOS/CLS/SEP/EOS) and padding; such positions are
            excluded as queries and as targets by the built-in reducers.
        extras: probe-specific per-batch data (word ids, repeat offsets, ...).
        tokenizer: the model's tokenizer, which spells :attr:`token_strings` (every probe
            built by :func:`headmech.probes.batch_sequences` sets it; None for a batch built
            by hand without one).
    """

    input_ids: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    special: Bool[Tensor, "batch pos"]
    extras: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = field(default=None, repr=False, compare=False)

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def token_strings(self) -> list[list[str]] | None:
        """Each position's token as the tokenizer spells it (``[batch][pos]``, padding
        included), for head types that pick targets by what a token is: punctuation,
        names, digits. The tokenizer's own strings (``convert_ids_to_tokens``), markers
        included: a byte-level BPE token that starts a word begins with ``Ġ`` (GPT-2,
        LLaMA 3, SmolLM2), a SentencePiece one with ``▁``, a WordPiece continuation with
        ``##``. Spelled once per batch, when first asked for, from the current
        ``input_ids`` (a batch made with ``dataclasses.replace(batch, input_ids=...)``
        spells its own). None when the batch has no :attr:`tokenizer`."""
        if self.tokenizer is None:
            return None
        cached = self.__dict__.get("_token_strings")
        if cached is None or cached[0] is not self.input_ids:
            strings = [self.tokenizer.convert_ids_to_tokens(row) for row in self.input_ids.tolist()]
            cached = self.__dict__["_token_strings"] = (self.input_ids, strings)
        return cached[1]

    def head(self, n: int) -> ProbeBatch:
        """The batch's first ``n`` sequences (tensors and per-sequence lists in extras)."""
        return self.rows(0, n)

    def rows(self, start: int, stop: int) -> ProbeBatch:
        """Sequences ``start .. stop`` of the batch (tensors and per-sequence lists in
        extras cut alike; the padded width kept)."""
        return self.select(torch.arange(start, min(stop, self.input_ids.shape[0])))

    def select(self, index: Tensor) -> ProbeBatch:
        """The sequences ``index`` (positions, or a ``Bool[batch]`` mask) of the batch, in
        that order (tensors and per-sequence lists in extras alike; the padded width kept)."""
        n = self.input_ids.shape[0]
        idx = index.nonzero().flatten() if index.dtype == torch.bool else index.long()

        def pick(v: Any) -> Any:
            if isinstance(v, Tensor) and v.dim() and len(v) == n:
                return v[idx]
            return [v[int(i)] for i in idx] if isinstance(v, list) and len(v) == n else v

        return ProbeBatch(
            pick(self.input_ids), pick(self.attention_mask), pick(self.special),
            {k: pick(v) for k, v in self.extras.items()}, self.tokenizer,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> ProbeBatch:
        """The batch with every tensor on ``device``."""
        return ProbeBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.special.to(device),
            {k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.extras.items()},
            self.tokenizer,
        )


class HeadStats:
    """Named per-head sums and counts, each ``[n_layers, n_heads]`` in float64.

    Sums and counts merge by addition (``a + b``), so statistics from batches, probes or
    machines combine exactly; :meth:`mean` divides at the end. Where reducers give
    per-sequence sums, those are kept too (:meth:`units`), so a score can be recomputed on
    a resample of the probe's sequences (:meth:`resample`; bootstrap intervals).
    """

    def __init__(self, n_layers: int, n_heads: int) -> None:
        self.n_layers = n_layers
        self.n_heads = n_heads
        self._sums: dict[str, Float[Tensor, "n_layers n_heads"]] = {}
        self._counts: dict[str, Float[Tensor, "n_layers n_heads"]] = {}
        # name -> layer -> per batch: (sums [batch, n_heads], counts [batch, n_heads])
        self._units_: dict[str, list[list[tuple[Tensor, Tensor]]]] = {}
        self._stacked: dict[str, tuple[Tensor, Tensor]] = {}  # units(), built once
        # sums added and not yet read: (name, layer, total, count), on their own device
        self._pending: list[tuple[str, int, Tensor, Tensor | float]] = []

    # every read goes through these: the pending sums are moved to the CPU first
    @property
    def sums(self) -> dict[str, Float[Tensor, "n_layers n_heads"]]:
        """Per statistic, the sums ``[n_layers, n_heads]`` (float64, CPU)."""
        self._settle()
        return self._sums

    @sums.setter
    def sums(self, value: dict[str, Tensor]) -> None:
        self._settle()
        self._sums = value

    @property
    def counts(self) -> dict[str, Float[Tensor, "n_layers n_heads"]]:
        """Per statistic, the counts the sums are divided by (float64, CPU)."""
        self._settle()
        return self._counts

    @counts.setter
    def counts(self, value: dict[str, Tensor]) -> None:
        self._settle()
        self._counts = value

    @property
    def _units(self) -> dict[str, list[list[tuple[Tensor, Tensor]]]]:
        self._settle()
        return self._units_

    def _zeros(self) -> Tensor:
        return torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)

    def _settle(self) -> None:
        """Move the pending sums to the CPU (the device's in one transfer: a pass on a GPU
        synchronises once, when its statistics are read, not once per statistic and layer)
        and add them in the order they came."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        tensors = [x for _, _, t, c in pending for x in (t, c) if isinstance(x, Tensor)]
        local: dict[int, Tensor] = {}
        for device in {x.device for x in tensors}:  # one transfer per device
            group = [x for x in tensors if x.device == device]
            flat = torch.cat([x.reshape(-1) for x in group]).cpu()
            for x, part in zip(group, flat.split([x.numel() for x in group]), strict=True):
                local[id(x)] = part.view(x.shape)
        for name, layer, total, count in pending:
            total = local.get(id(total), total)
            if isinstance(count, Tensor):
                count = local.get(id(count), count)
            self._accumulate(name, layer, total, count)

    def add(self, name: str, layer: int, total: Tensor, count: Tensor | float) -> None:
        """Add one layer's sums ``total`` — per sequence ``[batch, n_heads]``, or
        ``[n_heads]`` — and their ``count`` (``[batch]``, ``[batch, n_heads]``, ``[n_heads]``
        or a scalar)."""
        if (
            not isinstance(total, Tensor)
            or total.dim() not in (1, 2)
            or total.shape[-1] != self.n_heads
        ):
            got = tuple(total.shape) if isinstance(total, Tensor) else type(total).__name__
            raise PluginError(
                f"statistic '{name}' of layer {layer}: its reducer returned sums of shape {got}; "
                f"expected [batch, n_heads] or [n_heads] (n_heads = {self.n_heads})"
            )
        # a copy in float64 where the sums are (no synchronisation: the move to the CPU
        # waits until they are read, :meth:`_settle`)
        total = total.detach().to(torch.float64, copy=True)
        if isinstance(count, Tensor):
            count = count.detach().to(torch.float64, copy=True)
        self._pending.append((name, layer, total, count))

    def _accumulate(self, name: str, layer: int, total: Tensor, count: Tensor | float) -> None:
        if name not in self._sums:
            self._sums[name] = self._zeros()
            self._counts[name] = self._zeros()
        if total.dim() == 2:  # per sequence
            c = torch.as_tensor(count, dtype=torch.float64)
            c = (c[:, None] if c.dim() == 1 else c).expand_as(total)
            rows = self._units_.setdefault(name, [[] for _ in range(self.n_layers)])
            rows[layer].append((total, c))
            self._stacked.pop(name, None)
            total, count = total.sum(0), c.sum(0)
        self._sums[name][layer] += total
        self._counts[name][layer] += count

    def units(self, name: str) -> tuple[Tensor, Tensor] | None:
        """Per-sequence sums and counts ``[n_units, n_layers, n_heads]`` of a statistic, or
        None where its reducer gave only totals (layers it did not see are zero)."""
        rows = self._units.get(name)
        if rows is None:
            return None
        if name in self._stacked:
            return self._stacked[name]
        n_units = max(sum(t.shape[0] for t, _ in layer) for layer in rows)
        sums = torch.zeros(n_units, self.n_layers, self.n_heads, dtype=torch.float64)
        counts = torch.zeros_like(sums)
        for la, layer in enumerate(rows):
            if layer:
                sums[:, la] = torch.cat([t for t, _ in layer])
                counts[:, la] = torch.cat([c for _, c in layer])
        self._stacked[name] = (sums, counts)
        return sums, counts

    @property
    def n_units(self) -> int:
        """Sequences with per-sequence statistics (0: none kept)."""
        names = list(self._units)
        return 0 if not names else int(self.units(names[0])[0].shape[0])  # type: ignore[index]

    def resample(self, weights: Float[Tensor, " n_units"]) -> HeadStats:
        """The statistics of a reweighted probe (bootstrap: how often each sequence is
        drawn); statistics without per-sequence sums are kept as they are."""
        out = HeadStats(self.n_layers, self.n_heads)
        w = weights.to(torch.float64)
        for name in self.sums:
            unit = self.units(name)
            if unit is None:
                out.sums[name], out.counts[name] = self.sums[name], self.counts[name]
            else:
                out.sums[name] = torch.einsum("u,ulh->lh", w, unit[0])
                out.counts[name] = torch.einsum("u,ulh->lh", w, unit[1])
        return out

    def set(self, name: str, value: Float[Tensor, "n_layers n_heads"]) -> None:
        """Store a per-head value computed once (from weights), with count 1."""
        self.sums[name] = value.detach().to("cpu", torch.float64).clone()
        self.counts[name] = torch.ones_like(self.sums[name])

    def mean(self, name: str) -> Float[Tensor, "n_layers n_heads"]:
        """Sum / count; NaN where a head saw no query for this statistic."""
        if name not in self.sums:
            raise KeyError(f"no statistic '{name}' (have: {', '.join(sorted(self.sums))})")
        return (self.sums[name] / self.counts[name]).float()

    def __contains__(self, name: str) -> bool:
        return name in self.sums

    def __add__(self, other: HeadStats) -> HeadStats:
        if (self.n_layers, self.n_heads) != (other.n_layers, other.n_heads):
            raise ValueError("cannot merge statistics of models of different shapes")
        out = HeadStats(self.n_layers, self.n_heads)
        for src in (self, other):
            for k in src.sums:
                if k not in out.sums:
                    out.sums[k], out.counts[k] = out._zeros(), out._zeros()
                out.sums[k] += src.sums[k]
                out.counts[k] += src.counts[k]
            for k, rows in src._units.items():
                mine = out._units.setdefault(k, [[] for _ in range(out.n_layers)])
                for la, layer in enumerate(rows):
                    mine[la] += layer
                out._stacked.pop(k, None)
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """Flat tensors for ``safetensors.torch.save_file``."""
        return {
            **{f"sum/{k}": v for k, v in self.sums.items()},
            **{f"count/{k}": v for k, v in self.counts.items()},
        }

    def __repr__(self) -> str:
        return f"HeadStats({self.n_layers}x{self.n_heads}: {', '.join(sorted(self.sums))})"
