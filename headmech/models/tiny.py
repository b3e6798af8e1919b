"""One builder of tiny random models, for the library, the tests and the benchmarks.

:func:`tiny_hf` initialises a model of any architecture family of
:mod:`headmech.models.families` with a fixed seed (any size: ``d_model``, ``n_layers``,
``n_heads``, ``n_kv_heads``, ``d_mlp``, ``n_ctx``; any config field), with a small
byte-level BPE tokenizer trained offline or the caller's; :func:`build_tiny` saves it as a
Hugging Face folder, so that :func:`headmech.load_model` loads it like any local model, and
:func:`tiny_model` returns it loaded, a ``TransformerBridge`` with its tokenizer."""

from __future__ import annotations

import functools
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headmech.core.errors import UnsupportedModelError
from headmech.core.scratch import scratch_folder
from headmech.models.families import INIT, N_CTX, VOCAB_SIZE, family_spec, unsupported

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.models.families import Family

__all__ = ["build_tiny", "save_tiny", "tiny_hf", "tiny_model", "tiny_tokenizer"]


@functools.lru_cache(maxsize=2)
def _tokenizer_json(causal: bool) -> str:
    """A byte-level BPE of :data:`VOCAB_SIZE` tokens trained on the CPython documentation's
    text (shipped with Python, so offline and fixed), as ``tokenizer.json``."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = ["<bos>", "<eos>", "<pad>"] if causal else ["[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((topics[k] for k in sorted(topics)), trainer=trainer)
    first, last = special[0], special[1]
    single = f"{first} $A" if causal else f"{first} $A {last}"
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=single,
                special_tokens=[(first, tok.token_to_id(first)), (last, tok.token_to_id(last))],
            ),
        ]
    )
    return str(tok.to_str())


def tiny_tokenizer(causal: bool = True) -> Any:
    """The tiny models' tokenizer: byte-level BPE, :data:`VOCAB_SIZE` tokens, reading any
    English text. Decoders: ``<bos>`` first (``<eos>``, ``<pad>``); encoders: ``[CLS] ...
    [SEP]`` (``[PAD]``, ``[MASK]``).

    Returns:
        A ``PreTrainedTokenizerFast`` that round-trips through ``save_pretrained``.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_tokenizer_json(causal))
    if causal:
        names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
        names["unk_token"] = "<eos>"  # else Qwen2's tokenizer class adds one of its own
    else:
        names = {
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "mask_token": "[MASK]",
            "unk_token": "[PAD]",
        }
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=N_CTX, **names)


def _size_fields(family: str, names: dict[str, str], sizes: dict[str, int | None]) -> dict:
    """The config fields the given sizes set (``names``: size -> the family's field)."""
    fields = {}
    for size, value in sizes.items():
        if value is None:
            continue
        if size not in names:
            raise UnsupportedModelError(f"architecture family '{family}' has no {size}")
        fields[names[size]] = value
    return fields


def _config_fields(fam: Family, tok: Any, vocab: int, fields: dict[str, Any]) -> dict[str, Any]:
    """A tiny model's config fields: the vocabulary, architecture and the tokenizer's
    special token ids, then the family's own fields, then ``fields`` (which win)."""
    special = {
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id if fam.causal else None,
        "eos_token_id": tok.eos_token_id if fam.causal else None,
    }
    return {
        "vocab_size": vocab,
        "architectures": [fam.architecture],
        **special,
        **fam.kwargs,
        **fields,
    }


