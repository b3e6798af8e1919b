"""KV plans as DuoAttention's attention-pattern files, for tools outside headmech.

DuoAttention (Xiao et al. 2024) and NVIDIA's kvpress (``DuoAttentionPress``) read a head
pattern from a folder: ``full_attention_heads.tsv``, one line per layer and one
tab-separated value per KV head (1: a retrieval head, full cache; 0: a streaming head,
sinks and a recent window), and ``config.json`` with ``sink_size`` and ``recent_size``.
DuoAttention makes the lowest-valued heads streaming at a sparsity (kvpress:
``head_compression_ratio``); written here with the ``sparsity`` ``1 - n_full / n_kv``,
which gives back exactly the plan (tests/test_kv_duo.py, on kvpress's own parsing).

References:
    Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval
    and Streaming Heads", arXiv:2410.10819.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from headmech.core.errors import InputError
from headmech.kv.budget import positive_int
from headmech.kv.plan import KVPlan

__all__ = ["read_pattern", "write_pattern"]

HEADS_FILE = "full_attention_heads.tsv"
CONFIG_FILE = "config.json"


def write_pattern(
    plan: KVPlan, folder: str | os.PathLike, *, sink: int | None = None, recent: int | None = None
) -> Path:
    """Write ``plan`` into ``folder`` as DuoAttention's pattern: :data:`HEADS_FILE` (1 for
    a full KV head, 0 for a windowed one) and :data:`CONFIG_FILE` with ``sink_size`` and
    ``recent_size`` (default the plan's ``sinks`` and ``window``), the ``sparsity`` that
    selects exactly these heads, and the plan's summary under ``headmech``. Returns the
    folder."""
    sink_size = int(plan.sinks if sink is None else sink)
    recent_size = int(plan.window if recent is None else recent)
    positive_int(sink_size, "sink", 0)
    positive_int(recent_size, "recent", 1)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rows = ["\t".join("1" if f else "0" for f in row) for row in plan.full.tolist()]
    (out / HEADS_FILE).write_text("\n".join(rows) + "\n")
    config = {
        "sink_size": sink_size,
        "recent_size": recent_size,
        "sparsity": 1 - plan.n_full / plan.full.numel(),
        "headmech": {
            "model": plan.model, "n_heads": plan.n_heads, "n_full": plan.n_full,
            "source": plan.source,
        },
    }  # fmt: skip
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    return out


def read_pattern(
    folder: str | os.PathLike, n_heads: int, *, threshold: float = 0.5, model: str = "model"
) -> KVPlan:
    """A plan from DuoAttention's pattern files: KV heads whose value in :data:`HEADS_FILE`
    is at least ``threshold`` keep the whole cache, the others ``sink_size`` +
    ``recent_size`` of :data:`CONFIG_FILE`. ``n_heads``: query heads per layer (the file
    has one column per KV head). A folder without a readable pattern is an
    :class:`~headmech.core.errors.InputError` (one line)."""
    path = Path(folder)
    try:
        lines = (path / HEADS_FILE).read_text().split("\n")
        values = [[float(v) for v in ln.split("\t")] for ln in lines if ln.strip()]
        config = json.loads((path / CONFIG_FILE).read_text())
        sinks, window = int(config["sink_size"]), int(config["recent_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path} holds no DuoAttention pattern: {e}") from e
    if not values or len({len(r) for r in values}) != 1:
        raise InputError(f"{path}/{HEADS_FILE} is not a layers x KV heads table")
    full = torch.tensor(values) >= threshold
    source = {"kind": "duo_attention", "folder": str(path), "threshold": threshold}
    return KVPlan(full, n_heads, sinks, window, model, source)
