"""Checks of user input that run before a model loads, and atomic output folders.

A bad value fails in seconds with one line naming the flag and the value (a
:class:`~headmech.core.errors.HeadmechError`), not after a minute of loading; legal but
meaningless input warns (:class:`HeadmechWarning`). The command line calls these before
``load_model`` (the checks that look up registered names or read a model folder are in
:mod:`headmech.cli.base`); :func:`headmech.load_model` calls :func:`device`.
:func:`staged_output` writes a command's files next to ``--out`` and moves them in only
on success. Nothing here imports more of headmech than its errors and device placement.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from headmech.core.errors import ArgumentError, HeadIndexError, HeadmechWarning, InputError
from headmech.core.errors import suggestion as suggestion  # re-exported (the command line)
from headmech.core.placement import DTYPES, device, dtype

# fmt: off
__all__ = [
    "DTYPES", "MAX_N_RANDOM", "MIN_SENTENCES", "HeadmechWarning", "count", "device", "dtype",
    "fraction", "kinds", "lams", "lookup", "method_options", "number_list", "out_dir",
    "probe_options", "prose_problem", "regular_file", "seed", "staged_output", "stream_arguments",
    "suggestion", "too_few_sentences", "warn",
]
# fmt: on

MIN_SENTENCES = 8  # a corpus of fewer sentences: per-relation statistics are meaningless
MAX_N_RANDOM = 1000  # validation control sets: each is one more ablated run of the task
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed overflows above, numpy refuses below 0
MAX_PROBE_TOKENS = 50_000_000  # repeated random tokens: n_sequences * (2 * half_len + 1)
MAX_CORPUS_BYTES = 100_000_000  # spaCy splits the whole file; a probe samples a few hundred
UNKNOWN_SHARE = 0.5  # above: the tokenizer does not read the prose (a word-level toy vocabulary)
PROSE_PROBES = frozenset({"prose", "needle", "ordinal", "ioi", "icl"})  # built from English words
# probes that also read the corpus's English words (the inactive type's domains: prose beside
# code and random tokens; concept induction's repeated multi-token words): the command line
# skips their types with the prose types when the tokenizer knows no English
WORD_PROBES = PROSE_PROBES | {"domains", "repeated_words"}
TMP_PREFIX = ".headmech-tmp-"
_PROSE = ("The cat sat on the mat because it was warm.", "She opened the window and smiled.")


def warn(message: str) -> None:
    """Warn in one line (:class:`HeadmechWarning`; the CLI prints ``headmech: warning:``)."""
    warnings.warn(message, HeadmechWarning, stacklevel=3)


def count(value: int | None, flag: str, minimum: int = 1) -> int | None:
    """A count flag (``--n-sentences``, ``--batch-size``, ...): an int of at least
    ``minimum``; None (unset, the library default) passes."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise InputError(f"{flag} must be {what}, got {value!r}")
    return value


def fraction(value: float, flag: str) -> float:
    """A share in (0, 1] (``--fraction``)."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise InputError(f"{flag} must be a number in (0, 1], got {value!r}")
    return float(value)


def seed(value: int, flag: str = "--seed") -> int:
    """A seed every sampler accepts: an integer in [0, 2**63 - 1]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise InputError(f"{flag} must be an integer from 0 to 2**63 - 1, got {value!r}")
    return value


