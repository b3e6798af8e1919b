"""The tutorials in tutorials/ run top to bottom (with HEADMECH_TUTORIAL_SMALL=1, which
shrinks their probes) and their assert cells on the published findings pass."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from headmech.publish.site import RENDERED, TUTORIAL_SIZE, TUTORIAL_SOURCE, notebook_digest

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))


def test_there_are_eleven_tutorials_without_stored_outputs():
    expected = ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11"]
    assert [p.name[:2] for p in NOTEBOOKS] == expected
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), path.name
        assert any(line.startswith("assert") for c in code for line in c.source.splitlines()), (
            f"{path.name} asserts nothing"
        )


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory) -> str:
    """A kernel spec for this interpreter, so the notebooks run in the test's environment
    even where a system-wide "python3" kernel points at another Python."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    # ipykernel writes the spec into a folder of its own under the temporary directory and
    # leaves that folder behind (empty): here it is pytest's, which pytest removes
    default, tempfile.tempdir = tempfile.tempdir, str(prefix)
    try:
        install(kernel_name="headmech-tutorials", prefix=str(prefix))
    finally:
        tempfile.tempdir = default
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        filter(None, [str(prefix / "share" / "jupyter"), os.environ.get("JUPYTER_PATH")])
    )
    return "headmech-tutorials"


@pytest.fixture
def kernel_client(kernel_name, tmp_path):
    """Makes clients whose kernel talks over Unix sockets, not TCP ports: jupyter_client
    picks five free ports and releases them before the kernel binds them, a race another
    process can win (CI once failed with "Address already in use" and a kernel that did
    not answer in 60 s). A socket file in a fresh folder cannot be taken."""
    folder = tempfile.mkdtemp(prefix="hmk")  # short: a socket path holds at most 107 bytes

    def make(nb, timeout: int) -> NotebookClient:
        km = KernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(folder, "k"))
        return NotebookClient(
            nb, km=km, timeout=timeout, resources={"metadata": {"path": str(tmp_path)}}
        )

    yield make
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.tutorial
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_runs(path, tmp_path, monkeypatch, kernel_client):
    monkeypatch.setenv("HEADMECH_TUTORIAL_SMALL", "1")
    # the folders a notebook makes with tempfile (a contributor's catalog in 06) go where
    # pytest removes them
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    # the kernel is not measured by coverage (COVERAGE=1 measures the processes tests start):
    # the notebooks call the library paths the tests cover, and tracing them costs minutes
    monkeypatch.delenv("COVERAGE_PROCESS_CONFIG", raising=False)
    monkeypatch.delenv("COVERAGE_PROCESS_START", raising=False)
    # ipykernel's inline backend (headless, like Agg): figures become PNG outputs, which
    # the rendered copy in the atlas shows
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # the kernel imports headmech from this checkout, also when it is not installed
    root = str(TUTORIALS.parent)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    nb = nbformat.read(path, as_version=4)
    client = kernel_client(nb, timeout=900)
    try:
        client.execute()
    except CellExecutionError as e:
        # the failing cell and its error, without the kernel's ANSI traceback noise
        pytest.fail(f"{path.name}: {str(e).splitlines()[-1] if str(e) else e}\n{e}", pytrace=False)
    _render(nb, path)


