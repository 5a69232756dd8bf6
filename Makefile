# Two set-up commands on a fresh machine: `make demo` and `make test` (both create .venv and install everything).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast venv fetch report clean fix-copies

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build (see ../shared/TESTBED.md)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

fetch: $(STAMP)
	$(PY) -m adaflash_hf.testbed fetch

demo: fetch
	$(PY) examples/generate.py

# The suite runs on every core (pytest-xdist, one torch thread per worker: the tiny models are latency-bound, so
# two single-threaded workers do twice the work of one two-threaded process). Work stealing balances the few long
# real-model / accelerate-launch tests (2 cores, quiet: 224 s vs 263 s with one module per worker, 487 s serial).
# TEST_WORKERS=0: serial.
TEST_WORKERS ?= auto
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --durations=10 -n $(TEST_WORKERS) --dist worksteal

test: fetch
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

# Reruns the benches behind the claims and writes docs/results.md + docs/results_*.png (QUICK=1: ~15 min on 2 cores).
report: fetch
	$(PY) -m adaflash_hf.cli report $(if $(QUICK),--quick) --output-dir docs

clean:
	rm -rf $(VENV) build *.egg-info

# Rewrite the model code copied next to the shipped checkpoints (`auto_map`) from its source.
fix-copies: $(STAMP)
	$(PY) -m adaflash_hf.checkpoints --fix-copies
