"""What every ``headmech`` subcommand shares: the checks before the model loads, loading
it, and writing the result's files.

The checks that need no registry (counts, seeds, fractions, ``--out``) are in
:mod:`headmech.core.checks`; the ones here look up names in the registries, read a model
folder's ``config.json`` or load a ``--catalog``. A stopped ``classify``, ``importance`` or
``prune`` keeps its finished units (:mod:`headmech.runs.resume`): :func:`staging` opens that
store, :func:`resumable` names the command that continues the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from headmech.core import checks as V
from headmech.core.errors import (
    IncompleteRunError,
    InputError,
    MissingPackageError,
    UnknownModelError,
)

__all__ = [
    "RESULT_FILES",
    "catalog_file",
    "config_shape",
    "head_type_names",
    "model_name",
]


def head_type_names(text: str) -> list[str]:
    """``--types``: registered head type names, none blank and none twice."""
    from headmech.core.registry import HEAD_TYPES

    names = [t.strip() for t in text.split(",")]
    if not any(names):
        raise InputError(f"--types lists no head type (got {text!r}; see `headmech types`)")
    if "" in names:
        raise InputError(f"--types has an empty entry (a stray comma?): {text!r}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"--types lists {', '.join(twice)} more than once")
    for n in names:
        V.lookup(HEAD_TYPES, n)
    return names


def model_name(name: str) -> str:
    """A registered model (installed), a readable Hugging Face directory or a GGUF file,
    checked without loading it: ``config.json`` a JSON object, weight files not corrupt; a
    GGUF file's header readable and its architecture one transformers reads.

    Raises:
        UnknownModelError: none of these, with a near-miss suggestion or the file at fault.
        MissingPackageError: a bundled model whose package is not installed.
    """
    from headmech.core.registry import MODELS
    from headmech.models import is_gguf_path
    from headmech.models.files import hf_dir_problem

    if name in MODELS:
        if (status := MODELS.get(name).status()).startswith("missing"):
            raise MissingPackageError(f"model '{name}' is not installed ({status})")
        return name
    p = Path(name)
    if name.strip() and p.is_dir():
        if (problem := hf_dir_problem(p)) is not None:
            raise UnknownModelError(f"{name} is not a usable Hugging Face model: {problem}")
        return name
    if name.strip() and is_gguf_path(name):
        if not p.is_file():
            raise UnknownModelError(f"no such GGUF file: {name}")
        if not os.access(p, os.R_OK):
            raise UnknownModelError(f"the GGUF file {name} is not readable")
        from headmech.models.bundled import gguf_problem  # torch: a GGUF file was given

        if (problem := gguf_problem(p)) is not None:
            raise UnknownModelError(problem)
        return name
    hint = " (a file: give its folder)" if p.is_file() else V.suggestion(name, MODELS.names())
    if not hint and name.startswith("~") and p.expanduser().is_dir():
        hint = " (the '~' was not expanded: use $HOME)"
    raise UnknownModelError(
        f"unknown model '{name}'{hint}: use one of {', '.join(MODELS.names())} "
        "or a local Hugging Face model directory or GGUF file"
    )


def config_shape(name: str) -> tuple[int, int] | None:
    """``(n_layers, n_heads)`` of a bundled model, a model folder's ``config.json`` or a
    GGUF file's header, read without loading; None where unknown."""
    from headmech.models import is_gguf_path
    from headmech.models.bundled import BUNDLED_MODELS, gguf_metadata

    if name in BUNDLED_MODELS:
        return BUNDLED_MODELS[name].n_layers, BUNDLED_MODELS[name].n_heads
    if Path(name).is_file() and is_gguf_path(name):
        try:
            meta = gguf_metadata(name)
        except (OSError, ValueError):
            return None
        arch = meta.get("general.architecture")
        layers, heads = meta.get(f"{arch}.block_count"), meta.get(f"{arch}.attention.head_count")
        return (layers, heads) if isinstance(layers, int) and isinstance(heads, int) else None
    path = Path(name) / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    return (layers, heads) if isinstance(layers, int) and isinstance(heads, int) else None


