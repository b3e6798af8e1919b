"""The toy models in the cache: weights shipped with the package, checkpoints replayed.

Training the toy (:func:`headmech.models.toys.train_toy_induction`, seeded, one thread) is
reproducible on one kind of CPU but not across kinds: ATen's kernels and MKL's GEMMs choose
their code by the CPU and sum floats in its order. Pinned to ATen's AVX2 code and MKL's
COMPATIBLE branch (:data:`PINNED_ISA`), an Intel Xeon trained weights ``fb3fb715...`` and an
AVX-512 AMD EPYC ``201d1c5a...`` (MKL honours its branches on Intel CPUs only), and 1,500
steps carry that rounding into other weights. So ``toy-induction``'s final weights ship
with the package (``toy_weights/``, 0.8 MB, trained on the EPYC) and are copied into the
cache: the same model, and its published catalog, on every machine.

Its training checkpoints (31 of them, 25 MB: the tutorials' phase change) are a replay of
the same recipe trained here on first use (:func:`toy_checkpoints`, minutes). On a CPU of
another kind the replay ends at other weights than the shipped ones; its ``replay.json``
says whether they are equal, and which heads it formed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from headmech.core.errors import UnknownModelError
from headmech.models.files import cache_dir, quiet
from headmech.models.toy_data import make_toy_tokenizer
from headmech.models.toys import TRAINING_THREADS, ToyInductionConfig, train_toy_induction

__all__ = ["PINNED_ISA", "TOY_CHECKPOINT_EVERY", "ensure_toy", "shipped", "toy_checkpoints",
           "toy_path"]  # fmt: skip

TOY_CHECKPOINT_EVERY = 50  # training steps between saved checkpoints of a toy model

# the code paths the toy trains on (a child process: the variables act at library load)
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}

_SHIPPED = Path(__file__).parent / "toy_weights"


def _fingerprint() -> str:
    """Identifies the recipe: a changed recipe trains into a new cache folder (and needs
    newly shipped weights: tests/test_toys.py checks that they exist)."""
    recipe = {
        **asdict(ToyInductionConfig()),
        "checkpoint_every": TOY_CHECKPOINT_EVERY,
        "threads": TRAINING_THREADS,
        "isa": PINNED_ISA,
    }
    blob = json.dumps(recipe, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def _can_pin() -> bool:
    """Whether this CPU runs :data:`PINNED_ISA`'s code (an x86-64 CPU with AVX2)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _train_into(folder: Path) -> None:
    """Train the toy with checkpoints saved under ``folder/checkpoints/step-NNNNN/``."""
    config = ToyInductionConfig()
    tokenizer = make_toy_tokenizer(config.vocab_size)

    def save(step: int, model: Any) -> None:
        with quiet():
            model.save_pretrained(folder / "checkpoints" / f"step-{step:05d}")
            tokenizer.save_pretrained(folder / "checkpoints" / f"step-{step:05d}")

    model, tokenizer, metrics = train_toy_induction(
        config, checkpoint_every=TOY_CHECKPOINT_EVERY, on_checkpoint=save
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    metrics["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    (folder / "training.json").write_text(json.dumps(metrics, indent=1, default=str))


def _train_pinned(folder: Path) -> None:
    """:func:`_train_into` in a child process on :data:`PINNED_ISA` (in this process where
    the CPU cannot run it)."""
    if not _can_pin():
        _train_into(folder)
        return
    env = {**os.environ, **PINNED_ISA, "OMP_NUM_THREADS": str(TRAINING_THREADS)}
    cmd = [sys.executable, "-m", "headmech.models.toy_cache", str(folder)]
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"training the toy model failed: {tail[0]}")


def _known(name: str) -> None:
    if name != "toy-induction":
        raise UnknownModelError(f"unknown toy model '{name}': use toy-induction")


def toy_path(name: str) -> Path:
    """Where a toy model's weights live in the cache."""
    _known(name)
    return cache_dir() / "toys" / f"{name}-{_fingerprint()}"


def shipped(name: str) -> Path | None:
    """The package's weights of toy ``name`` for the current recipe (None: none shipped)."""
    _known(name)
    folder = _SHIPPED / toy_path(name).name
    return folder if (folder / "model.safetensors").exists() else None


def _build_into(folder: Path, name: str = "toy-induction") -> None:
    """The toy's weights into ``folder``: the shipped ones, else trained here (a changed
    recipe; its checkpoints are then kept as :func:`toy_checkpoints`' replay)."""
    source = shipped(name)
    if source is not None:
        shutil.copytree(source, folder, dirs_exist_ok=True)
        return
    _train_pinned(folder)
    replay = folder / "checkpoints"
    replay.rename(folder / "steps")
    replay.mkdir()
    (folder / "steps").rename(replay / "steps")
    metrics = json.loads((folder / "training.json").read_text())
    metrics["same_weights_as_the_toy"] = True
    (replay / "replay.json").write_text(json.dumps(metrics, indent=1, default=str))


def _once(out: Path, marker: str, build: Any) -> Path:
    """``build(tmp)`` into a temporary folder next to ``out``, renamed to ``out``, where
    ``out/marker`` is missing; once across processes (two test workers, two notebooks:
    the others wait and reuse it)."""
    done = out / marker
    if done.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if done.exists():
            return out
        shutil.rmtree(out, ignore_errors=True)  # an unfinished one
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}-", dir=out.parent))
        try:
            build(tmp)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def ensure_toy(name: str) -> Path:
    """The toy's folder in the cache (a Hugging Face model directory), copied from the
    package's shipped weights on first use."""
    return _once(toy_path(name), "config.json", lambda tmp: _build_into(tmp, name))


def _replay_into(folder: Path, final: Path) -> None:
    """Train the recipe again with checkpoints; keep them in ``folder`` with
    ``replay.json``: its metrics and whether it ended at the toy's weights (``final``)."""
    from safetensors.torch import load_file

    run = Path(tempfile.mkdtemp(prefix="replay-", dir=folder.parent))
    try:
        _train_pinned(run)
        (run / "checkpoints").rename(folder / "steps")
        metrics = json.loads((run / "training.json").read_text())
    finally:
        shutil.rmtree(run, ignore_errors=True)
    last = max(folder.glob("steps/step-*"))
    a, b = load_file(last / "model.safetensors"), load_file(final / "model.safetensors")
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    metrics["same_weights_as_the_toy"] = same
    (folder / "replay.json").write_text(json.dumps(metrics, indent=1, default=str))


def toy_checkpoints(name: str) -> dict[int, Path]:
    """The training checkpoints of a toy model, by optimizer step (0 = untrained): a replay
    of its recipe, trained once on this machine on first use (minutes; the module's
    docstring says when it differs from the shipped toy). Each value is a Hugging Face
    model directory that :func:`headmech.load_model` loads like any other.

    Examples:
        >>> ckpts = toy_checkpoints("toy-induction")  # doctest: +SKIP
        >>> model = load_model(ckpts[500])  # doctest: +SKIP
    """
    final = ensure_toy(name)
    folder = _once(final / "checkpoints", "replay.json", lambda tmp: _replay_into(tmp, final))
    return {int(p.name.split("-")[1]): p for p in sorted((folder / "steps").glob("step-*"))}


if __name__ == "__main__":  # the child process of _train_pinned
    _train_into(Path(sys.argv[1]))
