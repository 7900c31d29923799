# Developer entry points. `make help` lists them.
#
# `make test` and `make demo` build the virtual environment on their own.
# `make gpu` runs the tests and benchmarks with an existing python (default
# python3) and no installs, for a GPU machine whose image already has torch,
# pytest, hypothesis and pytest-benchmark.
#
# Torch: `make setup` (and so `make test`) installs the dev group's torch pin
# first and alone, from TORCH_INDEX_URL when that is set, e.g.
#   make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# for the CPU build on a machine whose package index would serve a CUDA build
# (PyPI's Linux torch is one, several GB); the pin is then already satisfied
# when the rest of the group installs. Unset, pip's own configuration decides.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SRC_PATH := packages/dispatch/src:packages/capture/src:packages/manager/src
BENCH_DIR ?= .benchmarks
PYTEST_FLAGS ?=
TORCH_INDEX_URL ?=
# The dev group's torch requirement, read from pyproject.toml: the pin lives there only.
TORCH_PIN := $(shell sed -nE 's/^[[:space:]]*"(torch==[^"]+)".*/\1/p' pyproject.toml)
PACKAGES := dispatch capture manager

.PHONY: help setup test typecheck lint dist bench demo gpu gpu-test gpu-bench soak clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml packages/*/pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade 'pip>=25.1'
	# Torch first and alone, from TORCH_INDEX_URL when set, so nothing below pulls a CUDA build.
	$(VPY) -m pip install -q $(if $(TORCH_INDEX_URL),--index-url '$(TORCH_INDEX_URL)') \
	    '$(or $(TORCH_PIN),$(error no "torch==..." line in the dev group of pyproject.toml))'
	$(VPY) -m pip install -q --group dev
	$(VPY) -m pip install -q -e packages/dispatch -e packages/capture -e packages/manager
	touch $@

setup: $(STAMP)  ## Create .venv: pinned dev tools, torch (see TORCH_INDEX_URL), the packages editable

typecheck: $(STAMP)  ## mypy --strict over the three src folders, examples/ and tests/, one run
	$(VENV)/bin/mypy

lint: $(STAMP)  ## ruff check and ruff format --check
	$(VENV)/bin/ruff check packages examples tests
	$(VENV)/bin/ruff format --check packages examples tests

test: typecheck lint  ## Type check and lint, then the tests (GPU tests skip without CUDA)
	$(VPY) -m pytest $(PYTEST_FLAGS)

# Three pure-Python wheels need no torch: a venv of their own holds the dev
# group's pinned build and hatchling alone, built once, used without build
# isolation. Each package gets an sdist, and a wheel built from that sdist.
BUILD_VENV := .venv-build
BUILD_STAMP := $(BUILD_VENV)/.installed
BUILD_PINS := $(shell sed -nE 's/^[[:space:]]*"((build|hatchling)==[^"]+)".*/\1/p' pyproject.toml)

$(BUILD_STAMP): pyproject.toml
	test -x $(BUILD_VENV)/bin/python || $(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/python -m pip install -q $(BUILD_PINS)
	touch $@

dist: $(BUILD_STAMP)  ## Wheels and sdists of the three packages into dist/ (a small build venv, no torch)
	rm -f dist/cudagraph_*
	for pkg in $(PACKAGES); do \
	    $(BUILD_VENV)/bin/python -m build --no-isolation --outdir dist packages/$$pkg || exit 1; \
	done

# One process per benchmark module: a device-side assert poisons a CUDA context
# for good, so one broken module must not take the others' numbers with it.
# Each module's pytest exit status goes beside its JSON (NAME.status), so the
# report tells a module that errored (an import error, a failed test) from
# one whose benchmarks all skipped (status 5, or an empty JSON).
define run_benchmarks
	mkdir -p $(BENCH_DIR); status=0; \
	for file in tests/benchmarks/test_bench_*.py; do \
	    name=$$(basename $$file .py); \
	    PYTHONPATH=$(2) $(1) -m pytest -p no:cacheprovider $$file --benchmark-only \
	        --benchmark-json=$(BENCH_DIR)/$$name.json $(PYTEST_FLAGS); \
	    code=$$?; echo $$code > $(BENCH_DIR)/$$name.status; \
	    [ $$code -eq 0 ] || [ $$code -eq 5 ] || status=1; \
	done; \
	PYTHONPATH=$(2) $(1) -m tests.benchmarks.report $$(ls $(BENCH_DIR)/test_bench_*.json) $(BENCH_DIR) \
	    || status=1; \
	exit $$status
endef

bench: $(STAMP)  ## Benchmarks: JSON, a Markdown table and a plot under $(BENCH_DIR)
	$(call run_benchmarks,$(VPY),.)

demo: $(STAMP)  ## The main job: capture and replay the reference decoder (examples/, from the root)
	$(VPY) -m examples.demo

gpu: gpu-test gpu-bench  ## Tests, then benchmarks, with $(PYTHON) and no installs

# gpu-test deselects the one test that installs from the package index (a GPU machine may
# have none); PYTEST_FLAGS with a -m of its own replaces that deselection.
# Each target that uses $(PYTHON) first checks that it has what the target imports
# (tests/preflight.py), and names what is missing instead of one import error per module.
gpu-test:  ## Tests only, with $(PYTHON) and no installs
	$(PYTHON) -m tests.preflight gpu-test
	PYTHONPATH=$(SRC_PATH):. $(PYTHON) -m pytest -p no:cacheprovider -m "not needs_index" $(PYTEST_FLAGS)

gpu-bench:  ## Benchmarks only, with $(PYTHON) and no installs
	$(PYTHON) -m tests.preflight gpu-bench
	$(call run_benchmarks,$(PYTHON),$(SRC_PATH):.:$(PYTHONPATH))

# 100,000 random reference-decoder steps in every mode, checked against eager
# (tests/soak.py says how); not part of `make test`. SOAK_FLAGS: e.g. --steps 1000.
SOAK_OUT ?= $(BENCH_DIR)/soak.json
SOAK_FLAGS ?=
# The dev venv's python by default (it has torch); on a GPU machine whose
# image has torch, `make soak PYTHON=python3` uses that one and installs nothing.
SOAK_PYTHON := $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(VPY))
SOAK_NEEDS := $(if $(filter $(VPY),$(SOAK_PYTHON)),$(STAMP))
soak: $(SOAK_NEEDS)  ## Soak on the GPU: 100k replayed steps vs eager, memory flat (PYTHON=python3: no installs)
	$(SOAK_PYTHON) -m tests.preflight soak
	PYTHONPATH=$(SRC_PATH):. $(SOAK_PYTHON) -m tests.soak --out $(SOAK_OUT) $(SOAK_FLAGS)

# Everything .gitignore lists that the project makes (tests/test_makefile.py checks it): the
# venvs, the tools' caches, Hypothesis's example database, benchmark output, build outputs,
# and every __pycache__ and *.egg-info below the root (.git left alone).
clean:  ## Remove the venvs, every cache and the build outputs
	rm -rf $(VENV) $(BUILD_VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis $(BENCH_DIR) \
	    build dist .whl
	find . -path ./.git -prune -o -type d \( -name __pycache__ -o -name '*.egg-info' \) -prune \
	    -exec rm -rf {} +
