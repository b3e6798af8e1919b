"""Temporary folders the library makes are removed: with their owner, or at exit."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from headmech.core.scratch import scratch_folder


class _Owner:
    pass


def test_a_folder_goes_with_its_owner() -> None:
    owner = _Owner()
    path = scratch_folder("headmech-test-owner-", owner=owner)
    (path / "weights.bin").write_bytes(b"0" * 10)
    assert path.is_dir()
    del owner
    gc.collect()
    assert not path.exists()


def test_a_folder_without_owner_goes_at_exit() -> None:
    code = (
        "from headmech.core.scratch import scratch_folder\n"
        "p = scratch_folder('headmech-test-exit-')\n"
        "(p / 'config.json').write_text('{}')\n"
        "print(p)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip())
    assert path.name.startswith("headmech-test-exit-")
    assert not path.exists()


@pytest.mark.end_to_end  # a fresh process: make test runs it, make test-fast leaves it
def test_a_tiny_model_leaves_no_folder_behind() -> None:
    code = (
        "from headmech.models.tiny import tiny_model\n"
        "m = tiny_model('llama', name='leak-check', seed=0)\n"
        "print(m.cfg.n_layers)\n"
    )
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("headmech-leak-check-*"))
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(Path(tempfile.gettempdir()).glob("headmech-leak-check-*")) == before