@pytest.mark.end_to_end  # a fresh process: make test runs it, make test-fast leaves it
def test_a_notebook_shows_classify_progress_without_a_tqdm_warning(monkeypatch, kernel_client):
    """``classify`` shows progress by default; in a kernel without ipywidgets (this one)
    tqdm.auto, first imported by transformers, would warn in a block of stderr
    (``TqdmWarning: IProgress not found``) that opened every tutorial's output. The
    rendered page keeps no trace of the finished bars."""
    root = str(TUTORIALS.parent)
    code = (
        "import headmech\n"
        "model = headmech.load_model('toy-induction')\n"
        "catalog = headmech.classify(model, ['induction'], n_sequences=4, n_boot=0)\n"
        "print(catalog['induction'].threshold)"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.delenv("COVERAGE_PROCESS_START", raising=False)
    kernel_client(nb, timeout=300).execute()
    outputs = nb.cells[0].outputs
    stderr = "".join(o.text for o in outputs if o.get("name") == "stderr")
    assert "TqdmWarning" not in stderr and "IProgress" not in stderr, stderr
    assert "repeated_random (induction)" in stderr  # the bar, on by default
    _without_finished_bars(nb)
    assert [o.name for o in nb.cells[0].outputs] == ["stdout"]  # only the printed threshold


SITE_TUTORIALS = TUTORIALS.parent / "catalog" / "site" / "tutorials"


def _without_finished_bars(nb) -> None:
    """Drop the stderr that only drew progress bars: ``classify`` shows them by default,
    each one erased when done (carriage returns), which a rendered page would show as an
    empty error box."""
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor

    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        CoalesceStreamsPreprocessor().preprocess_cell(cell, {}, i)  # merged, \r applied
        cell.outputs = [
            o
            for o in cell.outputs
            if not (o.output_type == "stream" and o.name == "stderr" and not o.text.strip())
        ]


def _render(nb, path: Path) -> None:
    """The executed notebook as HTML (images embedded) in the atlas, catalog/site/tutorials/,
    so a reader sees every figure without running it; the source notebook stays stripped."""
    from nbconvert import HTMLExporter

    _without_finished_bars(nb)
    exporter = HTMLExporter(embed_images=True)
    body, _ = exporter.from_notebook_node(nb)
    # the lab template loads MathJax and require.js from a CDN: the atlas works offline, so
    # they go (the notebooks' figures are embedded PNGs, their math stays as TeX source)
    body = re.sub(r'<script[^>]*src="https://cdnjs[^"]*"[^>]*>\s*</script>', "", body)
    # the probe size it ran at, which the atlas's frame states (headmech.publish.site)
    size = "small" if os.environ.get("HEADMECH_TUTORIAL_SMALL") == "1" else "published"
    body = body.replace("<head>", f'<head>\n<meta name="{TUTORIAL_SIZE}" content="{size}">', 1)
    # which notebook it renders (make tutorials' copies in docs/tutorials are checked with it)
    digest = notebook_digest(path)
    body = body.replace("<head>", f'<head>\n<meta name="{TUTORIAL_SOURCE}" content="{digest}">', 1)
    where = Path(os.environ.get("HEADMECH_TUTORIAL_RENDER") or SITE_TUTORIALS)
    where.mkdir(parents=True, exist_ok=True)
    out = where / f"{path.stem}.html"
    out.write_text(body, encoding="utf-8")
    pngs = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert body.count('src="data:image/png') >= pngs, f"{out}: figures not embedded"
    if any("plt.show()" in c.source for c in nb.cells if c.cell_type == "code"):
        assert pngs > 0, f"{path.name} shows figures, none was captured"
    assert not re.search(r'(src|href)="https?://', body.split("<body")[0]), (
        f"{out} loads from the web"
    )


def test_the_committed_renderings_are_of_the_notebooks_as_they_are():
    """docs/tutorials holds a rendering of every tutorial (``make tutorials``, small size),
    each made from the notebook's current cells: ``make site`` shows them without the
    suite running."""
    rendered = TUTORIALS.parent / RENDERED
    for path in NOTEBOOKS:
        page = rendered / f"{path.stem}.html"
        assert page.is_file(), f"{page} is missing: run `make tutorials`"
        head = page.read_text(encoding="utf-8").split("<body")[0]
        found = re.search(rf'<meta name="{TUTORIAL_SOURCE}" content="([0-9a-f]+)"', head)
        assert found and found[1] == notebook_digest(path), (
            f"{page} was rendered from another version of {path.name}: run `make tutorials`"
        )
        assert f'<meta name="{TUTORIAL_SIZE}" content="small">' in head


def test_make_site_alone_shows_every_tutorial(tmp_path):
    """A site built into an empty folder (``make site``, no suite run) has every tutorial,
    from the committed renderings, framed with the atlas's navigation and linked from the
    index."""
    import shutil

    from headmech.publish.site import build_site

    # one model's catalog is enough for the tutorials' pages (the whole atlas: test_site)
    shutil.copytree(TUTORIALS.parent / "catalog" / "minilm-l6", tmp_path / "catalog" / "minilm-l6")
    shutil.copytree(TUTORIALS.parent / RENDERED, tmp_path / RENDERED)
    site = tmp_path / "site"
    build_site(tmp_path / "catalog", site)
    index = (site / "index.html").read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        page = site / "tutorials" / f"{path.stem}.html"
        assert page.is_file() and f"tutorials/{path.stem}.html" in index, path.name
        assert 'href="../index.html"' in page.read_text(encoding="utf-8")  # the atlas's frame