def lams(text: str) -> tuple[float, ...]:
    """``--lams``: a non-empty comma-separated list of positive, finite numbers."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--lams takes comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise InputError(f"--lams takes a list of positive numbers, got {text!r}")
    return values


def kinds(text: str) -> list[str]:
    """``--kinds``: a comma-separated subset of q, k and v, each at most once."""
    out = [k.strip() for k in text.split(",") if k.strip()]
    if not out or any(k not in ("q", "k", "v") for k in out) or len(set(out)) < len(out):
        raise InputError(f"--kinds takes q, k and v, comma-separated, once each; got {text!r}")
    return out


def lookup(registry: Any, name: str) -> Any:
    """The registry entry of ``name``; the registry's one-line error, with its suggestion
    of a close name (:func:`headmech.core.errors.suggestion`), otherwise."""
    return registry.entry(name)


def number_list(
    text: str, flag: str, kind: type, low: float | None = None, high: float | None = None
) -> tuple[Any, ...]:
    """``"1,2,3"`` as a tuple of ``kind`` within ``[low, high]``; a one-line error otherwise."""
    try:
        values = tuple(kind(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated {kind.__name__}s") from None
    bad = [v for v in values if (low is not None and v < low) or (high is not None and v > high)]
    if not values or bad:
        raise InputError(f"{flag} {text!r}: every value must lie in [{low}, {high}]")
    return values


def regular_file(path: str, flag: str) -> Path:
    """An existing, regular (not a folder, FIFO or device), readable file."""
    if not path.strip():
        raise InputError(f"{flag} is empty")
    p = Path(path)
    if not p.exists():
        raise InputError(f"{flag}: no such file: {path}")
    if p.is_dir():
        raise InputError(f"{flag}: {path} is a folder, not a file")
    if not p.is_file():
        raise InputError(f"{flag}: {path} is not a regular file (a device or pipe?)")
    if not os.access(p, os.R_OK):
        raise InputError(f"{flag}: {path} is not readable")
    return p


def too_few_sentences(n: int) -> str | None:
    """Why a corpus of ``n`` sentences is refused (fewer than :data:`MIN_SENTENCES`), or None."""
    if n >= MIN_SENTENCES:
        return None
    return (
        f"has only {n} sentence(s): per-relation and per-position statistics of so few are "
        f"meaningless (give at least {MIN_SENTENCES})"
    )


def _existing_ancestor(p: Path) -> Path:
    """The nearest existing folder at or above ``p``; an error if it is a file."""
    p = p.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise InputError(f"--out: {p} is a file, so no folder can be created under it")
    return p


def out_dir(path: str, files: Sequence[str], force: bool) -> Path:
    """``--out``: a folder (existing or creatable, writable) that holds none of the
    command's ``files`` unless ``force``.

    Raises:
        InputError: an existing file, not writable, or an earlier result without ``force``.
    """
    if not path.strip():
        raise InputError("--out is empty")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {path} is an existing file, not a folder")
    if not out.exists() and out.suffix in {Path(f).suffix for f in files}:
        raise InputError(f"--out names a folder, got the file name {path}")
    base = _existing_ancestor(out)
    probe = base / f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise InputError(f"--out {path}: cannot write in {base} ({e.strerror})") from None
    present = [f for f in files if (out / f).exists()]
    if present and not force:
        raise InputError(
            f"--out {path} already holds {', '.join(present)}; use --force to overwrite"
        )
    return out


def _commit(tmp: Path, out: Path, files: Sequence[str], force: bool) -> None:
    """Move the finished files from ``tmp`` into ``out`` (a rename when ``out`` is new)."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
        return
    written = sorted(p.name for p in tmp.iterdir())
    if (clash := [f for f in written if (out / f).exists()]) and not force:
        raise InputError(f"--out {out}: {', '.join(clash)} appeared meanwhile; use --force")
    for name in files:  # --force: no stale file of an older result stays beside the new one
        if name not in written and (out / name).is_file():
            (out / name).unlink()
    for name in written:
        os.replace(tmp / name, out / name)


@contextlib.contextmanager
def staged_output(out: str | os.PathLike, files: Sequence[str], force: bool) -> Iterator[Path]:
    """A hidden temporary folder next to ``out`` (same filesystem) to write into; on a
    clean exit its files move into ``out`` (with ``force``, ``files`` not written this time
    are removed from it: no stale file of an older result stays); on any error or Ctrl-C
    it is removed.

    Yields:
        The temporary folder.
    """
    target = Path(out)
    base = _existing_ancestor(target.parent)
    tmp = base / f"{TMP_PREFIX}{target.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _commit(tmp, target, files, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


