# Every target bootstraps .venv on a fresh clone: `make demo` and `make test` are
# the only two set-up commands a user needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tfdist-installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench lint clean gpu-check

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e '.[test,legacy]'
	@touch $(STAMP)

# The benchmarks' extra (PyTorch's CPU wheel for the DDP comparison), only for `make bench`.
BENCH_STAMP := $(VENV)/.tfdist-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	@touch $(BENCH_STAMP)

demo: $(STAMP)
	$(VENV)/bin/tfdist demo

# Two test processes, each test file whole in one of them (module fixtures such as
# a cluster job run once): most of a test's time is single-threaded tracing, so
# the two cores overlap it. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Everything but the slow and cluster tests.
test-fast: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow and not cluster" $(PYTEST_ARGS)

bench: $(BENCH_STAMP)
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# TensorFlow's GPU paths in one command (docs/gpu.md): overhead, zoo parity, sinking and ZeRO,
# about 7 minutes on one GPU; a CPU smoke of every section where no GPU is found. On a GPU host
# without a package index run `python3 benchmarks/gpu_check.py` through ../shared/gpu's bundle.
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check tfdist tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
