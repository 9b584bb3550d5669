# Two commands for a newcomer: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all test-fast lint bench clean

setup: $(STAMP)

# torch is pinned first: an unpinned or newer torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/atoll swarm --nodes 4 --config configs/local-swarm.toml

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not integration"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks all --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
