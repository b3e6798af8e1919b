"""Add head types a published catalog lacks: ``python -m headmech.publish --types ... --add``.

:func:`add_types` adds types registered after the catalog was published: it classifies
only those types, at the catalog's published size and at the small size of ``check.json``,
validates them against the catalog's labelled heads as a full run would
(:func:`headmech.publish.update._validate_one`, Benjamini-Hochberg over every claim
again), and inserts their entries, their ``settings.types`` and probe records into both
files (every other entry keeps its bytes). A type that does not fit the model is recorded
as skipped, as the full run records it. ``provenance.type_additions`` and ``run.json``'s
``updates`` say what was added, when, and in how many seconds. ``--rescore`` replaces the
entries of types the catalog holds (a changed score). Each finished part is kept in
``<model>/.headmech-partial/add/`` until the files are written, so a stopped addition,
run again, continues.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headmech.core.errors import InputError
from headmech.publish import update
from headmech.publish.update import run_record, staged
from headmech.runs.provenance import dumps

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge

    from headmech.classification.results import HeadCatalog, TypeResult

__all__ = ["add_types"]


def _merge(data: dict[str, Any], new: dict[str, Any]) -> None:
    """Insert ``new``'s types (a catalog's JSON of the added types alone) into ``data``:
    their entries, ``settings.types`` and probe records (the probe options, and a probe
    both computed, must agree)."""
    prov, got = data["provenance"], new["provenance"]
    if prov["probe_options"] != got["probe_options"]:
        raise InputError("the catalog was published at other probe sizes: publish it again")
    for name, entry in got["probes"].items():
        if prov["probes"].setdefault(name, entry) != entry:
            raise InputError(f"probe '{name}' differs from the published one: publish again")
    data["types"].update(new["types"])
    prov["settings"]["types"].update(got["settings"]["types"])


def _classified(model: TransformerBridge, types: list[str], size: Any) -> HeadCatalog:
    """``types`` classified at ``size`` (a :class:`headmech.publish.Size`), unvalidated."""
    from headmech.classification.classify import classify
    from headmech.headtypes.registry import get_head_type

    instances = [get_head_type(t)(**size.type_options.get(t, {})) for t in types]
    return classify(model, instances, n_boot=size.n_boot, **size.probe_options())


def _validate(
    model: TransformerBridge, data: dict[str, Any], types: list[str], size: Any
) -> dict[str, float]:
    """Each added type's validation, as a full run computes it (the labelled heads of
    every type in the catalog beside), into ``data``. Returns the seconds per type."""
    from headmech.headtypes.registry import get_head_type
    from headmech.probes import ProbeOptions

    options = ProbeOptions(**size.probe_options())
    seconds: dict[str, float] = {}
    instances = []
    for t in types:
        t1 = time.perf_counter()
        head_type = get_head_type(t)(**size.type_options.get(t, {}))
        instances.append(head_type)
        update._validate_one(
            model, data, head_type, options, size.n_random, size.alone, size.control_tokens
        )
        seconds[t] = round(time.perf_counter() - t1, 1)
    update._catalog_fdr(data)
    update._read_broadly(model, data, instances)
    return seconds


def _open_for_addition(
    model: TransformerBridge, folder: Path, types: Sequence[str], replace: bool
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``folder``'s catalog, check and run records, checked before any work: the types are
    new to it (or their entries are dropped, ``replace``) and it was computed on
    ``model``'s weights."""
    from headmech.runs.provenance import weights_hash

    data, checked = update._read(folder / "catalog.json"), update._read(folder / "check.json")
    run = json.loads((folder / "run.json").read_text())
    have = [t for t in types if t in data["types"] or t in run["skipped"]]
    if replace and types:
        for d in (data, checked):
            for t in types:
                d["types"].pop(t, None)
        have = []
    if have or not types:
        raise InputError(f"{folder} already has type(s) {', '.join(have)} (--update revalidates)")
    if weights_hash(model) != data["provenance"]["model"]["weights_sha256"]:
        raise InputError(f"{folder} was computed on other weights: publish it again")
    return data, checked, run


