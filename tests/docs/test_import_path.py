"""The suite runs without the repo root on sys.path (the Makefile calls pytest's own script, and
tests/conftest.py takes the root off where ``python -m pytest`` put it): there the Triton
sources in kernels/ would stand in for PyPI's ``kernels`` package, which transformers imports
when it is installed, and every transformers model would fail to build."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_repo_root_is_not_on_sys_path() -> None:
    roots = {Path(p or ".").resolve() for p in sys.path}
    assert REPO not in roots
    spec = importlib.util.find_spec("kernels")  # PyPI's (in a venv, maybe under the repo) or none
    ours = REPO / "kernels"
    assert spec is None or spec.origin is None or not Path(spec.origin).is_relative_to(ours)


def test_the_makefile_runs_pytests_own_script() -> None:
    lines = (REPO / "Makefile").read_text().splitlines()
    target = next(i for i, line in enumerate(lines) if line.startswith("pytest: setup"))
    recipe = lines[target + 1]
    assert recipe.strip().startswith("$(VENV)/bin/pytest "), recipe
