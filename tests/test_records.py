"""Typed validation records (:mod:`headmech.classification.records`): every published
catalog's validation records read back and re-save byte for byte, the derived values stay
as written, a malformed record is a one-line error, and a record built in memory writes
what the readers read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headmech.classification.montecarlo import ControlTest, describe_test
from headmech.classification.records import (
    ClaimRecord,
    ControlAccounting,
    HeadEffect,
    Redundancy,
    TypeValidation,
)
from headmech.classification.results import HeadCatalog
from headmech.runs.provenance import dumps

ROOT = Path(__file__).resolve().parents[1] / "catalog"
CATALOGS = sorted(ROOT.glob("*/catalog.json"))


@pytest.mark.parametrize("path", CATALOGS, ids=[p.parent.name for p in CATALOGS])
def test_published_catalogs_load_and_resave_byte_for_byte(path, tmp_path):
    """Each validation record through ``from_json``/``to_json`` equals the file's, and the
    whole catalog, loaded and saved, is the same bytes."""
    data = json.loads(path.read_text())
    n = 0
    for name, entry in data["types"].items():
        v = entry["details"].get("validation")
        if v is None:
            continue
        typed = TypeValidation.from_json(v)
        assert dumps(typed.to_json()) == dumps(v), name
        assert typed.primary.kind == v["primary"] == v["validation"]
        n += 1
    assert n > 0 or path.parent.name == "minilm-l6" or not data["types"]
    loaded = HeadCatalog.load(path)
    assert all(
        (r.validation is not None) == ("validation" in data["types"][k]["details"])
        for k, r in loaded.types.items()
    )
    assert all("validation" not in r.details for r in loaded.types.values())
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()


def _claim(**kw):
    base = dict(kind="ablation", claim="c", metric="loss", mode="zero", expected="raise", n_heads=2)
    return ClaimRecord(**(base | kw))


def test_derived_values_are_computed_once_and_kept_as_written():
    """A fresh record computes the ablated metric and the controls' summary from its
    values; read back from a rounded file, it keeps the file's (so a re-save changes no
    digit), and the test's summary likewise."""
    test = ControlTest(2.0, [0.1234567, 0.3, 0.2], 0, 0.25, 0.25, "n_max", 3, 5, 10, "u")
    c = _claim(effect=2.0, clean=1.0000004, test=test)
    d = c.derived()
    assert d["ablated"] == pytest.approx(3.0000004) and d["random_effects"] == test.controls
    assert d["random_median"] == 0.2 and d["random_range"] == [0.1234567, 0.3]
    assert d["random_mean"] == pytest.approx((0.1234567 + 0.3 + 0.2) / 3)
    written = json.loads(dumps(c.to_json()))  # rounded to 6 decimals
    back = ClaimRecord.from_json(written)
    assert back.derived()["ablated"] == written["ablated"] == 3.0
    back.effect = 5.0  # a read record keeps what the file says it measured
    assert back.derived()["ablated"] == 3.0
    assert ControlTest.from_json(written["test"]).summary() == {
        k: written["test"][k] for k in ControlTest.SUMMARY
    }
    # an even count: the lower middle value, as the first records wrote it
    assert _claim(shown_controls=[4.0, 1.0, 3.0, 2.0]).derived()["random_median"] == 2.0


