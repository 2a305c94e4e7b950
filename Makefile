# The README's two commands: `make demo` (the main job: Lab 6 on Apiary) and `make test`.
# Each creates .venv and installs the pinned tree (requirements.lock) on a fresh machine.
# `make check` runs the habits CI holds the code to (.ci/run): lint, typecheck, contracts.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# MLflow, the model registry `apiary up` runs, in a venv of its own: its pins clash with the main venv's.
MLFLOW_VENV := .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed

.PHONY: setup demo test test-fast test-gpu lint typecheck contracts check bench up clean

# SETUP: what lint/test-fast need first. The CI pipeline's unit stage runs `make lint test-fast
# VENV=<its own venv> SETUP=` in a workspace (the commit under test, put first on PYTHONPATH), so
# that a workspace does not install a venv of its own. PYTEST_ARGS: more pytest arguments (paths,
# --junitxml).
SETUP ?= setup
PYTEST_ARGS ?=

# The tests that start real services or processes, or need a GPU (pyproject's markers); `make
# test-fast` skips them.
SLOW_MARKERS := e2e or postgres or prometheus or prefect or docker or netns or dfs or mlflow or gpu

setup: $(STAMP) $(MLFLOW_STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev,postgres]'
	touch $(STAMP)

$(MLFLOW_STAMP): deploy/mlflow/requirements.txt
	test -x $(MLFLOW_VENV)/bin/python || $(PY) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q -r deploy/mlflow/requirements.txt
	touch $(MLFLOW_STAMP)

demo: setup
	$(BIN)/apiary demo lab6

test: setup
	$(BIN)/python -m pytest -q

# The unit suite: no embedded platform, PostgreSQL, Prometheus or Prefect server (about 10 min on
# 2 cores: 3,367 tests on 2026-11-30).
test-fast: $(SETUP)
	$(BIN)/python -m pytest -q -m "not ($(SLOW_MARKERS))" $(PYTEST_ARGS)

# The tests that run kernels on a real GPU (examples/stress/bench.py with PyTorch or CuPy). Neither
# is in requirements.lock (CUDA wheels are gigabytes): on a GPU machine, install one into the venv
# first (`.venv/bin/pip install torch`, or cupy-cuda12x). Without them every test skips, saying why.
test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

lint: $(SETUP)
	$(BIN)/ruff check platform flows tests examples bench

# mypy over platform/apiary ([tool.mypy]: strict for scheduler, lifecycle and spec).
typecheck: setup
	$(BIN)/mypy

# The import contracts ([tool.importlinter]): the pure core imports no I/O, directly or not; the packages form layers.
contracts: setup
	$(BIN)/lint-imports --no-cache

check: lint typecheck contracts

bench: setup
	$(BIN)/python bench/run.py

up: setup
	$(BIN)/apiary up

clean:
	rm -rf $(VENV) $(MLFLOW_VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
