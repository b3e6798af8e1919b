"""``python -m headmech.publish --types ... --add``: a type a published catalog lacks is
added with what a full run records for it, and nothing else in the folder changes."""

from __future__ import annotations

import json
import warnings

import pytest

import headmech
from headmech import publish
from headmech.runs.provenance import dumps

NAME = "toy-induction"
SMALL = publish.Size(
    n_sentences=16, n_sequences=4, context=(120,), n_random=2, n_boot=20, extra={"half_len": 16}
)


@pytest.fixture(scope="module")
def toy():
    return headmech.load_model(NAME)


def _unpublish(folder, types: list[str], skipped: str) -> None:
    """Take ``types`` (and the skipped type ``skipped``) out of a published folder, as if
    they had been registered after it was published."""
    for file in ("catalog.json", "check.json"):
        data = json.loads((folder / file).read_text())
        for t in types:
            del data["types"][t], data["provenance"]["settings"]["types"][t]
        data["provenance"]["probes"].pop("domains")  # inactive's own probe
        (folder / file).write_text(dumps(data))
    run = json.loads((folder / "run.json").read_text())
    del run["skipped"][skipped]
    (folder / "run.json").write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    for t in types:
        (folder / "heatmaps" / f"{t}.png").unlink()


def test_add_records_what_a_full_run_records(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(publish.FULL, NAME, SMALL)
    monkeypatch.setattr(headmech.models, "load_model", lambda name: toy)
    folder = tmp_path / NAME
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        publish.publish_model(NAME, tmp_path, progress=False)  # every type, at SMALL
        full = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        run = json.loads(full["run.json"])
        assert {"induction", "inactive"} <= set(json.loads(full["catalog.json"])["types"])
        _unpublish(folder, ["induction", "inactive"], "semantic_induction")
        add = ["--models", NAME, "--out", str(tmp_path), "--add"]
        assert publish.main([*add, "--types", "induction,inactive,semantic_induction"]) == 0
    after = json.loads((folder / "catalog.json").read_text())
    record = after["provenance"].pop("type_additions")[-1]
    assert dumps(after).encode() == full["catalog.json"]  # every byte a full run writes
    assert (folder / "check.json").read_bytes() == full["check.json"]
    for t in ("induction", "inactive", "duplicate_token"):
        assert (folder / "heatmaps" / f"{t}.png").read_bytes() == full[f"{t}.png"]
    assert record["added"] == ["induction", "inactive"]
    assert record["skipped"] == {"semantic_induction": run["skipped"]["semantic_induction"]}
    assert set(record["seconds"]["validate"]) == {"induction", "inactive"}
    now = json.loads((folder / "run.json").read_text())
    assert now.pop("updates") == [record] and now == run
    assert "toy-induction: added ['induction', 'inactive']" in capsys.readouterr().err
    # a type the catalog has (or records as skipped) is not added again
    assert publish.main([*add, "--types", "inactive"]) == 1
    assert publish.main([*add, "--types", "semantic_induction"]) == 1
    assert "already has type(s) semantic_induction (--update" in capsys.readouterr().err
    assert (folder / "check.json").read_bytes() == full["check.json"]
    # --rescore: a type the catalog holds, classified and validated again, replaces its
    # entries; the type's code unchanged, they are the same
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rescore = ["--models", NAME, "--out", str(tmp_path), "--rescore", "--types", "induction"]
        assert publish.main(rescore) == 0
    again = json.loads((folder / "catalog.json").read_text())
    assert again["provenance"]["type_additions"][-1]["rescored"] == ["induction"]
    assert again["types"] == after["types"]
    assert (folder / "check.json").read_bytes() == full["check.json"]
    assert "toy-induction: rescored ['induction']" in capsys.readouterr().err
    # a stopped addition keeps its finished parts (.headmech-partial/add/): run again, it
    # reads them back and writes what an unbroken run writes
    from headmech.publish import update

    real = update._validate_one

    def stop_at_inactive(model, data, head_type, *args, **kwargs):
        if head_type.name == "inactive":
            raise KeyboardInterrupt
        return real(model, data, head_type, *args, **kwargs)

    monkeypatch.setattr(update, "_validate_one", stop_at_inactive)
    both = ["--models", NAME, "--out", str(tmp_path), "--rescore", "--types", "induction,inactive"]
    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        publish.main(both)
    assert json.loads((folder / "catalog.json").read_text()) == again  # nothing written yet
    staged = folder / ".headmech-partial" / "add"
    assert (staged / "manifest.json").is_file()
    monkeypatch.setattr(update, "_validate_one", real)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert publish.main(both) == 0
    final = json.loads((folder / "catalog.json").read_text())
    # the full-size classification and induction's validation read back
    assert final["provenance"]["type_additions"][-1]["seconds"]["resumed_units"] == 2
    assert final["types"] == after["types"] and not staged.parent.exists()
    assert (folder / "check.json").read_bytes() == full["check.json"]
