# Everything runs from .venv, created from the lock file (requirements.lock).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/vflash-smoke

.PHONY: setup train test lock lint clean

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -r requirements.lock
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

setup: $(VENV)/.installed

train: setup
	$(PY) -m valen_jax.train --config=configs/vflash.py --workdir=$(WORKDIR)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

# Regenerate the lock after editing pyproject.toml dependencies (needs `pip install uv`).
lock:
	uv pip compile pyproject.toml --extra test --extra beam --extra notebooks --python-version 3.11 --find-links /opt/wheels --emit-find-links -o requirements.lock

clean:
	rm -rf $(VENV) runs
