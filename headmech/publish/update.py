"""Recompute selected head types' validations in a published ``catalog.json``.

Publishing every bundled model takes about two hours; a change to one type's validation
(its metric, its controls) should not need all of it. :func:`update_validations` reads
``catalog/<model>/catalog.json``, recomputes ``details.validation`` for the named types
only, on the labelled heads the catalog holds and at the size it was published at, and
writes the file back: every other type's entry keeps its bytes (the file is written with
the same deterministic JSON, and the test suite checks the round trip). The catalog's
``provenance.validation_updates`` and ``run.json``'s ``updates`` record which types were
recomputed, with which versions and how long it took (the rest of the provenance, and the
scores, stay those of the full run). Each finished type is kept in
``<model>/.headmech-partial/update/`` until the file is written, so a stopped update, run
again, continues. ``python -m headmech.publish --types ... --update`` runs it
(:mod:`headmech.publish`).

Adding types a catalog lacks (``--add``, ``--rescore``) is :mod:`headmech.publish.addition`;
it shares this module's validation of one type and Benjamini-Hochberg over the catalog.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headmech.classification.records import TypeValidation, validation_of
from headmech.core.errors import InputError
from headmech.core.head_index import HeadIndex
from headmech.runs.provenance import dumps

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.runs.resume import Units

__all__ = ["add_broad", "run_record", "staged", "update_validations"]


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InputError(f"{path} does not exist: publish the model first (make catalog)")
    text = path.read_text()
    data = json.loads(text)
    if dumps(data) != text:  # the other types' bytes could not be kept
        raise InputError(f"{path} is not in headmech's JSON form: publish the model again")
    return data


def update_validations(
    name: str,
    root: Path,
    types: Sequence[str],
    *,
    probe_options: dict[str, Any],
    n_random: int,
    type_options: dict[str, dict[str, Any]] | None = None,
    command: str = "",
    alone: tuple[int, int] | None = None,
    control_tokens: int = 0,
) -> dict[str, Any]:
    """Recompute the validation of ``types`` in ``root/<name>/catalog.json`` (labelled
    heads, probe sizes and control draws as published) and record the update in the
    catalog's provenance and ``run.json``. Returns the update record.

    Raises:
        InputError: a type the catalog does not hold, a missing catalog, other weights.
    """

    from headmech.headtypes.registry import get_head_type
    from headmech.models import load_model
    from headmech.probes import ProbeOptions
    from headmech.runs.provenance import weights_hash
    from headmech.runs.resume import recording

    folder = root / name
    data = _read(folder / "catalog.json")
    missing = [t for t in types if t not in data["types"]]
    if missing or not types:
        have = ", ".join(sorted(data["types"]))
        raise InputError(f"catalog/{name} has no type(s) {', '.join(missing)} (has: {have})")
    t0, c0 = time.perf_counter(), time.process_time()
    model = load_model(name)
    if weights_hash(model) != data["provenance"]["model"]["weights_sha256"]:
        raise InputError(f"catalog/{name} was computed on other weights: publish it again")
    options = ProbeOptions(**probe_options)
    seconds: dict[str, float] = {}
    store = _update_store(folder, data, types, probe_options, n_random, alone, control_tokens)
    with recording(store):  # a stopped update keeps its finished types: rerun it to continue
        for t in types:
            head_type = get_head_type(t)(**(type_options or {}).get(t, {}))
            t1 = time.perf_counter()
            _validate_one(model, data, head_type, options, n_random, alone, control_tokens)
            seconds[t] = round(time.perf_counter() - t1, 1)
    _catalog_fdr(data)
    record = {"types": list(types), **run_record(command, seconds, t0, c0)}
    data["provenance"].setdefault("validation_updates", []).append(record)
    (folder / "catalog.json").write_text(dumps(data))
    run_path = folder / "run.json"
    run = json.loads(run_path.read_text()) if run_path.is_file() else {"model": name}
    run.setdefault("updates", []).append(record)
    run_path.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    store.clear()
    return record


def _update_store(
    folder: Path, data: dict[str, Any], types: Sequence[str], probe_options: dict[str, Any],
    n_random: int, alone: tuple[int, int] | None, control_tokens: int,
) -> Units:  # fmt: skip
    """The finished types of an update, kept in ``<model>/.headmech-partial/update/`` (one
    unit per type) until the catalog is written (:func:`staged`)."""
    settings = {
        "types": list(types), "probe_options": probe_options, "n_random": n_random,
        "alone": alone, "control_tokens": control_tokens,
    }  # fmt: skip
    return staged(folder, "update", data, settings)


def staged(folder: Path, kind: str, data: dict[str, Any], settings: dict[str, Any]) -> Units:
    """The store of a change to ``folder``'s catalog ``data`` (``<model>/.headmech-partial/
    <kind>/``), its manifest the change's ``settings`` with the library's versions and the
    catalog's weights; a store left by a change with other ones is discarded."""
    from headmech.runs.resume import STAGING, Units, library_versions

    manifest = json.loads(json.dumps({
        **settings, "versions": library_versions(),
        "weights_sha256": data["provenance"]["model"]["weights_sha256"],
    }, default=str))  # fmt: skip
    store = Units(folder / STAGING / kind, manifest)
    if store.read_manifest() not in (None, manifest):
        store.clear()
    return store