_POSITIVE = {"chunk", "steps", "rounds", "gate_steps", "model_steps", "d_hidden", "n_eval_batches"}
_POSITIVE_FLOAT = {"lr", "lr_gate", "lr_model"}
_CHOICES = {"direction": ("noising", "denoising"), "per": ("example", "token", "batch")}


def method_options(options: dict[str, Any]) -> dict[str, Any]:
    """Values of a method's typed options (``-o KEY=VALUE``, already typed by
    :func:`headmech.core.options.parse_options`): counts positive, rates positive, floats
    finite, seeds in range, ``fraction`` in (0, 1], ``lams`` positive, known choices."""
    for key, value in options.items():
        flag = f"option '{key}'"
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{flag} must be a finite number, got {value!r}")
        if value is None:
            continue
        if key in _POSITIVE:
            count(value, flag)
        elif key in _POSITIVE_FLOAT and not value > 0:
            raise InputError(f"{flag} must be positive, got {value!r}")
        elif key in ("seed", "baseline"):
            seed(value, flag)
        elif key == "fraction":
            fraction(value, flag)
        elif key == "lams":
            lams(",".join(str(v) for v in value))
        elif key in _CHOICES and value not in _CHOICES[key]:
            raise InputError(f"{flag} takes {' or '.join(_CHOICES[key])}, got {value!r}")
    return options


def probe_options(options: Any) -> Any:
    """A :class:`headmech.probes.ProbeOptions` with counts positive, ``half_len`` >= 2,
    a usable seed, and at most :data:`MAX_PROBE_TOKENS` repeated random tokens."""
    for name in ("n_sentences", "n_sequences", "batch_size"):
        count(getattr(options, name), name)
    count(options.half_len, "half_len", minimum=2)
    seed(options.seed, "seed")
    tokens = options.n_sequences * (2 * options.half_len + 1)
    if tokens > MAX_PROBE_TOKENS:
        raise InputError(
            f"{options.n_sequences} repeated sequences of 2 x {options.half_len} tokens are "
            f"{tokens:,} tokens; at most {MAX_PROBE_TOKENS:,}"
        )
    return options


def prose_problem(tokenizer: Any, sentences: Sequence[str] | None = None) -> str | None:
    """Why the tokenizer cannot read the probe's prose (the first 16 ``sentences`` of the
    corpus, or plain English), or None.

    Returns:
        A clause for an error message when more than :data:`UNKNOWN_SHARE` of the tokens
        are the unknown token (a word-level toy vocabulary), else None.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None  # byte-level BPE: every string has a spelling
    text = list(sentences[:16]) if sentences else list(_PROSE)
    ids = [i for s in text for i in tokenizer(s, add_special_tokens=False)["input_ids"]]
    if (share := sum(i == unk for i in ids) / max(len(ids), 1)) <= UNKNOWN_SHARE:
        return None
    return (
        f"the model's tokenizer reads {share:.0%} of the prose as its unknown token "
        f"{tokenizer.unk_token!r} (it knows no English words)"
    )


def stream_arguments(model: Any, reducers: Sequence[Any], layers: Sequence[int] | None) -> None:
    """:func:`headmech.stream.engine.stream_statistics`' reducers (unique names) and layers (of
    the model)."""
    names = [r.name for r in reducers]
    if len(set(names)) != len(names):
        raise ArgumentError(f"reducer names must be unique, got {names}")
    n_layers = int(model.cfg.n_layers)
    if layers is not None and (
        not layers
        or any(
            isinstance(la, bool) or not isinstance(la, int) or not 0 <= la < n_layers
            for la in layers
        )
    ):
        raise HeadIndexError(
            f"layers {list(layers)!r}: give layers of the model, 0 to {n_layers - 1} (None: all)"
        )
