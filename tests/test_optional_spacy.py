"""headmech without the syntactic extra: spaCy cannot be imported, the prose types still
run (sentences split by a regular expression, no parses), and the syntactic type says how
to add it, in one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoSpacy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "spacy" or name.startswith(("spacy.", "en_core_web")):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoSpacy())
    import headmech
    from headmech.core.errors import HeadmechError

    model = headmech.load_model(sys.argv[1])
    cat = headmech.classify(model, ["positional", "previous_token"], n_sentences=16)
    assert cat["positional"].score.isfinite().all()
    assert "spacy" not in sys.modules
    try:
        headmech.classify(model, ["syntactic"], n_sentences=16)
    except HeadmechError as e:
        assert "pip install 'headmech[syntactic]'" in str(e) and "\\n" not in str(e), e
    else:
        raise AssertionError("syntactic ran without spaCy")
    encoder = headmech.load_model(sys.argv[2])  # every default type fits it but syntactic
    everything = headmech.classify(encoder, n_sentences=16, n_sequences=4, half_len=16)
    assert "syntactic" in everything.meta["skipped"], everything.meta
    assert "syntactic" not in everything.types
    print("ok", sorted(everything.types))
    """
)


@pytest.mark.end_to_end  # a fresh process: make test runs it, make test-fast leaves it
def test_prose_types_run_without_spacy(tiny_dirs):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_dirs["llama"]), str(tiny_dirs["bert"])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout


def test_split_sentences_without_spacy_uses_a_rule(monkeypatch):
    from headmech.probes import corpus

    monkeypatch.setattr(corpus, "spacy_installed", lambda: False)
    text = 'This is one. That is two! "Quoted?" Then (three). e.g. lower stays.'
    assert corpus.split_sentences([text]) == [
        "This is one.", "That is two!", '"Quoted?"', "Then (three). e.g. lower stays."
    ]  # fmt: skip