def add_types(
    model: TransformerBridge,
    folder: Path,
    types: Sequence[str],
    *,
    skipped: dict[str, str],
    named: bool,
    size: Any,
    check: Any,
    command: str = "",
    replace: bool = False,
) -> tuple[dict[str, Any], dict[str, TypeResult]]:
    """Add ``types`` to ``folder/catalog.json`` (classified at ``size``, validated if
    ``size.validate``) and ``folder/check.json`` (at ``check``), both sizes being
    :class:`headmech.publish.Size`; those in ``skipped`` (every type that does not fit
    the model, with the reason) are recorded as skipped instead, in ``run.json`` and, where
    the publishing run did not name its types (``named`` false), in the provenance.

    Returns:
        The addition's record and the full-size results of the types classified (as
        written: none when every type was skipped), for their heatmaps.

    Each finished part (the classification at each size, each type's validation) is kept
    in ``folder/.headmech-partial/add/`` until the files are written: a stopped addition,
    run again with the same types, continues from there.

    ``replace``: the types may be in the catalog already; their entries are replaced
    (a changed score: ``publish --rescore``), and the record says ``rescored``.

    Raises:
        InputError: a type the catalog already holds (unless ``replace``), a missing
            catalog, other weights.
    """
    from headmech.runs.resume import recording

    data, checked, run = _open_for_addition(model, folder, types, replace)
    t0, c0 = time.perf_counter(), time.process_time()
    added = [t for t in types if t not in skipped]
    left = {t: skipped[t] for t in types if t in skipped}
    kept = {} if named else left
    for d in (data, checked):
        d["provenance"]["settings"]["skipped"].update(kept)
    settings = {"types": added, "size": repr(size), "check": repr(check), "replace": replace}
    store = staged(folder, "add", data, settings)
    with recording(store):  # a stopped addition keeps its finished parts: rerun it to go on
        full, seconds = _measure(model, data, checked, added, size, check) if added else ({}, {})
    if store.replayed:
        seconds["resumed_units"] = store.replayed
    done = "rescored" if replace else "added"
    record = {done: added, "skipped": left, **run_record(command, seconds, t0, c0)}
    _write(folder, data, checked, run, record)
    store.clear()
    return record, full


def _measure(
    model: TransformerBridge, data: dict[str, Any], checked: dict[str, Any], added: list[str],
    size: Any, check: Any,
) -> tuple[dict[str, TypeResult], dict[str, Any]]:  # fmt: skip
    """The added types classified at ``size`` into ``data`` and validated, then at
    ``check`` into ``checked``, each part a unit of the active store; their full-size
    results and the seconds of each part."""
    from headmech.runs.resume import unit

    t0 = time.perf_counter()
    new = unit("classify", lambda: json.loads(dumps(_classified(model, added, size).to_json())))
    _merge(data, new)
    seconds: dict[str, Any] = {"classify": round(time.perf_counter() - t0, 1)}
    seconds["validate"] = _validate(model, data, added, size) if size.validate else {}
    t1 = time.perf_counter()
    small = unit("check", lambda: json.loads(dumps(_classified(model, added, check).to_json())))
    _merge(checked, small)
    seconds["check"] = round(time.perf_counter() - t1, 1)
    return _type_results(new), seconds


def _write(
    folder: Path, data: dict[str, Any], checked: dict[str, Any], run: dict[str, Any],
    record: dict[str, Any],
) -> None:  # fmt: skip
    """The three files of an addition, its record in the catalog's provenance and run.json."""
    data["provenance"].setdefault("type_additions", []).append(record)
    (folder / "catalog.json").write_text(dumps(data))
    (folder / "check.json").write_text(dumps(checked))
    run["skipped"].update(record["skipped"])
    run.setdefault("updates", []).append(record)
    (folder / "run.json").write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")


def _type_results(data: dict[str, Any]) -> dict[str, TypeResult]:
    """The types of a catalog's JSON, parsed (for their heatmaps)."""
    from headmech.classification.results import TypeResult

    m = data["model"]
    shape = (int(m["n_layers"]), int(m["n_heads"]))
    return {n: TypeResult.from_json(n, e, shape) for n, e in data["types"].items()}
