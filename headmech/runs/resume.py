"""Resumable runs: long work is stored unit by unit as it finishes, and a stopped run
continues from there and ends byte-identical to an uninterrupted one.

A *unit* is a piece of work whose result is stored exactly, tensors as their raw bytes
(:mod:`headmech.core.exact_json`), in the output folder's staging area
``--out/.headmech-partial/<command>/``:

* ``classify``: the types scored on one probe (one streaming pass scores them all), and
  each type's validation (its labelled and control sets ablated);
* ``importance``: each probe batch of the batched runner (every ablation or patching
  variant of that batch; :func:`headmech.interventions.run_variants`), of the per-batch
  gradient methods (mask gradient, attribution patching, DLA, LRP) and of the exact
  patching check of attribution patching;
* ``prune``: each ``michel`` step (step 0 too), each λ of the ``l0`` sweep, the ``mae``
  run and its fine-tuned baseline.

Code marks a unit with :func:`unit` (``unit("batch3", compute)``): inside
:func:`recording` a stored unit is read back instead of computed, a computed one is
written (to a temporary file, then renamed: a killed process leaves whole files or none).
Keys follow the call structure: a unit's name under its enclosing units and
:func:`scope` s, numbered where a name repeats (the second ``run_variants`` call of a
method), so a rerun of the same deterministic program visits the same keys. Every random
generator is seeded per unit (never advanced across units), so skipping a unit changes
nothing after it; the compute counter (:class:`headmech.interventions.Cost`) is stored
with each unit and restored. Outside :func:`recording` (and under ``torchrun``) a unit
is just computed. :func:`sharded_units` runs a per-batch function as one unit per batch
on this rank's share of the batches and gathers every batch's rows on every rank.

The command line (:func:`for_command`) keeps a ``manifest.json`` beside the units: the
command's arguments, the versions and the weights' SHA-256; ``--resume`` refuses (one
line) a run made with other ones. The staging folder is made with the first finished unit
and removed once the result files are written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from headmech.core import distributed
from headmech.core.checks import warn
from headmech.core.errors import InputError
from headmech.core.exact_json import decode, encode

__all__ = [
    "STAGING",
    "Units",
    "counting",
    "decode",
    "encode",
    "for_command",
    "library_versions",
    "recording",
    "resume_command",
    "scope",
    "sharded_units",
    "unit",
]

T = TypeVar("T")

STAGING = ".headmech-partial"  # in --out: one folder per command with its finished units

# --- the store -------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Units:
    """A folder of finished units (``units/<path>.json``) and the run's ``manifest.json``.

    Args:
        folder: where they live (made with the first unit stored).
        manifest: written beside the first unit (what the run was started with).
    """

    def __init__(self, folder: str | os.PathLike, manifest: dict[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self.saved = 0  # units computed and stored by this process
        self.replayed = 0  # units read back
        self.failed = False  # a unit could not be stored (warned once)

    def _file(self, path: Sequence[str]) -> Path:
        return self.folder.joinpath("units", *path[:-1], f"{path[-1]}.json")

    def load(self, path: Sequence[str]) -> tuple[bool, Any]:
        """``(True, record)`` for a stored unit, ``(False, None)`` otherwise."""
        try:
            data = json.loads(self._file(path).read_text())
        except (OSError, ValueError):
            return False, None
        if not isinstance(data, dict) or data.get("key") != "/".join(path):
            return False, None
        return True, data

    def save(self, path: Sequence[str], record: dict[str, Any]) -> None:
        """Store a finished unit (with the manifest, if not yet written); its inner units
        are no longer needed and go."""
        if self.manifest is not None and not (self.folder / "manifest.json").exists():
            _write(self.folder / "manifest.json", json.dumps(self.manifest, indent=1) + "\n")
        _write(self._file(path), json.dumps({"key": "/".join(path), **record}))
        inner = self.folder.joinpath("units", *path)
        if inner.is_dir():
            shutil.rmtree(inner, ignore_errors=True)
        self.saved += 1

    def count(self) -> int:
        """Finished units stored."""
        root = self.folder / "units"
        return sum(1 for _ in root.rglob("*.json")) if root.is_dir() else 0

    def read_manifest(self) -> dict[str, Any] | None:
        """The stored manifest, or None."""
        try:
            data = json.loads((self.folder / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def clear(self) -> None:
        """Remove the folder (and the staging area above it if it is left empty)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.folder.parent.rmdir()  # only if empty

    def __repr__(self) -> str:
        return f"Units({str(self.folder)!r}, {self.count()} stored)"