def test_a_type_validation_writes_its_parts_where_readers_find_them():
    """Primary claim flat, controls' keys beside it, secondary claims by kind, per_head
    only where asked (a finished unit), and the accounting's note."""
    test = ControlTest(2.0, [0.5, 0.7], 0, 0.33, 0.33, "n_max", 2, 5, 10, "u", q=0.4, family=3)
    primary = _claim(effect=2.0, clean=1.0, test=test, verdict="inconclusive")
    other = _claim(kind="k_composition", verdict="untestable here", note="no receivers")
    v = TypeValidation(
        primary,
        ControlAccounting("same_layers", "", 30, 435, [[1, 2]], {"x (its circuit)": [[1, 2]]}),
        claims=["ablation", "k_composition"],
        secondary={"k_composition": other},
        per_head={"L1H0": HeadEffect(1.5, [1.0, 2.0], True)},
        redundancy=Redundancy(2.0, 1.5, 2.0 / 1.5),
    )
    out = v.to_json()
    assert out["validation"] == out["primary"] == "ablation" and out["verdict"] == "inconclusive"
    assert out["control_pool"] == 30 and out["circuit_excluded"] == {"x (its circuit)": [[1, 2]]}
    assert out["secondary"]["k_composition"]["note"] == "no receivers"
    assert "per_head" not in out and v.to_json(per_head=True)["per_head"]["L1H0"]["effect"] == 1.5
    back = TypeValidation.from_json(v.to_json(per_head=True))
    assert back.per_head == v.per_head and back.redundancy == v.redundancy
    assert [k for k, _ in back.parts()] == ["ablation", "k_composition"]
    assert back.tested() == [back.primary] and back.verdict == "inconclusive"
    assert describe_test(back.primary.test) == "p 0.33, q 0.4, n 2, p >= 0.33 at best"


@pytest.mark.parametrize(
    "bad",
    [[], {"redundancy": {"set_effect": 1.0}}, {"secondary": []}, {"backups": {"method": "m"}}],
)
def test_a_malformed_record_is_a_value_error(bad):
    with pytest.raises(ValueError, match="validation record|not an object|secondary"):
        TypeValidation.from_json(bad)


def test_headmech_keeps_its_model_state_off_the_model():
    """A loaded model's name, weights hash and pattern-edit check live in headmech's
    record (:mod:`headmech.models.loaded`), not as attributes of the bridge; the record
    goes with the model."""
    import gc
    import weakref

    import headmech
    from headmech.interventions import pattern_edits_apply
    from headmech.models.loaded import loaded
    from headmech.runs.provenance import weights_hash

    model = headmech.load_model("toy-induction")
    before = set(vars(model))
    assert headmech.model_info(model).name == "toy-induction" == loaded(model).name
    digest = weights_hash(model)
    assert loaded(model).weights_hash is not None and loaded(model).weights_hash[1] == digest
    assert pattern_edits_apply(model) is loaded(model).pattern_edits_apply is True
    assert set(vars(model)) == before and not any("headmech" in k for k in vars(model))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None  # the record does not keep its model alive


def test_a_head_reading_is_what_per_head_holds_and_writes_it_back():
    """per_head: a head measured alone, read on ordinary text, both or neither; written
    back field for field, an unknown field kept; a measurement missing a field is a
    one-line error."""
    from headmech.classification.readings import HeadReading, readings_of

    both = {"effect": 0.5, "interval": [0.1, 0.9], "labelled": True, "broad_share": 0.7,
            "broad_share_4x": 0.6, "broad_score": 0.2, "broad_score_4x": 0.1, "narrow": False}  # fmt: skip
    alone = {"effect": -0.1, "interval": None, "labelled": False}
    broad = {k: v for k, v in both.items() if k.startswith("broad") or k == "narrow"}
    broad["labelled"] = False
    later = {**alone, "future_field": 3}
    entry = {"per_head": {"L0H1": both, "L1H0": alone, "L1H2": broad, "L1H3": later}}
    read = readings_of(entry)
    assert {h: r.to_json() for h, r in read.items()} == entry["per_head"]
    assert read["L0H1"].effect == 0.5 and read["L0H1"].broad.broad_share == 0.7
    assert read["L1H2"].alone is None and read["L1H2"].effect is None
    assert read["L1H0"].broad is None and read["L1H3"].extra == {"future_field": 3}
    with pytest.raises(ValueError, match="lacks 'narrow'"):
        HeadReading.from_json({k: v for k, v in both.items() if k != "narrow"})
