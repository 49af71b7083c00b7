"""The rope table's numbers: cos and sin of position x inverse frequency, computed in float64 and
stored in float32. numpy, so that the torch model (ops/rope.py) and the torch-free CPU runner
(runner/lean_runner.py) hold the same bits."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpark.model.arch import ModelArch


def rope_angles(
    inv_freq: npt.NDArray[np.float64], max_position: int, multiplier: float = 1.0
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """cos and sin [max_position, head_dim // 2] float32, from float64 angles, each times
    ``multiplier`` (LongRoPE's attention factor): numpy, so that the torch model and the
    torch-free CPU runner (runner/lean_runner.py) hold the same bits."""
    angles = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    cos, sin = np.cos(angles), np.sin(angles)
    if multiplier != 1.0:
        cos, sin = cos * multiplier, sin * multiplier
    return cos.astype(np.float32), sin.astype(np.float32)


def rope_tables(
    arch: ModelArch, freq_factors: npt.ArrayLike | None = None
) -> list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]:
    """Every rope table of ``arch`` (``ModelArch.rope_inv_freqs``), in ``rope_table_of``'s
    numbering."""
    return [
        rope_angles(inv, arch.max_position, mult) for inv, mult in arch.rope_inv_freqs(freq_factors)
    ]
