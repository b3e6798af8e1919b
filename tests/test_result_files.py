"""The one base of result files (headmech.runs.files): the header, deterministic and exact
JSON, tensors as safetensors, one-line errors for a missing, corrupt, other-kind or
newer-schema file, and every result class through it (the published catalogs read back
and write the same bytes)."""

from __future__ import annotations

import json
import pickle
import warnings
from dataclasses import dataclass, field
from itertools import permutations
from pathlib import Path
from typing import Any

import pytest
import torch

from headmech._version import __version__
from headmech.attribution import IMPORTANCE_FILE, ImportanceResult
from headmech.classification.results import CATALOG_FILE, HeadCatalog, TypeResult
from headmech.core.errors import (
    CatalogFileError,
    HeadmechError,
    InputError,
    KVPlanFileError,
    ResultFileError,
)
from headmech.core.head_index import HeadIndex
from headmech.discover.clusters import DISCOVERY_FILE, Cluster, DiscoveryResult
from headmech.kv.plan import PLAN_FILE, KVPlan
from headmech.models import ModelInfo
from headmech.pruning.result import PRUNING_FILE, PruningResult
from headmech.runs.files import SCHEMAS, FileSchema, ResultFile
from headmech.runs.provenance import dumps

ROOT = Path(__file__).resolve().parents[1]
PROV = {"model": {"name": "m", "weights_sha256": "ab" * 32}, "seed": 0}

# a schema and a result class of the tests' own, exact, with tensors
TOY_FILE = FileSchema("toy result", "toy.json", "3", required=("values",), exact=True)


@dataclass(eq=False)
class Toy(ResultFile):
    values: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)

    SCHEMA = TOY_FILE

    def _body(self) -> dict[str, Any]:
        return {"values": self.values}

    @classmethod
    def _from_json(cls, data: dict[str, Any]) -> Toy:
        return cls(data["values"], data.get("provenance", {}))


def _catalog() -> HeadCatalog:
    score = torch.tensor([[0.9, 0.1], [float("nan"), 0.4]])
    r = TypeResult(
        "induction", "Olsson et al. 2022", 0.5, score, [HeadIndex(0, 0)],
        {"probe": "repeated_random"}, score - 0.1, score + 0.1, [HeadIndex(1, 1)],
    )  # fmt: skip
    return HeadCatalog(ModelInfo("m", 2, 2, 2, 8, 64, True), {"induction": r}, provenance=PROV)


def _results() -> dict[str, ResultFile]:
    steps = [
        {"n_kept": 4, "heads_kept": [[0, 0], [0, 1], [1, 0], [1, 1]], "metric": 1.0},
        {"n_kept": 3, "heads_kept": [[0, 0], [0, 1], [1, 0]], "metric": 1.01, "lambda": 0.5},
    ]
    return {
        "catalog": _catalog(),
        "pruning": PruningResult(
            "michel", "lm", steps, {"induction": [1.0, 0.5]}, 4, "loss", "m",
            {"comparison": {"x": 1.5}}, PROV,
        ),  # fmt: skip
        "importance": ImportanceResult(
            "zero", "lm", torch.tensor([[0.25, 1.0], [0.0, -0.5]]), 3.2, "loss", 0.0, 5.0, "m",
            {"chunk": 1}, torch.zeros(2, 2), torch.ones(2, 2), PROV,
        ),  # fmt: skip
        "plan": KVPlan(torch.tensor([[True, False], [False, False]]), 4, 2, 8, "m", {"kind": "heads"}, PROV),
        "toy": Toy({"x": 0.1 + 0.2, "t": torch.arange(3.0), "h": HeadIndex(1, 0)}, PROV),
    }  # fmt: skip


RESULTS = _results()


@pytest.mark.parametrize("name", RESULTS)
def test_each_class_round_trips_through_the_base(name, tmp_path):
    """``load(save(x)) == x``; the same result always writes the same bytes; the header
    (schema version, headmech version where the kind records it, provenance) is the
    base's."""
    result = RESULTS[name]
    path = result.save(tmp_path / "a.json")
    assert path == tmp_path / "a.json"
    back = type(result).load(path)
    assert back == result
    assert back.save(tmp_path / "b.json").read_bytes() == path.read_bytes()
    data = json.loads(path.read_text())
    schema = type(result).SCHEMA
    assert data["schema_version"] == schema.version
    assert ("headmech_version" in data) == schema.headmech_version
    assert json.loads(json.dumps(data["provenance"])) == PROV
    assert list(data) == sorted(data)  # sorted keys: the published files' layout
    # a folder gets the schema's file name, read back from the folder too
    folder = tmp_path / "out"
    assert type(result).SCHEMA.write(folder, result.to_json()) == folder / schema.filename
    assert type(result).load(folder) == result