def tiny_hf(
    family: str = "llama",
    *,
    seed: int | None = 0,
    tokenizer: Any = None,
    init: float = INIT,
    d_model: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    d_mlp: int | None = None,
    n_ctx: int | None = None,
    **config: Any,
) -> tuple[Any, Any]:
    """A family's tiny random Hugging Face model and its tokenizer: the one builder of
    tiny models (the tests', the conformance matrix's, the benchmarks').

    Args:
        family: a key of :data:`FAMILIES`.
        seed: seeds the weights, the caller's random stream left as it was; None: drawn
            from the global generator as it stands (advancing it).
        tokenizer: the tokenizer (its length is the vocabulary); default
            :func:`tiny_tokenizer` (:data:`VOCAB_SIZE` tokens).
        init: the weights' standard deviation (``initializer_range``); transformers'
            own is 0.02.
        d_model, n_layers, n_heads, n_kv_heads, d_mlp, n_ctx: sizes (None: the family's;
            :attr:`Family.sizes` names the config field each sets).
        **config: any other config field (they win over the family's, the sizes and the
            tokenizer's special token ids, which are set by default).

    Returns:
        ``(model, tokenizer)``: the model in float32 with eager attention.

    Raises:
        UnsupportedModelError: an unknown family, one the installed transformers or
            TransformerLens does not support, or a size the family has no field for.
    """
    import transformers

    fam = family_spec(family)
    if (reason := unsupported(family)) is not None:
        raise UnsupportedModelError(f"architecture family '{family}': {reason}")
    tok = tiny_tokenizer(fam.causal) if tokenizer is None else tokenizer
    sizes = {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads,
             "n_kv_heads": n_kv_heads, "d_mlp": d_mlp, "n_ctx": n_ctx}  # fmt: skip
    fields = _size_fields(family, fam.sizes, sizes) | {"initializer_range": init} | config
    vocab = VOCAB_SIZE if tokenizer is None else len(tok)
    hf_config = getattr(transformers, fam.config)(**_config_fields(fam, tok, vocab, fields))
    auto = transformers.AutoModelForCausalLM if fam.causal else transformers.AutoModelForMaskedLM
    # HF initialises weights from the global generator
    with torch.random.fork_rng() if seed is not None else nullcontext():
        if seed is not None:
            torch.manual_seed(seed)
        model = auto.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    return model, tok


def save_tiny(model: Any, tokenizer: Any, folder: str | Path) -> Path:
    """Save a model and its tokenizer as a Hugging Face folder (created); returns it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards"
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny(family: str, folder: str | Path, seed: int | None = 0, **options: Any) -> Path:
    """Build a family's tiny random model (:func:`tiny_hf`) and save it with its tokenizer.

    Args:
        family: a key of :data:`FAMILIES`.
        folder: where the Hugging Face folder goes (created).
        seed: seeds the weights (the global torch generator is left as it was).
        **options: :func:`tiny_hf`'s (``tokenizer``, ``init``, sizes, config fields).

    Returns:
        ``folder``, loadable by :func:`headmech.load_model`.

    Raises:
        UnsupportedModelError: an unknown family, or one the installed transformers or
            TransformerLens does not support (one line naming which).
    """
    import transformers

    model, tokenizer = tiny_hf(family, seed=seed, **options)
    folder = save_tiny(model, tokenizer, folder)
    if options.get("tokenizer") is None:
        loaded = len(transformers.AutoTokenizer.from_pretrained(folder))  # the family's class
        if loaded > VOCAB_SIZE:
            raise UnsupportedModelError(
                f"architecture family '{family}': its tokenizer class reads {loaded} tokens, "
                f"more than the {VOCAB_SIZE} embeddings"
            )
    return folder


def tiny_model(
    family: str = "llama",
    folder: str | Path | None = None,
    *,
    seed: int | None = 0,
    name: str | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    **options: Any,
) -> TransformerBridge:
    """A family's tiny random model as the library takes it: a ``TransformerBridge`` with
    its tokenizer (:func:`build_tiny`, then :func:`headmech.load_model`).

    Args:
        family: a key of :data:`FAMILIES`.
        folder: where the Hugging Face folder goes (its name is the model's); default a
            new temporary folder ``headmech-<name>-*`` (``name`` default ``tiny-<family>``).
        seed: seeds the weights (None: the global generator, advanced).
        device, dtype: as :func:`headmech.load_model` takes them.
        **options: :func:`tiny_hf`'s (``tokenizer``, ``init``, sizes, config fields).
    """
    from headmech.models import load_model

    if folder is None:
        folder = scratch_folder(f"headmech-{name or f'tiny-{family}'}-")  # removed at exit
    path = build_tiny(family, folder, seed=seed, **options)
    return load_model(str(path), device=device, dtype=dtype)


# --- the conformance matrix's page -------------------------------------------------------

# the generated part of docs/families.md lies between these lines; the prose around is kept
