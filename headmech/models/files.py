"""Model folders on disk: the cache, checks of a Hugging Face folder without loading it,
and loading one offline.

:mod:`headmech.models` resolves names (bundled, toy, a folder) and wraps the loaded model
in a ``TransformerBridge``; :mod:`headmech.models.bundled` and :mod:`headmech.models.toys` build their
folders in :func:`cache_dir` (``$HEADMECH_CACHE``, ``~/.cache/headmech``) and load them
with :func:`load_hf_dir`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from headmech.core.checks import warn
from headmech.core.errors import InputError, UnsupportedModelError

__all__ = [
    "cache_dir",
    "file_problem",
    "hf_dir_problem",
    "load_hf_dir",
    "quiet",
    "repair_cache_folder",
]


def cache_dir() -> Path:
    """The folder for dequantised weights and trained toy models (``$HEADMECH_CACHE``)."""
    env = os.environ.get("HEADMECH_CACHE")
    if env:
        path = Path(env).expanduser()
    else:
        from platformdirs import user_cache_dir

        path = Path(user_cache_dir("headmech"))
    for p in (path, *path.parents):  # the nearest existing part must be a folder
        if p.exists():
            if not p.is_dir():
                raise InputError(
                    f"the model cache {path} cannot be a folder: {p} is a file "
                    "(set $HEADMECH_CACHE to a folder)"
                )
            break
    return path


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file's header (8-byte length, JSON) checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n)) if 8 + n <= size else None
    if not isinstance(header, dict):
        return "no safetensors header: truncated, or not a safetensors file"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    end = 8 + n + max(ends, default=0)
    return None if end == size else f"{size} bytes where its header promises {end}"


def file_problem(path: Path) -> str | None:
    """Why a weight or JSON file of a model folder cannot be read, or None. Cheap: a
    safetensors header and size, a ``.bin`` file's zip directory, a JSON parse (a big JSON
    file, ``tokenizer.json``, only its two ends)."""
    try:
        if path.suffix == ".safetensors":
            return _safetensors_problem(path)
        if path.suffix == ".bin" and not zipfile.is_zipfile(path):
            return "not a PyTorch zip archive (truncated, or saved by PyTorch < 1.6)"
        data = path.read_bytes().strip() if path.suffix == ".json" else b"{}"
        if len(data) > 1_000_000:
            return None if data[:1] + data[-1:] == b"{}" else "truncated JSON"
        return None if isinstance(json.loads(data), dict) else "not a JSON object"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__


def hf_dir_problem(path: str | os.PathLike) -> str | None:
    """Why a Hugging Face model folder cannot load (no or unreadable ``config.json``, no
    weights, a truncated or garbage weight file), naming the file; None if it looks fine."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        return f"{folder / 'config.json'} is missing"
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not weights:
        return f"{folder} holds no weight file (*.safetensors or *.bin)"
    names = ("config.json", "tokenizer.json", "tokenizer_config.json")
    for f in [folder / n for n in names if (folder / n).is_file()] + weights:
        if (problem := file_problem(f)) is not None:
            return f"{f} is corrupt or truncated ({problem})"
    return None


def repair_cache_folder(folder: Path, rebuild: str) -> None:
    """If a cached model folder exists but is corrupt, warn (one line naming the bad file)
    and delete it, so that the next load rebuilds it (``rebuild`` says how)."""
    if folder.exists() and (problem := hf_dir_problem(folder)) is not None:
        warn(f"cached model: {problem}; deleting {folder} and {rebuild}")
        shutil.rmtree(folder)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence transformers' progress bars and load reports on stderr."""
    # imported first: transformers' first import sets its logger's level (to WARNING), which
    # would undo ours, and the load report of MiniLM's absent masked-LM head (which
    # headmech replaces: bundled.load_minilm) would be printed as if it were an error
    from transformers.utils import logging as hf_logging

    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.getLogger("transformers").setLevel(level)


def _bos_keywords(path: Path) -> dict[str, Any]:
    """``add_bos_token=True`` where the folder's tokenizer names a BOS token: the bridge
    (TransformerLens' ``get_tokenizer_with_bos``) otherwise loads the tokenizer a second
    time with it (Gemma 3's 262k-token vocabulary: 4 s a load); with it set, the bridge
    keeps this one, which encodes alike (tests/test_models.py)."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("bos_token") is None:
        return {}
    return {"add_bos_token": True}


def load_hf_dir(path: Path) -> tuple[Any, Any]:
    """A local Hugging Face folder's model (eager attention) and tokenizer; one-line errors."""
    import transformers as hf

    try:
        config = hf.AutoConfig.from_pretrained(path)
        tokenizer = hf.AutoTokenizer.from_pretrained(path, **_bos_keywords(path))
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' load errors
        raise UnsupportedModelError(
            f"cannot read a Hugging Face model from {path}: {str(e).splitlines()[0]}"
        ) from e
    archs = " ".join(getattr(config, "architectures", None) or [])
    if "CausalLM" in archs or "LMHead" in archs:
        loaders: list[Callable[..., Any]] = [hf.AutoModelForCausalLM.from_pretrained]
    elif "MaskedLM" in archs:
        loaders = [hf.AutoModelForMaskedLM.from_pretrained]
    else:
        loaders = [
            hf.AutoModelForCausalLM.from_pretrained,
            hf.AutoModelForMaskedLM.from_pretrained,
            hf.AutoModel.from_pretrained,
        ]
    errors = []
    for load in loaders:
        try:
            model = load(path, attn_implementation="eager")
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        n_embed = int(model.get_input_embeddings().num_embeddings)
        if len(tokenizer) > n_embed:
            raise UnsupportedModelError(
                f"the tokenizer in {path} has {len(tokenizer)} tokens, the model's embedding "
                f"only {n_embed}: ids from {n_embed} on index past it (a tokenizer of another "
                "model?)"
            )
        return model, tokenizer
    raise UnsupportedModelError(f"cannot load the model in {path}: {errors[-1]}")
