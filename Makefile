# Two commands do all set-up on a fresh machine:
#   make demo   - a model loaded from disk once, then a restarted engine attaching it from the cache
#   make test   - lint, type check and the test suite
# Both create .venv on first use. Where no NVIDIA GPU is present, the CPU build of PyTorch is installed
# (TORCH_SPEC), so nothing ever downloads a multi-GB CUDA build by accident.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH_SPEC ?= torch>=2.4
else
TORCH_SPEC ?= torch==2.13.0
endif

.PHONY: demo test lint bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python examples/demo.py

lint: $(BIN)/.installed
	$(BIN)/ruff check weightcache tests examples benchmarks
	$(BIN)/ruff format --check weightcache tests examples benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

bench: $(BIN)/.installed
	$(BIN)/weightcache bench --sizes 1,2,8 --tensors 500 --json bench-results/cpu-attach.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
