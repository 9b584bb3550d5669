# Two commands for a newcomer: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup sysdeps demo test test-all test-fast lint bench wheelhouse docs clean

setup: $(STAMP)

# torch is pinned first: an unpinned or newer torch pulls a multi-GB CUDA build.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU-only build from PyTorch's
# own index where no CPU wheel is at hand (PyPI's Linux wheel is the CUDA one).
TORCH_INDEX ?=
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Tools for the multi-host test lab (tests/netlab.py) and Chromium for the health page's
# browser test, installed when root and missing.
# Never fails: without them the lab's tests skip and say why.
sysdeps:
	@if [ "$$(id -u)" = 0 ] && { ! command -v nft || ! command -v ip || ! command -v tc; } >/dev/null 2>&1; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq nftables iproute2 >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nftables iproute2 >/dev/null 2>&1; } \
		|| echo "sysdeps: could not install nftables/iproute2; the netlab tests will skip"; \
	fi
	@if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null 2>&1; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq chromium >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
		|| echo "sysdeps: could not install chromium; the health page's browser test will skip"; \
	fi

demo: $(STAMP)
	$(BIN)/atoll swarm --nodes 4 --config configs/local-swarm.toml

# Two passes. Tests that only count and compare run two at a time (-n 2; a file's tests stay
# on one worker, which keeps module fixtures shared); tests marked `exclusive` (wall-clock
# rounds, timing bounds, 16 nodes) then run one at a time, with the machine to themselves.
# -v: one line per test as it ends; the slowest of each pass are listed at its end.
test: $(STAMP) sysdeps
	$(BIN)/python -m pytest -v -m "not slow and not exclusive" -n 2 --dist loadfile --durations=30
	$(BIN)/python -m pytest -v -m "not slow and exclusive" --durations=15

test-all: $(STAMP) sysdeps
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not integration"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks all --quick

# The wheels a node needs besides torch, in parts of at most 56 MiB, for the GPU study on
# a machine that has only torch (dev/gpu-study.sh, docs/benchmarks.md "The GPU study").
wheelhouse: $(STAMP)
	rm -rf .wheelhouse
	$(BIN)/python dev/wheelhouse.py .wheelhouse

# The docs site on http://127.0.0.1:8000, rebuilt on every change (mkdocs.yml, docs/).
# make test builds it with --strict (tests/unit/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info .atoll .artifacts .wheelhouse .gpu-site
