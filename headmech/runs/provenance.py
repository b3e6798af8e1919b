"""Provenance: what every JSON file headmech writes says about how it was made.

A result a paper cites must say which weights, which probe data, which code and which
settings produced it, and a rerun must give the same bytes. :func:`provenance` collects
that record — schema version; headmech, torch, transformers and TransformerLens versions
and the git commit of the checkout headmech runs from (:func:`git_commit`);
the model's name, shape, dtype, device and a SHA-256 of its weights (and, for the Qwen GGUF
and GGUF paths, where they came from: packages, versions, the file's SHA-256, licence, the
token prepended to texts); the probe generator,
its options and a SHA-256 of the token ids it produced (and of the corpus file, when one
was given); the seed and the thresholds — and :func:`dumps` writes JSON deterministically
(sorted keys, fixed float rounding, no timings), so the same command on the same machine
writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headmech._version import __version__
from headmech.core.errors import HeadmechError
from headmech.models.loaded import loaded

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.stream.engine import ProbeBatch

__all__ = [
    "SCHEMA_VERSION",
    "WeightsMismatchError",
    "check_weights",
    "data_hash",
    "dumps",
    "git_commit",
    "options_json",
    "provenance",
    "weights_hash",
]

SCHEMA_VERSION = "2"  # 2: provenance, intervals, control sets (1: the first catalog.json)


class WeightsMismatchError(HeadmechError):
    """A saved result describes other weights than the model it is applied to."""


def dist_version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


@functools.cache
def git_commit() -> dict[str, Any] | None:
    """The git commit of the checkout headmech is imported from, and whether its
    ``headmech/`` files differ from it (``{"commit": sha, "dirty": bool}``).

    None when headmech is not run from a git checkout (an installed wheel, a copy, a
    package inside someone else's repository) or git is not installed: never an error.
    Read once a process, when first asked: the code a process runs is the code it imported.
    """
    package = Path(__file__).resolve().parents[1]  # headmech/, above runs/

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=package, capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != package.parent:
            return None
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", ".") != ""  # cwd: the package
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def weights_hash(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (names, dtypes, shapes and bytes).

    Weights offloaded to disk or CPU by accelerate (``device_map``) are read through
    ``accelerate.utils.align_module_device``, so an offloaded model hashes like the same
    weights loaded whole. Cached on the model and recomputed when a parameter changes in
    place (tensor versions).
    """
    from accelerate.utils import align_module_device

    named = [
        (f"{prefix}.{n}" if prefix else n, mod, t)
        for prefix, mod in model.named_modules()
        for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        if t is not None and "inv_freq" not in n
    ]
    # inference tensors keep no version counter: such a model is rehashed every time
    key = tuple((name, -1 if t.is_inference() else t._version, id(t)) for name, _, t in named)
    record = loaded(model)
    cached = record.weights_hash
    if cached is not None and cached[0] == key:
        return str(cached[1])
    digests: dict[str, str] = {}
    seen: set[int] = set()
    for name, mod, t in named:
        if id(t) in seen:  # tied weights: once, under the first name
            continue
        seen.add(id(t))
        with align_module_device(mod):  # materialises offloaded weights; else a no-op
            value = getattr(mod, name.rsplit(".", 1)[-1])
            # reshape(-1): a 0-dim tensor (Gemma 3's scalar buffer) has no byte view. hashlib
            # reads the array's buffer in place: a copy (tobytes) doubled the time (1.5B
            # parameters: 10.6 s) and the largest tensor's memory
            raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            digest = hashlib.sha256(raw).hexdigest()
        digests[name] = f"{value.dtype}:{tuple(value.shape)}:{digest}"
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    digest = h.hexdigest()
    record.weights_hash = (key, digest)
    return digest


def data_hash(batches: Iterable[ProbeBatch]) -> str:
    """SHA-256 of a probe's token ids and attention masks, batch by batch."""
    h = hashlib.sha256()
    for b in batches:
        for t in (b.input_ids, b.attention_mask):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().cpu().to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def n_tokens(batches: Iterable[ProbeBatch]) -> int:
    """Real (unpadded) tokens of a probe."""
    return int(sum(int(b.attention_mask.sum()) for b in batches))


def options_json(options: Any) -> dict[str, Any]:
    """Probe options (a dataclass or a mapping) as the provenance records them: lists for
    tuples, a corpus by its path (or its size, given in Python) and its SHA-256."""
    if options is None:
        return {}
    is_instance = dataclasses.is_dataclass(options) and not isinstance(options, type)
    raw = dataclasses.asdict(options) if is_instance else dict(options)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if k == "corpus" and v is not None and not isinstance(v, (str, os.PathLike)):
            out[k] = f"{len(v)} sentences given in Python"
        elif isinstance(v, (tuple, list)):
            out[k] = list(v)
        elif isinstance(v, os.PathLike):
            out[k] = str(v)
        else:
            out[k] = v
    corpus = raw.get("corpus")
    if isinstance(corpus, (str, os.PathLike)) and Path(corpus).is_file():
        out["corpus_sha256"] = hashlib.sha256(Path(corpus).read_bytes()).hexdigest()
    elif corpus is not None and not isinstance(corpus, (str, os.PathLike)):
        out["corpus_sha256"] = hashlib.sha256("\n".join(corpus).encode()).hexdigest()
    return out


def provenance(
    model: TransformerBridge,
    *,
    probes: Mapping[str, Iterable[ProbeBatch]] | None = None,
    options: Any = None,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The provenance record of a result computed on ``model``.

    Args:
        model: the bridge the result was computed on.
        probes: probe name → the batches used (their token ids are hashed).
        options: the probe options (a dataclass or a mapping).
        settings: anything else the result depends on (method options, thresholds, seed).

    Returns:
        A JSON-ready dict (no timings: the same inputs give the same record).
    """
    from headmech.models import model_info

    info = model_info(model)
    p = next(model.parameters())
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "versions": {
            "headmech": __version__,
            "torch": torch.__version__,
            "transformers": dist_version("transformers"),
            "transformer_lens": dist_version("transformer-lens"),
            # the environment's, like the versions: not compared across checkouts
            "headmech_git": git_commit(),
        },
        "model": {
            "name": info.name,
            "n_layers": info.n_layers,
            "n_heads": info.n_heads,
            "n_kv_heads": info.n_kv_heads,
            "weights_sha256": weights_hash(model),
            "dtype": str(p.dtype).removeprefix("torch."),
            "device": str(p.device),
        },
        "probe_options": options_json(options),
        "probes": {
            name: {"data_sha256": data_hash(b), "n_tokens": n_tokens(b)}
            for name, b in (probes or {}).items()
        },
    }
    if (source := loaded(model).source) is not None:
        # where the weights came from (a bundled GGUF's packages and their versions, the
        # file's SHA-256, the licence) and what the tokenizer prepends to every text
        record["model"]["source"] = dict(source)
    if settings:
        record["settings"] = dict(settings)
    return record


def check_weights(saved: Mapping[str, Any] | None, model: TransformerBridge, what: str) -> None:
    """Refuse to apply a saved result to other weights than it was computed on.

    Raises:
        WeightsMismatchError: the saved weights hash differs from the model's (pass
            ``force=True`` / ``--force`` to the caller to apply it anyway).
    """
    want = ((saved or {}).get("model") or {}).get("weights_sha256")
    if not want:
        return
    have = weights_hash(model)
    if have != want:
        raise WeightsMismatchError(
            f"{what} was computed on other weights (sha256 {want[:12]}…, this model "
            f"{have[:12]}…); use --force / force=True to apply it anyway"
        )


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return None if value != value else round(value, 6)
    if isinstance(value, dict):
        return {str(k): _round(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    return value


def dumps(data: Mapping[str, Any]) -> str:
    """Deterministic JSON: sorted keys, floats rounded to 6 decimals (NaN as null)."""
    return json.dumps(_round(dict(data)), indent=1, sort_keys=True, allow_nan=False) + "\n"