def catalog_file(path: str, model: str | None = None) -> Any:
    """``--catalog``: a readable ``catalog.json`` (or a folder holding one), loaded; a
    model of another shape than ``model`` (where known without loading) is refused."""
    from headmech.classification.classify import HeadCatalog

    p = Path(path)
    V.regular_file(str(p / "catalog.json") if p.is_dir() else path, "--catalog")
    catalog = HeadCatalog.load(p)
    shape = config_shape(model) if model is not None else None
    if shape is not None and shape != (catalog.model.n_layers, catalog.model.n_heads):
        raise InputError(
            f"--catalog {path} describes a model of {catalog.model.n_layers}x"
            f"{catalog.model.n_heads} heads, {model} has {shape[0]}x{shape[1]}"
        )
    return catalog


RESULT_FILES: dict[str, tuple[str, ...]] = {
    "classify": ("catalog.json", "heatmap.png", "run.json"),
    "importance": ("importance.json", "importance.png", "run.json"),
    "prune": ("pruning.json", "pruning.png", "run.json"),
    "circuit": ("circuit.graphml", "circuit.json", "circuit.png", "run.json"),
    "discover": ("discovery.json", "discovery.png", "run.json"),  # + cluster_<id>.png
    "compare-definitions": ("definitions.json", "definitions.png", "run.json"),
}


def check_run(args: argparse.Namespace, command: str, *, sizes: bool = True) -> None:
    """The checks every analysis command shares, cheapest first, before the model loads:
    probe sizes and seed (``sizes``; a command with a spec checks them in it), device,
    output folder, model name."""
    if sizes:
        for name in ("n_sentences", "n_sequences", "batch_size"):
            V.count(getattr(args, name, None), "--" + name.replace("_", "-"))
        V.count(getattr(args, "half_len", None), "--half-len", minimum=2)
        V.seed(args.seed)
        if hasattr(args, "batch_size"):
            probe_options(args)  # --context / --depths and the options' own checks
    V.device(args.device)
    V.out_dir(args.out, RESULT_FILES[command], args.force)
    model_name(args.model)


def fit_before_load(spec: Any, name: str) -> None:
    """The spec's types against the model's tokenizer where it can be read without loading
    the model (:meth:`~headmech.classification.spec.ClassifySpec.fit`): types measured on
    prose fail here, in a second, on a tokenizer that knows no English."""
    from headmech.core.registry import MODELS

    source = MODELS.get(name) if name in MODELS else None
    if source is not None and source.tokenizer is not None:  # e.g. a toy not trained yet
        spec.fit(source.tokenizer(), None)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A command's model and when its loading started and ended (``run.json``'s seconds)."""

    model: Any
    started: float
    loaded: float


def load_model_of(args: argparse.Namespace) -> Loaded:
    """The model of ``args.model`` on ``args.device`` in ``args.dtype`` (after every check
    has passed), timed."""
    from headmech.core import distributed
    from headmech.models import load_model

    # under torchrun: join the process group; only rank 0 prints and writes
    device = distributed.init_from_env(args.device)
    if not distributed.is_main():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (this process's own output)
    from headmech.models.packages import first_load

    print(first_load(args.model) or f"loading {args.model} ...", file=sys.stderr)
    started = time.perf_counter()
    where = {k: getattr(args, k, None) for k in ("device_map", "max_memory", "offload_folder")}
    model = load_model(args.model, device=device, dtype=getattr(args, "dtype", None), **where)
    return Loaded(model, started, time.perf_counter())


def save_result(
    args: argparse.Namespace,
    command: str,
    result: Any,
    loaded: Loaded,
    files: tuple[str, ...] = (),
    units: Any = None,
) -> Path:
    """Run ``result.save(folder)`` on a temporary folder next to ``--out`` and write the
    run record (``run.json``: seconds, tokens/s, peak memory); move the files into ``--out``
    only if it succeeds (see :func:`headmech.core.checks.staged_output`); ``files``: more
    files of an earlier result that ``--force`` removes; ``units``: the run's finished
    units (:mod:`headmech.runs.resume`), removed once the result is in place."""
    from headmech.core import distributed
    from headmech.core.progress import run_record

    if not distributed.is_main():  # under torchrun rank 0 alone writes
        return Path(args.out)
    now = time.perf_counter()
    record = run_record(command, result, loaded.loaded - loaded.started, now - loaded.started)
    try:
        with V.staged_output(args.out, RESULT_FILES[command] + files, args.force) as tmp:
            result.save(tmp)
            (tmp / "run.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    except OSError as e:  # a full disk, a folder made read-only meanwhile: one line
        raise InputError(f"cannot write the results into {args.out}: {e.strerror or e}") from e
    if units is not None:
        units.clear()
    return Path(args.out)


_NOT_SETTINGS = {"out", "force", "resume", "func", "argv"}  # where, not what, a run computes
LOAD_SETTINGS = ("model", "dtype", "device", "device_map", "max_memory", "offload_folder")


def flag(key: str) -> str:
    """The flag of a parsed argument's name (``n_random`` -> ``--n-random``)."""
    return "MODEL" if key == "model" else "--" + key.replace("_", "-")


