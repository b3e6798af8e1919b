"""A model spread over CPU and disk by accelerate (``max_memory`` forcing disk offload of
some layers) gives the same catalog, importance scores and weights hash as the same
weights loaded whole."""

from __future__ import annotations

import pytest
import torch

import headmech
from headmech.attribution import importance
from headmech.core.errors import HeadmechError, InputError
from headmech.core.registry import METHODS
from headmech.models.toys import ToyInductionConfig, _build_model, make_toy_tokenizer
from headmech.probes import ProbeOptions
from headmech.runs.provenance import weights_hash

OPTS = ProbeOptions(n_sequences=8, half_len=16, batch_size=4)


@pytest.fixture(scope="module")
def plain_and_offloaded(tmp_path_factory):
    """A random 4-layer toy-induction-shaped model (small vocabulary, so the layers are
    most of its bytes), loaded whole and with 60% of its bytes as the CPU budget."""
    cfg = ToyInductionConfig(n_layers=4)
    folder = tmp_path_factory.mktemp("offload") / "toy4"
    _build_model(cfg).save_pretrained(folder)
    make_toy_tokenizer(cfg.vocab_size).save_pretrained(folder)
    plain = headmech.load_model(str(folder))
    size = sum(p.numel() * p.element_size() for p in plain.parameters())
    off = headmech.load_model(str(folder), max_memory={"cpu": int(0.6 * size)})
    return plain, off


def test_max_memory_offloads_layers_to_disk(plain_and_offloaded):
    _, off = plain_and_offloaded
    placed = off.original_model.hf_device_map
    assert "disk" in placed.values() and "cpu" in placed.values(), placed
    assert any(k.startswith("model.layers.") and v == "disk" for k, v in placed.items())


def test_offloaded_model_hashes_like_the_whole_one(plain_and_offloaded):
    plain, off = plain_and_offloaded
    assert weights_hash(off) == weights_hash(plain)


def test_offloaded_catalog_equals_plain(plain_and_offloaded):
    plain, off = plain_and_offloaded
    kw = {"n_sequences": 8, "half_len": 16}
    a = headmech.classify(plain, ["induction", "duplicate_token"], **kw)
    b = headmech.classify(off, ["induction", "duplicate_token"], **kw)
    for name in a.types:
        torch.testing.assert_close(b[name].score, a[name].score, atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", METHODS.names())
def test_offloaded_importance_equals_plain(plain_and_offloaded, method):
    plain, off = plain_and_offloaded
    if method in ("dla", "lrp"):  # they read weights between passes: refused, one line
        with pytest.raises(HeadmechError, match="does not support offloaded models"):
            importance(off, method, "induction", probe_options=OPTS)
        return
    a = importance(plain, method, "induction", probe_options=OPTS)
    b = importance(off, method, "induction", probe_options=OPTS)
    torch.testing.assert_close(b.score, a.score, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bad", ["cpu", "cpu=", "=2GiB", ","])
def test_bad_max_memory_is_one_line(bad):
    with pytest.raises(InputError, match="expected DEVICE=SIZE"):
        headmech.load_model("toy-induction", max_memory=bad)


def test_cli_max_memory_offloads_and_matches(plain_and_offloaded, tmp_path):
    import json

    from headmech.cli import main

    folder = plain_and_offloaded[0].original_model.name_or_path
    args = ["classify", folder, "--types", "induction", "--n-sequences", "8"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    off = ["--max-memory", "cpu=800KB", "--offload-folder", str(tmp_path / "shards")]
    assert main([*args, "--out", str(tmp_path / "b"), *off]) == 0
    assert any((tmp_path / "shards").iterdir())  # weights went to disk
    a, b = (json.loads((tmp_path / d / "catalog.json").read_text()) for d in ("a", "b"))
    assert a["types"]["induction"]["score"] == b["types"]["induction"]["score"]
    assert a["provenance"]["model"] == b["provenance"]["model"]
