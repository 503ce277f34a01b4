# Every target bootstraps .venv on a fresh clone: `make demo` and `make test` are
# the only two set-up commands a user needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tfdist-installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast test-compat bench lint clean slurm gpu-check

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

test: $(STAMP) slurm
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The single-host Slurm tests/test_slurm.py starts (Debian's slurm-wlm 22.05 and munge):
# installed when missing, where this is root with apt-get; elsewhere those tests skip
# and say why. Never fails the build.
slurm:
	@command -v slurmctld >/dev/null 2>&1 || command -v /usr/sbin/slurmctld >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null 2>&1; } || \
	echo "make slurm: slurm-wlm is not installed (needs root and apt-get); tests/test_slurm.py will skip"

# Everything but the slow and cluster tests.
test-fast: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow and not cluster" $(PYTEST_ARGS)

# The oldest TensorFlow and Keras that setup.py declares (tfdist/_compat/versions.py), in a
# virtualenv built from nothing each time: the parity smoke (every local strategy and step
# option against one device) and the private-name checks run there (docs/compat.md). The
# newest versions are the suite's own (`make test` runs the same tests).
COMPAT_VENV ?= .venv-oldest

test-compat:
	rm -rf $(COMPAT_VENV)
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --upgrade --quiet pip
	$(COMPAT_VENV)/bin/python -m pip install --quiet $$($(PYTHON) tfdist/_compat/versions.py --oldest) "pytest>=7" "pytest-xdist>=3"
	$(COMPAT_VENV)/bin/python -m pip install --quiet -e .
	$(COMPAT_VENV)/bin/python -c "import tensorflow as tf, keras; print('test-compat: TensorFlow', tf.__version__, 'Keras', keras.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests/compat $(PYTEST_ARGS)

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
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info .pytest_cache
