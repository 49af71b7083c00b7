"""The command line in a serving-only install (no torch): a flag that needs the torch runner is a
usage error (exit 2) naming the extra that brings it, before any model loads; the lean default
parses as before. Each case runs in a process where torch cannot be imported (torch is installed
for the suite, so it is refused by an import finder, as a missing package is)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpark.cli import main as cli
from kvpark.cli.flags import engine_config

WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from kvpark.cli import main as cli
from kvpark.cli.flags import engine_config
args = cli.build_parser().parse_args(sys.argv[1:])
config = engine_config(args, args.parser)
print("parsed", config.model.runner, "torch" in sys.modules)
"""
EXTRA = "pip install 'kvpark[gpu]'"


def without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--runner", "torch"], "--runner torch needs torch, which is not installed"),
        (["--weights", "dense"], "this model needs the torch runner (the lean runner cannot"),
        (["--device", "cuda"], "the model runs on a GPU"),
    ],
)
def test_a_flag_that_needs_torch_is_a_usage_error(argv: list[str], why: str) -> None:
    done = without_torch("serve", "--kv-cells", "256", *argv)
    assert done.returncode == 2, done.stderr[-2000:]
    assert why in done.stderr and EXTRA in done.stderr
    assert "parsed" not in done.stdout


def test_the_lean_default_parses_without_torch() -> None:
    done = without_torch("serve", "--kv-cells", "256")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["parsed", "auto", "False"]


def test_with_torch_installed_the_same_flags_parse() -> None:
    """The control: the check is about torch being missing, not about the flags."""
    args = cli.build_parser().parse_args(["serve", "--kv-cells", "256", "--runner", "torch"])
    assert engine_config(args, args.parser).model.runner == "torch"