# --- marking units in code -------------------------------------------------------------


@dataclass
class _Frame:
    path: tuple[str, ...] = ()
    seen: dict[str, int] = field(default_factory=dict)

    def child(self, name: str) -> tuple[str, ...]:
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name) or "_"
        n = self.seen.get(safe, 0)
        self.seen[safe] = n + 1
        return (*self.path, safe if n == 0 else f"{safe}~{n}")


_STORE: ContextVar[Units | None] = ContextVar("headmech_units", default=None)
_FRAME: ContextVar[_Frame | None] = ContextVar("headmech_unit_frame", default=None)
_COST: ContextVar[Any] = ContextVar("headmech_unit_cost", default=None)


@contextlib.contextmanager
def recording(units: Units | None) -> Iterator[Units | None]:
    """Within the block, :func:`unit` reads finished units from ``units`` and stores new
    ones (None: leave whatever store is active)."""
    if units is None:
        yield _STORE.get()
        return
    token, frame = _STORE.set(units), _FRAME.set(_Frame())
    try:
        yield units
    finally:
        _FRAME.reset(frame)
        _STORE.reset(token)


@contextlib.contextmanager
def counting(cost: Any) -> Iterator[None]:
    """Units within the block store ``cost``'s counts after them and restore them when
    read back (``cost``: a :class:`headmech.interventions.Cost`)."""
    token = _COST.set(cost)
    try:
        yield
    finally:
        _COST.reset(token)


def _active() -> tuple[Units, _Frame] | None:
    """The store and the frame units are keyed in (None: outside :func:`recording`, or
    several processes)."""
    store, frame = _STORE.get(), _FRAME.get()
    if store is None or frame is None or distributed.world()[1] != 1:
        return None
    return store, frame


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Units within the block are keyed below ``name`` (numbered where it repeats)."""
    active = _active()
    if active is None:
        yield
        return
    token = _FRAME.set(_Frame(active[1].child(name)))
    try:
        yield
    finally:
        _FRAME.reset(token)


def unit(name: str, compute: Callable[[], T]) -> T:
    """``compute()``, or, inside :func:`recording` where this unit is stored, its stored
    value (equal bit for bit). A computed value is stored (it must be what :func:`encode`
    takes)."""
    active = _active()
    if active is None:
        return compute()
    store, frame = active
    path = frame.child(name)
    cost = _COST.get()
    found, record = store.load(path)
    if found:
        store.replayed += 1
        if cost is not None and record.get("cost") is not None:
            cost.forward, cost.backward = (float(v) for v in record["cost"])
        return decode(record["value"])  # type: ignore[no-any-return]
    token = _FRAME.set(_Frame(path))
    try:
        value = compute()
    finally:
        _FRAME.reset(token)
    counts = None if cost is None else [cost.forward, cost.backward]
    try:
        store.save(path, {"cost": counts, "value": encode(value)})
    except (TypeError, OSError) as e:  # the run goes on; a rerun computes this unit again
        if not store.failed:
            warn(f"finished work is not kept for --resume ({'/'.join(path)}: {e})")
        store.failed = True
    return value


def _tokens(item: Any) -> int:
    """Tokens of a batch, or of the first batch of a tuple (a base/source pair)."""
    batch = item[0] if isinstance(item, tuple) else item
    return int(batch.attention_mask.sum())


def sharded_units(
    batches: Sequence[Any],
    per_batch: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    progress: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``per_batch(batch) -> (num [units, ...], den [units, ...])`` on this rank's
    batches and return every batch's rows in order, on every rank (one process: all);
    ``progress`` names a bar (rank 0)."""
    nums, dens = {}, {}
    todo: Any = distributed.mine(len(batches))
    if progress and distributed.is_main():
        from headmech.core.progress import bar

        desc = progress if isinstance(progress, str) else "batches"
        todo = bar(todo, desc, len(todo), tokens=lambda i: _tokens(batches[i]))
    with scope("batches"):  # each batch a unit of a resumable run
        for i in todo:
            nums[i], dens[i] = unit(f"batch{i}", partial(per_batch, batches[i]))
    return distributed.gather_rows(nums, len(batches)), distributed.gather_rows(dens, len(batches))


