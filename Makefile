# The README's two commands: `make demo` (the main job: Lab 6 on Apiary) and `make test`.
# Each creates .venv and installs the pinned tree (requirements.lock) on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench up clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev,postgres]'
	touch $(STAMP)

demo: setup
	$(BIN)/apiary demo lab6

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check platform flows tests examples bench

bench: setup
	$(BIN)/python bench/run.py

up: setup
	$(BIN)/apiary up

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
