"""What ``--tensor-parallel N`` runs, and why it refuses what it does not, checked before any
process starts or any weight is read (the command line exits 2 with the reason): no torch here.

Tensor parallel shards kvpark's torch model (runner/tp_runner.py) with dense weights; it refuses
the lean runner (one process, the Rust decoder), a custom runner (its model is its own), block
weights (``--weights blocks``: the block kernels are the CPU's single-process path) and a model
whose heads or MLP width do not divide by N (model/tp_shard.py).
"""

from __future__ import annotations

import os

from kvpark.config.layers import ModelConfig
from kvpark.model.sources import default_model_path
from kvpark.model.tp_shard import read_arch, tp_refusal

SPAWNED = "KVPARK_TP_SPAWNED"  # set on the workers kvpark starts itself (not on torchrun's)


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or any launcher setting its ``RANK`` and
    ``WORLD_SIZE``) started this process as one rank of several; None otherwise."""
    world = os.environ.get("WORLD_SIZE")
    rank = os.environ.get("RANK")
    if world is None or rank is None or os.environ.get(SPAWNED) or int(world) < 2:
        return None
    return int(rank), int(world)


def tp_config_refusal(model: ModelConfig) -> str | None:
    """Why ``model`` (its flags and its file's metadata) cannot run at
    ``model.tensor_parallel`` ranks; None where it can (or there is one rank)."""
    n = model.tensor_parallel
    if n < 1:
        return f"--tensor-parallel {n}: must be >= 1"
    if n == 1:
        return None
    runner = model.runner or "auto"
    if runner == "lean":
        return (
            f"--tensor-parallel {n} shards the torch model; the lean runner runs one process "
            "(use --runner auto or torch)"
        )
    if runner not in ("auto", "torch"):
        return f"--tensor-parallel {n} shards the built-in torch model, not a custom runner"
    if model.weights == "blocks":
        return (
            f"--tensor-parallel {n} runs dense weights: block weights are the single-process "
            "CPU path (use --weights auto or dense)"
        )
    try:
        arch = read_arch(model.model or default_model_path())
    except (OSError, ValueError) as e:
        return f"--tensor-parallel {n}: cannot read the model's architecture: {e}"
    return tp_refusal(arch, n)
