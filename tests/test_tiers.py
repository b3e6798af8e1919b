"""The test tiers: ``make test-fast`` (HEADMECH_TEST_TIER=fast, ``-m "not slow"``) refuses a
bundled real model loudly, so a real-model test without the ``slow`` marker cannot slip
into the 3-minute tier; tiny models still load there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROBE = """
import pytest
import headmech
from headmech.testing import tiny_model


def test_a_tiny_model_loads():
    assert tiny_model("causal").cfg.n_layers == 2


@pytest.mark.parametrize("name", ["minilm-l6", "smollm2-135m"])
def test_a_real_model_is_refused(name):
    headmech.load_model(name)
"""


@pytest.mark.end_to_end  # a fresh process: make test runs it, make test-fast leaves it
def test_fast_tier_refuses_a_bundled_real_model(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {
        **os.environ,
        "HEADMECH_TEST_TIER": "fast",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
         "-m", "not slow", "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 passed" in out and "2 failed" in out, out
    assert out.count("make test-fast loaded a bundled real model") >= 2, out