def _validate_one(
    model: TransformerBridge,
    data: dict[str, Any],
    head_type: Any,
    options: Any,
    n_random: int,
    alone: tuple[int, int] | None,
    control_tokens: int = 0,
) -> None:
    """One type's validation as a full run computes it, from the published catalog: its
    labelled heads, the other types' labels (K-composition's receivers), the heads no
    control may hold (the type's and its circuit's:
    :func:`headmech.classification.validation.controls_excluded`), its heads rejected above
    the threshold, its score and its own-effect evidence; stored in ``data``."""
    from headmech.classification.montecarlo import TestOptions
    from headmech.classification.results import TypeResult
    from headmech.classification.validation import controls_excluded, type_validation
    from headmech.runs.resume import unit

    m = data["model"]
    shape = (int(m["n_layers"]), int(m["n_heads"]))
    results = {n: TypeResult.from_json(n, e, shape) for n, e in data["types"].items()}
    r = results[head_type.name]
    run = partial(
        type_validation,
        model, head_type, r.heads, options, n_random, {n: x.heads for n, x in results.items()},
        controls_excluded(head_type, results), [HeadIndex.parse(e["head"]) for e in r.not_labelled],
        alone=alone, test=TestOptions(n_max=n_random, control_tokens=control_tokens),
        score=r.score, own=head_type.own_effects(r.details),
    )  # fmt: skip
    v = TypeValidation.from_json(unit(f"validate-{head_type.name}", lambda: run().to_json(per_head=True)))  # fmt: skip
    missing = [c for c in head_type.circuit if c not in results]
    if missing:
        v.circuit_not_classified = missing
    _store_validation(data["types"][head_type.name], v)


def _catalog_fdr(data: dict[str, Any]) -> None:
    """Benjamini-Hochberg across every claim of the catalog ``data``, in place."""
    from headmech.classification.validation import apply_fdr

    found = {n: validation_of(e) for n, e in data["types"].items()}
    apply_fdr(found)
    for n, v in found.items():
        if v is not None:
            data["types"][n]["details"]["validation"] = v.to_json()


def _store_validation(entry: dict[str, Any], v: TypeValidation) -> None:
    """A validation record into a type's entry: ``per_head`` beside ``details``, each
    head's reading on ordinary text (``broad_*``, ``narrow``: not the validation's) kept."""
    from headmech.classification.readings import HeadReading, readings_of

    v = TypeValidation.from_json(json.loads(dumps(v.to_json(per_head=True))))  # as written
    per_head = {k: HeadReading(e.labelled, e) for k, e in v.per_head.items()}
    for h, old in readings_of(entry).items():
        if old.broad is not None:
            per_head.setdefault(h, HeadReading(old.labelled)).broad = old.broad
    entry["per_head"] = {k: r.to_json() for k, r in per_head.items()}
    backups = v.backup_heads()
    entry.pop("backups", None)
    if backups:
        entry["backups"] = backups
    entry["details"]["validation"] = v.to_json()


def add_broad(name: str, root: Path, command: str = "") -> dict[str, Any]:
    """Each type's labelled and rejected heads in ``root/<name>/catalog.json`` read on
    ordinary text (:func:`headmech.classification.broad.broad_behaviour`), into their ``per_head``
    entries and ``details["broad"]``; recorded in the provenance (``broad_updates``) and
    ``run.json``. Returns the record."""
    from headmech.headtypes.registry import get_head_type, head_types
    from headmech.models import load_model
    from headmech.runs.provenance import weights_hash

    folder = root / name
    data = _read(folder / "catalog.json")
    t0, c0 = time.perf_counter(), time.process_time()
    model = load_model(name)
    if weights_hash(model) != data["provenance"]["model"]["weights_sha256"]:
        raise InputError(f"catalog/{name} was computed on other weights: publish it again")
    known = head_types()
    names = [t for t in data["types"] if t in known]
    _read_broadly(model, data, [get_head_type(t)() for t in names])
    record = {"types": names, **run_record(command, {}, t0, c0)}
    data["provenance"].setdefault("broad_updates", []).append(record)
    (folder / "catalog.json").write_text(dumps(data))
    run_path = folder / "run.json"
    run = json.loads(run_path.read_text()) if run_path.is_file() else {"model": name}
    run.setdefault("updates", []).append({"broad": names, **record})
    run_path.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return record


def _read_broadly(model: TransformerBridge, data: dict[str, Any], types: Sequence[Any]) -> None:
    """``types``' labelled and rejected heads in ``data`` read on ordinary text
    (:func:`headmech.classification.broad.broad_behaviour`) into their ``per_head`` entries and
    ``details["broad"]``, as a full run writes them."""
    from headmech.classification.broad import broad_behaviour, heads_to_read, merge
    from headmech.classification.readings import readings_of
    from headmech.classification.results import TypeResult

    shape = (int(data["model"]["n_layers"]), int(data["model"]["n_heads"]))
    results = {t.name: TypeResult.from_json(t.name, data["types"][t.name], shape) for t in types}
    found = broad_behaviour(model, types, {n: heads_to_read(r) for n, r in results.items()})
    for t, record in found.items():
        entry = data["types"][t]
        per = readings_of(entry)
        entry["details"]["broad"] = json.loads(dumps(merge(per, record, results[t].heads)))
        entry["per_head"] = json.loads(dumps({h: r.to_json() for h, r in per.items()}))


def run_record(command: str, seconds: dict[str, Any], t0: float, c0: float) -> dict[str, Any]:
    """When, with what and how long: the part of an addition's record every run has."""
    import torch

    from headmech._version import __version__
    from headmech.runs.provenance import git_commit

    return {
        "command": command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "headmech": __version__,
        "headmech_git": git_commit(),
        "torch": torch.__version__,
        "seconds": seconds,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - c0, 1),
        "threads": torch.get_num_threads(),
    }