def test_published_catalogs_write_the_same_bytes(tmp_path):
    """Every committed catalog/*/catalog.json reads back and writes itself, byte for byte."""
    paths = sorted((ROOT / "catalog").glob("*/catalog.json"))
    assert paths
    for p in paths:
        catalog = HeadCatalog.load(p)
        assert catalog.save(tmp_path / f"{p.parent.name}.json").read_bytes() == p.read_bytes()
        assert dumps(catalog.to_json()) == p.read_text()


def test_exact_values_read_back_bit_for_bit(tmp_path):
    """An exact schema keeps floats by repr, NaN, tensors (dtype and bytes) and head
    indices."""
    values = {"x": 0.1 + 0.2, "nan": float("nan"), "t": torch.randn(3, dtype=torch.float64),
              "h": HeadIndex(2, 1), "pair": (1, 2)}  # fmt: skip
    back = Toy.load(Toy(values).save(tmp_path / "t.json")).values
    assert back["x"] == 0.1 + 0.2 and back["nan"] != back["nan"]
    assert torch.equal(back["t"], values["t"]) and back["t"].dtype == torch.float64
    assert back["h"] == HeadIndex(2, 1) and back["pair"] == (1, 2)


def test_tensors_go_to_safetensors_beside_the_json(tmp_path):
    t = {"score": torch.randn(2, 3), "mask": torch.tensor([True, False])}
    path = PRUNING_FILE.write(tmp_path, {"method": "m", "task": "t", "steps": []}, tensors=t)
    assert (tmp_path / "pruning.safetensors").is_file()
    assert json.loads(path.read_text())["tensors"] == "pruning.safetensors"
    back = PRUNING_FILE.read_tensors(tmp_path)
    assert set(back) == set(t) and all(torch.equal(back[k], t[k]) for k in t)
    assert PRUNING_FILE.read_tensors(RESULTS["pruning"].save(tmp_path / "none.json")) == {}
    # another kind's tensors, a corrupt file, a pickle in its place: one line each
    other = IMPORTANCE_FILE.contents({"method": "m", "task": "t", "score": 1})
    p = IMPORTANCE_FILE.write(tmp_path / "i.json", {**other, "tensors": "pruning.safetensors"})
    with pytest.raises(ResultFileError, match="no tensors of a headmech importance result"):
        IMPORTANCE_FILE.read_tensors(p)
    for junk in (b"", b"\x00" * 40, pickle.dumps(t)):
        (tmp_path / "pruning.safetensors").write_bytes(junk)
        with pytest.raises(ResultFileError, match="is not a safetensors file") as e:
            PRUNING_FILE.read_tensors(tmp_path)
        assert "\n" not in str(e.value)
    (tmp_path / "pruning.safetensors").unlink()
    with pytest.raises(ResultFileError, match="no tensors file at"):
        PRUNING_FILE.read_tensors(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no {what} file at"),
        (b"", "is not a headmech {what}: not valid JSON"),
        (b"\xff\xfe\x00junk", "is not a headmech {what}: not valid JSON"),
        (b"{not json", "is not a headmech {what}: not valid JSON"),
        (b"[1, 2]", "is not a headmech {what}: the file holds no JSON object"),
        (b"null", "is not a headmech {what}: the file holds no JSON object"),
        (b'{"schema_version": "1"}', "is not a headmech {what}: it has no"),
    ],
    ids=["missing", "empty", "binary", "syntax", "a-list", "null", "no-keys"],
)
@pytest.mark.parametrize("name", ["catalog", "pruning", "importance", "plan", "toy"])
def test_corrupt_files_are_one_line_errors(name, content, message, tmp_path):
    cls = type(RESULTS[name])
    p = tmp_path / "f.json"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(cls.SCHEMA.error, match=message.format(what=cls.SCHEMA.name)) as e:
        cls.load(p)
    assert "\n" not in str(e.value) and isinstance(e.value, ResultFileError)


def test_a_folder_without_the_file(tmp_path):
    with pytest.raises(CatalogFileError, match="no catalog file at .*catalog.json"):
        HeadCatalog.load(tmp_path)


