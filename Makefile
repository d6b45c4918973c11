# The two quick-start commands: `make report` (the main job) and `make test` (the tests).
# Both create or refresh the virtual environment first, from the pinned constraints.

SHELL := /bin/bash
# Some shells set it; the commands below then would compile every module they import anew in
# every process (make test starts dozens), instead of once.
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
BIN := $(VENV)/bin
# kups and brainstate need Python 3.12; pyenv keeps it outside PATH on some machines.
PYTHON312 ?= $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  $$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$c; break; }; done)

.PHONY: venv test report conform bench asv-quick gpu-check clean-venv

# Not byte-compiled at install: each module is compiled on its first import and its bytecode
# kept (PYTHONDONTWRITEBYTECODE unexported, above). make test imports 9,327 of the 21,231 files
# that compileall or pip would compile (docs/gpu.md, section 18).
$(VENV)/.installed: pyproject.toml constraints.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (kups and brainstate need it); set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON312) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[all]'
	@touch $@

venv: $(VENV)/.installed

# TRITON_INTERPRET=1: the Triton kernels run through the whole suite on the CPU (no GPU here).
# Two pytest processes side by side, as most of the suite is single-threaded Python and CI has
# two cores: the conformance suite in the foreground, with the tests of the command, the
# reports and the reference (CONFORMANCE_SIDE) after it, and the other tests beside it, their
# output shown when they end (README, "Tests"). The suite's own tests (SELF_TESTS: they check
# the suite, not an implementation, and write no results) run with the other tests. The split
# keeps the two processes about as long (docs/gpu.md, section 18). The other tests start with
# the benchmarks' tests: by the time they reach the implementations' tests, the conformance
# process has built DeepSpeed's op and numba's on-disk cache holds the kernels, so they neither
# wait for the build nor compile those kernels again (section 19). PYTEST_ARGS (options such as
# `--profile thorough`) goes to both; to run some tests only, call `$(BIN)/python -m pytest PATH`.
SELF_TESTS := conformance/tests conformance/test_suite_catches_broken.py
CONFORMANCE_SIDE := reference/tests reports/tests clipbench/tests
OTHER_TESTS := benchmarks/tests impls/tests $(SELF_TESTS)
test: $(VENV)/.installed
	@others_log=$$(mktemp); others=; trap 'rm -f "$$others_log"; [ -z "$$others" ] || kill $$others 2>/dev/null' EXIT; \
	echo "the other tests ($(OTHER_TESTS)) run beside the conformance suite; their output follows it"; \
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -p no:cacheprovider $(OTHER_TESTS) $(PYTEST_ARGS) >"$$others_log" 2>&1 & others=$$!; \
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -p no:cacheprovider conformance $(SELF_TESTS:%=--ignore=%) $(CONFORMANCE_SIDE) $(PYTEST_ARGS); conformance=$$?; \
	wait $$others; rest=$$?; others=; \
	echo; echo "=== the other tests: $(OTHER_TESTS) ==="; cat "$$others_log"; \
	echo "make test: conformance exit $$conformance, other tests exit $$rest"; \
	[ $$conformance -eq 0 ] && [ $$rest -eq 0 ]

report: $(VENV)/.installed
	$(BIN)/clipbench report $(REPORT_ARGS)

conform: $(VENV)/.installed
	$(BIN)/clipbench conform $(CONFORM_ARGS)

bench: $(VENV)/.installed
	$(BIN)/clipbench bench $(BENCH_ARGS)

# The GPU report (docs/gpu.md, section 7): `clipbench report --device cuda` for every
# implementation with a GPU path, into reports/latest-gpu/, with the card's achieved bandwidth
# against its datasheet peak. Without a GPU: one line, exit 0, before anything is installed.
# With one: JAX's CUDA plugin (the pinned `cuda` extra) first. No TRITON_INTERPRET here: on a
# GPU the Triton kernels are compiled.
gpu-check: $(VENV)/.installed
	@if $(BIN)/python -m clipbench.benchmarks.gpu_check --present; then \
	  $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[all,cuda]' && \
	  $(BIN)/python -m clipbench.benchmarks.gpu_check $(GPU_CHECK_ARGS); \
	fi

clean-venv:
	rm -rf $(VENV)