def _file_hash(path: Any) -> str | None:
    p = Path(str(path))
    p = p / "catalog.json" if p.is_dir() else p
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError:
        return None


def arguments_json(args: argparse.Namespace) -> dict[str, Any]:
    """A command's parsed arguments as its resume manifest records them (``--out``,
    ``--force`` and ``--resume`` left out; a ``--corpus`` or ``--catalog`` file by its
    SHA-256 too), for the commands without a spec of their own."""
    raw = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_SETTINGS}
    for key in ("corpus", "catalog"):
        if raw.get(key) is not None:
            raw[f"{key}_sha256"] = _file_hash(raw[key])
    return raw


def staging(args: argparse.Namespace, command: str, spec: Any = None) -> Any:
    """The run's store of finished units in ``--out`` (:mod:`headmech.runs.resume`), checked
    before the model loads: ``--resume`` needs a stopped run of the same settings (``spec``'s
    JSON and the model's loading, else every argument); an unfinished run is not started
    over without ``--force``."""
    from headmech.classification.spec import PARAMETERS
    from headmech.core.constraints import label
    from headmech.runs.resume import for_command

    def name(key: str) -> str:
        return label(PARAMETERS, key, "cli") if key in PARAMETERS else flag(key)

    if spec is None:
        settings = arguments_json(args)
    else:
        load = {k: getattr(args, k, None) for k in LOAD_SETTINGS}
        settings = {**spec.to_json(), **load}
    resume = bool(getattr(args, "resume", False))
    return for_command(args.out, command, settings, resume=resume, force=args.force, label=name)


@contextlib.contextmanager
def resumable(args: argparse.Namespace, units: Any) -> Iterator[None]:
    """A stopped run with finished units says, in its one line, how to continue it
    (Ctrl-C: :class:`IncompleteRunError`, exit status 130)."""
    from headmech.runs.resume import resume_command

    def hint() -> str:
        argv = getattr(args, "argv", None)
        how = resume_command(argv) if argv else "the same command with --resume"
        return f"{units.count()} finished unit(s) kept in {units.folder}; continue with: {how}"

    try:
        yield
    except IncompleteRunError as e:
        if units is not None and units.count():
            e.args = (f"{e.args[0]}; {hint()}",)
        raise
    except KeyboardInterrupt as e:
        if units is None or not units.count():
            raise
        raise IncompleteRunError(f"interrupted; {hint()}", None) from e


def save_partial(args: argparse.Namespace, e: IncompleteRunError, stem: str) -> None:
    """Write a stopped run's finished part as ``--out/<stem>.partial.json`` (the result's
    JSON, ``meta.incomplete`` saying why it stopped) and name the file in the error."""
    from headmech.core import distributed
    from headmech.runs.provenance import dumps

    if not distributed.is_main():
        return
    out = Path(args.out)
    path = out / f"{stem}.partial.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(e.partial.to_json()))  # type: ignore[attr-defined]
    except OSError as err:
        e.args = (f"{e.args[0]}; could not write the finished part to {path}: {err}",)
        return
    e.args = (f"{e.args[0]}; the finished part is in {path}",)


def probe_options(args: argparse.Namespace) -> Any:
    """ProbeOptions from the run options; unset sizes keep the library defaults."""
    from headmech.core.options import ProbeOptions

    sizes = {k: getattr(args, k, None) for k in ("n_sentences", "n_sequences", "half_len")}
    if getattr(args, "context", None) is not None:
        sizes["needle_lengths"] = V.number_list(args.context, "--context", int, low=1)
    if getattr(args, "depths", None) is not None:
        sizes["needle_depths"] = V.number_list(args.depths, "--depths", float, low=0, high=1)
    return ProbeOptions(
        seed=args.seed,
        batch_size=args.batch_size,
        **{k: v for k, v in sizes.items() if v is not None},
    )
