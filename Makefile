# Two commands for a fresh machine: `make demo` (the main job) and `make test`.
# Each builds .venv on first use: torch first and pinned (the CPU wheel, no CUDA
# download), then recshard with its extras. `make demo EXTRA=cuda` on GPU machines.
PYTHON ?= python3
EXTRA ?= cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: demo test test-cuda lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	$(BIN)/pip install --disable-pip-version-check -q -e '.[$(EXTRA),dev]'
	touch $@

# glibc: keep large per-step buffers in the heap instead of mmap/munmap every step (see README)
MALLOC_ENV := MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483648

demo: $(STAMP)
	$(MALLOC_ENV) $(BIN)/torchrun --standalone --nproc_per_node 2 -m examples.dlrm.train --demo

test: lint
	$(BIN)/python -m pytest

# The CUDA paths' tests in one run (a one-GPU machine, under 8 minutes); built with EXTRA=cuda.
test-cuda:
	$(MAKE) EXTRA=cuda $(VENV)/.installed-cuda
	$(BIN)/python -m pytest -m cuda tests/cuda

# Formatting and lint rules (pyproject.toml's [tool.ruff]); `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet recshard tests examples benchmarks scripts

clean:
	rm -rf $(VENV)