@pytest.mark.parametrize(
    ("writer", "reader"), list(permutations(["catalog", "pruning", "importance", "plan"], 2))
)
def test_a_file_of_another_kind_is_named(writer, reader, tmp_path):
    path = RESULTS[writer].save(tmp_path / "f.json")
    cls = type(RESULTS[reader])
    want = f"is a headmech {type(RESULTS[writer]).SCHEMA.name}, not a {cls.SCHEMA.name}"
    with pytest.raises(cls.SCHEMA.error, match=want):
        cls.load(path)


def test_discovery_is_told_from_a_catalog(tmp_path):
    """A discovery.json has a catalog's keys and more: read as a catalog, it is named."""
    p = DISCOVERY_FILE.write(tmp_path / "discovery.json", _discovery().to_json())
    with pytest.raises(CatalogFileError, match="is a headmech discovery result, not a catalog"):
        HeadCatalog.load(p)
    assert DISCOVERY_FILE.read(p)["n_clusters"] == 1


def _discovery() -> DiscoveryResult:
    heads = [HeadIndex(a, b) for a in range(2) for b in range(2)]
    cluster = Cluster(0, heads, heads, False, 0.0, {}, {"f": 0.0})
    return DiscoveryResult(
        ModelInfo("m", 2, 2, 2, 8, 64, True), {"f": torch.zeros(2, 2)}, ["f"], {},
        torch.zeros(2, 2, dtype=torch.long), [cluster], {1: 0.0}, _catalog(), [], PROV,
    )  # fmt: skip


def test_discovery_json_has_the_header():
    data = _discovery().to_json()
    assert data["schema_version"] == DISCOVERY_FILE.version
    assert data["headmech_version"] == __version__ and data["provenance"] == PROV


@pytest.mark.parametrize("name", ["catalog", "plan", "pruning"])
def test_newer_or_unknown_schema_is_refused(name, tmp_path):
    result = RESULTS[name]
    schema = type(result).SCHEMA
    data = {**result.to_json(), "schema_version": "99", "headmech_version": "9.0.0"}
    p = tmp_path / "f.json"
    p.write_text(json.dumps(data))
    want = (
        f"{p} is a {schema.name} of schema 99 (written by headmech 9.0.0); this headmech "
        f"({__version__}) reads schema {schema.version} or older: upgrade headmech"
    )
    with pytest.raises(schema.error) as e:
        type(result).load(p)
    assert str(e.value) == want
    p.write_text(json.dumps({**data, "schema_version": "two"}))
    with pytest.raises(schema.error, match=f"has an unknown {schema.name} schema version 'two'"):
        type(result).load(p)


def test_newer_headmech_is_read_with_a_warning(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({**_catalog().to_json(), "headmech_version": "99.0.0"}))
    with pytest.warns(UserWarning, match="written by headmech 99.0.0, newer than this one"):
        assert HeadCatalog.load(p) == _catalog()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HeadCatalog.load(_catalog().save(tmp_path / "same.json"))


def test_malformed_contents_name_the_file(tmp_path):
    data = RESULTS["plan"].to_json()
    data["full"] = [[9, 9]]  # outside the plan's layers
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    with pytest.raises(KVPlanFileError, match=f"^{p} is not a headmech KV plan: "):
        KVPlan.load(p)
    data = RESULTS["catalog"].to_json()
    data["types"]["induction"]["heads"] = [[7, 0]]
    p = tmp_path / "catalog.json"
    p.write_text(json.dumps(data))
    with pytest.raises(
        CatalogFileError, match="^.* is not a headmech catalog: .*outside the model"
    ):
        HeadCatalog.load(p)


def test_error_classes():
    """Each kind raises its own subclass of ResultFileError; a KV plan's is an InputError
    (as it was); none is pickled or a bare exception."""
    assert issubclass(CatalogFileError, ResultFileError)
    assert issubclass(KVPlanFileError, ResultFileError) and issubclass(KVPlanFileError, InputError)
    assert issubclass(ResultFileError, HeadmechError)
    assert CATALOG_FILE.error is CatalogFileError and PLAN_FILE.error is KVPlanFileError
    assert {"catalog", "KV plan", "pruning result", "importance result"} <= set(SCHEMAS)


def test_saving_where_a_file_stands(tmp_path):
    (tmp_path / "file").write_text("x")
    for result in RESULTS.values():
        with pytest.raises(InputError, match="an existing file, not a folder"):
            result.save(tmp_path / "file")
        with pytest.raises(InputError, match="is a file, not a folder"):
            result.save(tmp_path / "file" / "below")


def test_a_write_leaves_no_temporary_file(tmp_path):
    RESULTS["plan"].save(tmp_path)
    RESULTS["plan"].save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
