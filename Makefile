# Developer entry points. `make help` lists them.
#
# `make test` and `make demo` build the virtual environment on their own.
# `make gpu` runs the tests and benchmarks with an existing python (default
# python3) and no installs, for a GPU machine whose image already has torch,
# pytest, hypothesis and pytest-benchmark.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SRC_PATH := packages/dispatch/src:packages/capture/src:packages/manager/src
BENCH_DIR ?= .benchmarks
PYTEST_FLAGS ?=

.PHONY: help setup test typecheck lint bench demo gpu gpu-test gpu-bench clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml packages/*/pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade 'pip>=25.1'
	# Torch first, from the pinned CPU build, so nothing below pulls a CUDA build.
	$(VPY) -m pip install -q --group dev
	$(VPY) -m pip install -q -e packages/dispatch -e packages/capture -e packages/manager
	touch $@

setup: $(STAMP)  ## Create .venv: pinned dev tools, torch (CPU), the three packages editable

typecheck: $(STAMP)  ## mypy --strict over the three src folders and tests/, one run
	$(VENV)/bin/mypy

lint: $(STAMP)  ## ruff check
	$(VENV)/bin/ruff check packages tests

test: typecheck  ## Type check, then the tests (GPU tests skip without CUDA)
	$(VPY) -m pytest $(PYTEST_FLAGS)

# One process per benchmark module: a device-side assert poisons a CUDA context
# for good, so one broken module must not take the others' numbers with it.
define run_benchmarks
	mkdir -p $(BENCH_DIR); status=0; \
	for file in tests/benchmarks/test_bench_*.py; do \
	    name=$$(basename $$file .py); \
	    PYTHONPATH=$(2) $(1) -m pytest -p no:cacheprovider $$file --benchmark-only \
	        --benchmark-json=$(BENCH_DIR)/$$name.json $(PYTEST_FLAGS); \
	    code=$$?; [ $$code -eq 0 ] || [ $$code -eq 5 ] || status=1; \
	done; \
	PYTHONPATH=$(2) $(1) -m tests.benchmarks.report $$(ls $(BENCH_DIR)/test_bench_*.json) $(BENCH_DIR) \
	    || status=1; \
	exit $$status
endef

bench: $(STAMP)  ## Benchmarks: JSON, a Markdown table and a plot under $(BENCH_DIR)
	$(call run_benchmarks,$(VPY),.)

demo: $(STAMP)  ## The main job: capture and replay the reference decoder
	$(VPY) -m cudagraph_manager.demo

gpu: gpu-test gpu-bench  ## Tests, then benchmarks, with $(PYTHON) and no installs

gpu-test:  ## Tests only, with $(PYTHON) and no installs
	PYTHONPATH=$(SRC_PATH):. $(PYTHON) -m pytest -p no:cacheprovider $(PYTEST_FLAGS)

gpu-bench:  ## Benchmarks only, with $(PYTHON) and no installs
	$(call run_benchmarks,$(PYTHON),$(SRC_PATH):.:$(PYTHONPATH))

clean:  ## Remove the venv and caches
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache $(BENCH_DIR)
