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

test: fetch
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "not slow" tests

# Reruns the benches behind the claims and writes docs/results.md + docs/results_*.png (QUICK=1: ~15 min on 2 cores).
report: fetch
	$(PY) -m adaflash_hf.cli report $(if $(QUICK),--quick) --output-dir docs

clean:
	rm -rf $(VENV) build *.egg-info

# Rewrite the model code copied next to the shipped checkpoints (`auto_map`) from its source.
fix-copies: $(STAMP)
	$(PY) -m adaflash_hf.checkpoints --fix-copies
