"""KV plans written as DuoAttention's pattern files (:mod:`headmech.kv.duo`): the
format DuoAttention's ``load_attn_pattern`` and kvpress's ``DuoAttentionPress`` read
(``full_attention_heads.tsv``: layers x KV heads, tab-separated; ``config.json``: sink and
recent sizes), read back as the same plan, and the streaming heads kvpress would choose at
the written sparsity are the plan's windowed heads."""

from __future__ import annotations

import json
from io import StringIO

import numpy as np
import pytest
import torch

from headmech.core.errors import InputError
from headmech.kv import KVPlan
from headmech.kv.duo import read_pattern, write_pattern


def _plan() -> KVPlan:
    full = torch.tensor([[True, False], [False, False], [True, True]])
    return KVPlan(full, 4, sinks=4, window=300, model="tiny", source={"kind": "importance"})


def test_duo_attention_files_hold_the_plan(tmp_path):
    folder = write_pattern(_plan(), tmp_path / "duo")
    assert (folder / "full_attention_heads.tsv").read_text() == "1\t0\n0\t0\n1\t1\n"
    config = json.loads((folder / "config.json").read_text())
    assert (config["sink_size"], config["recent_size"]) == (4, 300)
    assert config["sparsity"] == pytest.approx(0.5)
    assert config["headmech"]["n_full"] == 3 and config["headmech"]["model"] == "tiny"


def test_duo_attention_sizes_can_differ_from_the_plan(tmp_path):
    folder = write_pattern(_plan(), tmp_path, sink=64, recent=256)
    config = json.loads((folder / "config.json").read_text())
    assert (config["sink_size"], config["recent_size"]) == (64, 256)
    with pytest.raises(InputError):
        write_pattern(_plan(), tmp_path / "bad", recent=0)


def test_duo_attention_round_trip(tmp_path):
    plan = _plan()
    back = read_pattern(write_pattern(plan, tmp_path), n_heads=4, model="tiny")
    assert torch.equal(back.full, plan.full)
    assert (back.sinks, back.window, back.n_heads) == (plan.sinks, plan.window, plan.n_heads)
    assert back.kv_fraction(4096) == pytest.approx(plan.kv_fraction(4096))


def test_kvpress_reading_chooses_the_plans_windowed_heads(tmp_path):
    """kvpress 0.5.5 parses the pattern with ``np.loadtxt(..., delimiter="\\t")``, clips it
    to [0, 1] and makes the ``round(size * head_compression_ratio)`` lowest heads
    streaming (``np.argsort``): at the written sparsity, exactly the windowed heads."""
    plan = _plan()
    folder = write_pattern(plan, tmp_path)
    text = (folder / "full_attention_heads.tsv").read_text()
    scores = np.clip(np.loadtxt(StringIO(text), dtype=float, delimiter="\t"), 0, 1)
    assert scores.shape == (plan.n_layers, plan.n_kv_heads)
    ratio = json.loads((folder / "config.json").read_text())["sparsity"]
    n_pruned = round(scores.size * ratio)
    streaming = np.zeros(scores.shape, dtype=bool)
    streaming[np.unravel_index(np.argsort(scores, axis=None)[:n_pruned], scores.shape)] = True
    assert np.array_equal(streaming, ~plan.full.numpy())


def test_duo_attention_folder_errors(tmp_path):
    with pytest.raises(InputError, match="no DuoAttention pattern"):
        read_pattern(tmp_path, n_heads=4)
    (tmp_path / "full_attention_heads.tsv").write_text("1\t0\n1\n")
    (tmp_path / "config.json").write_text('{"sink_size": 4, "recent_size": 8}')
    with pytest.raises(InputError, match="layers x KV heads"):
        read_pattern(tmp_path, n_heads=4)