# --- a command's store ------------------------------------------------------------------


def library_versions() -> dict[str, str]:
    """The versions a stored unit depends on: headmech, torch, transformers, TransformerLens."""
    from headmech._version import __version__
    from headmech.runs.provenance import dist_version

    return {
        "headmech": __version__,
        "torch": torch.__version__,
        "transformers": dist_version("transformers"),
        "transformer_lens": dist_version("transformer-lens"),
    }


def _first_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first setting (in name order) that differs, looked for inside nested settings
    (a spec's ``probe_options``): its name and both values; None if none differs."""
    for k in sorted({*old, *new}):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            return _first_change(a, b)
        return k, a, b
    return None


def for_command(
    out: str | os.PathLike,
    command: str,
    settings: Mapping[str, Any],
    *,
    resume: bool,
    force: bool,
    label: Callable[[str], str] = str,
) -> Units | None:
    """The staging store of ``command`` in ``out``, checked before the model loads.

    ``settings`` is what the run's result depends on (JSON-ready: a command's spec
    :meth:`~headmech.classification.spec.ClassifySpec.to_json` and the model it loads);
    ``label`` names a setting in an error (the command line: its flag). With ``resume``:
    the unfinished run must be there and have been started with the same settings and
    versions (else one line). Without: an unfinished run with finished units
    is refused unless ``force`` (which starts over). Under ``torchrun`` there is none
    (``--resume`` is refused).

    Raises:
        InputError: one line saying what to do instead.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if resume:
            raise InputError("--resume runs in one process, not under torchrun")
        return None
    store = Units(Path(out) / STAGING / command)
    manifest: dict[str, Any] = {
        "command": command,
        "settings": json.loads(json.dumps(dict(settings), default=str)),
        "versions": library_versions(),
    }
    found, n = store.read_manifest(), store.count()
    if resume:
        if found is None:
            raise InputError(
                f"--resume: {out} holds no unfinished {command} run to continue "
                f"(no {Path(STAGING) / command / 'manifest.json'})"
            )
        for what in ("settings", "versions"):
            change = _first_change(found.get(what) or {}, manifest[what])
            if change is not None:
                k, was, now = change
                name = label(k) if what == "settings" else f"{k} version"
                raise InputError(
                    f"--resume: the unfinished run in {store.folder} was started with "
                    f"{name} {was!r}, this one has {now!r}; rerun it as it was "
                    "started, or start over with --force instead of --resume"
                )
        manifest["weights_sha256"] = found.get("weights_sha256")
    else:
        if n and not force:
            raise InputError(
                f"--out {out} holds an unfinished {command} run ({n} finished units in "
                f"{store.folder}): continue it with --resume, or start over with --force"
            )
        store.clear()  # nothing worth keeping, or --force: start over
    store.manifest = manifest
    return store


def bind_weights(store: Units | None, model: Any) -> None:
    """Record the loaded model's weights hash in the manifest; a resumed run's must equal
    the stopped run's (one line otherwise)."""
    from headmech.runs.provenance import weights_hash

    if store is None or store.manifest is None:
        return
    have, want = weights_hash(model), store.manifest.get("weights_sha256")
    if want is not None and have != want:
        raise InputError(
            f"--resume: the unfinished run in {store.folder} was made with other weights "
            f"(sha256 {want[:12]}…, this model {have[:12]}…); start over with --force "
            "instead of --resume"
        )
    store.manifest["weights_sha256"] = have


def resume_command(argv: Sequence[str]) -> str:
    """The command line that continues the run ``headmech *argv`` (``--resume`` added)."""
    argv = list(argv)
    return shlex.join(["headmech", *argv, *([] if "--resume" in argv else ["--resume"])])
