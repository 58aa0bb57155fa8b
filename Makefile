# Two commands for a fresh machine: `make demo` (the main job) and `make test`.
# Each builds .venv on first use: torch first and pinned (the CPU wheel, no CUDA
# download), then recshard with its extras. `make demo EXTRA=cuda` on GPU machines.
PYTHON ?= python3
EXTRA ?= cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: demo test test-cuda lint docs docs-check clean

$(STAMP): pyproject.toml setup.py $(wildcard recshard/*/csrc/*.cpp recshard/*/csrc/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	$(BIN)/pip install --disable-pip-version-check -q -e '.[$(EXTRA),dev]'
	touch $@

# glibc: keep large per-step buffers in the heap instead of mmap/munmap every step
# (docs/performance.md, "The allocator")
MALLOC_ENV := MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483648

demo: $(STAMP)
	$(MALLOC_ENV) $(BIN)/torchrun --standalone --nproc_per_node 2 -m examples.dlrm.train --demo

test: lint docs-check
	$(BIN)/python -m pytest

# The CUDA paths' tests in one run (a one-GPU machine, under 8 minutes); built with EXTRA=cuda.
test-cuda:
	$(MAKE) EXTRA=cuda $(VENV)/.installed-cuda
	$(BIN)/python -m pytest -m cuda tests/cuda

# Formatting and lint rules (pyproject.toml's [tool.ruff]); `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet recshard tests examples benchmarks scripts

# The user guide and API reference (mkdocs.yml, docs/) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# `make test` builds the docs strictly into a scratch folder: broken links, anchors and API
# references fail it (no --quiet: it would hide the warnings that --strict counts).
docs-check: $(STAMP)
	out=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d $$out; \
	rc=$$?; rm -rf $$out; exit $$rc

clean:
	rm -rf $(VENV) site
