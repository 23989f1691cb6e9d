# Everything runs from .venv, created from the lock files:
#   requirements.lock       runtime only (what `make train` needs; no torch, Beam, notebooks or pytest)
#   requirements-test.lock  runtime + the `test` and `bench` extras (what `make test` adds)
# Both are universal locks for every Python in pyproject's requires-python (3.11 to 3.14), with two JAX lines:
# jax 0.10.2 + flax 0.12.8 on 3.11, jax 0.11.2 + flax 0.12.12 (what GPU images ship) on 3.12 and later.
# A GPU host adds JAX's CUDA plugin (`make setup-cuda`, or `make setup` on a host with nvidia-smi).

# The first Python that the pinned jaxlib/grain/array-record wheels support; `make PYTHON=...` for another.
# Asked to run, not just looked up: a pyenv shim exists for every installed version but runs only some.
PYTHON ?= $(firstword $(foreach v,3.11 3.12 3.13 3.14,$(shell python$(v) -c 'import sys; print(sys.executable)' 2>/dev/null)))
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/vflash-smoke

# torch's CPU build (torch==2.13.0+cpu, test set only) is not on PyPI: it comes from a local wheel
# directory when this machine has one, else from the PyTorch CPU index. Choosing here, instead of
# passing both, keeps pip from waiting minutes on an index a machine without internet cannot reach.
WHEELS ?= /opt/wheels
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE := $(if $(wildcard $(WHEELS)/torch-*.whl),--find-links $(WHEELS),--extra-index-url $(TORCH_INDEX))

# JAX's CUDA 12 plugin on a GPU host: jax's own `cuda12` extra, installed with the runtime lock as constraints,
# so the plugin and its PJRT are the locked jaxlib's version and nothing locked moves; the CUDA libraries come
# as wheels (the host needs only the NVIDIA driver). `make setup` adds it where nvidia-smi runs; CUDA=0 or
# CUDA=1 decides instead.
CUDA ?= $(if $(shell nvidia-smi -L 2>/dev/null),1,0)

.PHONY: setup setup-cuda setup-test train test test-fast test-all lock lint clean

$(VENV)/.installed: requirements.lock pyproject.toml
	@test -n "$(PYTHON)" || { echo "Makefile: no python3.11, python3.12, python3.13 or python3.14 on PATH;" \
	    "run make PYTHON=/path/to/python3.X" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.lock
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.lock
	$(VENV)/bin/pip install --quiet $(TORCH_SOURCE) -r requirements-test.lock
	touch $@

$(VENV)/.installed-cuda: $(VENV)/.installed requirements.lock
	$(VENV)/bin/pip install --quiet -c requirements.lock "jax[cuda12]"
	touch $@

setup: $(VENV)/.installed $(if $(filter 1,$(CUDA)),$(VENV)/.installed-cuda)

setup-cuda: $(VENV)/.installed-cuda

setup-test: $(VENV)/.installed-test

train: setup
	$(PY) -m valen_jax.train --config=configs/vflash.py --workdir=$(WORKDIR)

# Two pytest-xdist workers, whole files to each (module fixtures that train are built once), heaviest files
# first (tests/conftest.py, from tests/file_seconds.json; xdist's own reorder by test count is off); the
# session-wide trained workdirs and checkpoints are built once per run for both (tests/once_per_run.py).
# CI (`make test`) leaves out the tests marked `heavy`: the whole suite took 33 min on a quiet 2-core host
# (4034 s of test time), and CI hosts have run it 3-4x slower (the same file took 282 s here against 70 s),
# past CI's 90-minute limit. The heavy tests (the training runs to a learned result, the costliest
# end-to-end commands, ~2600 s of that test time) run under `make test-all`: run it before closing a change
# to training, decoding or serving.
TEST_WORKERS ?= 2
PYTEST_XDIST = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup-test
	$(PYTEST_XDIST) --durations=25 -m "not heavy"

# A change's first feedback: the suite without the tests marked `slow` (end-to-end runs, CLI subprocesses,
# the larger compiles) or `heavy`. Its XLA programs are kept in JAX's persistent compilation cache under
# .cache/ (keyed by the program, the backend and the jax version, so a changed model recompiles): compiling
# is most of a tiny model's test, and a rerun took 141 s instead of 342 s on a 2-core host. The TPU programs
# the compile tests build on compile-only devices are written but cannot be read back without a TPU client
# (jax 0.10 warns, then compiles again), hence the one warning filtered. CI (`make test`) starts from a clean
# clone, where the cache only adds writes (330 against 342 s for this tier), so it runs without one.
JAX_TEST_CACHE = JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.cache/jax-tests JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
test-fast: setup-test
	$(JAX_TEST_CACHE) $(PYTEST_XDIST) -m "not slow and not heavy" \
		-W "ignore:Error reading persistent compilation cache entry:UserWarning"

# Everything, heavy tests included (~35 min on a quiet 2-core host).
test-all: setup-test
	$(PYTEST_XDIST) --durations=25

lint: setup-test
	$(VENV)/bin/ruff check .

# Regenerate both locks after editing pyproject.toml dependencies (needs `pip install uv`, outside .venv).
# The test lock is constrained by the runtime lock, so the two never pin a package differently.
# uv resolves torch from the same source as the install; with the PyTorch index, best-match keeps it
# from taking every other package from that index too.
LOCK_FLAGS := --universal --python-version 3.11 --no-emit-find-links
lock:
	uv pip compile pyproject.toml $(LOCK_FLAGS) -o requirements.lock
	uv pip compile pyproject.toml --extra test --extra bench $(LOCK_FLAGS) -c requirements.lock \
	    $(TORCH_SOURCE) --index-strategy unsafe-best-match -o requirements-test.lock

clean:
	rm -rf $(VENV) runs
