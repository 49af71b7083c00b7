"""The rope table's numbers: cos and sin of position x inverse frequency, computed in float64 and
stored in float32. numpy, so that the torch model (ops/rope.py) and the torch-free CPU runner
(runner/lean_runner.py) hold the same bits."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def rope_angles(
    inv_freq: npt.NDArray[np.float64], max_position: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """cos and sin [max_position, head_dim // 2] float32, from float64 angles: numpy, so that the
    torch model and the torch-free CPU runner (runner/lean_runner.py) hold the same bits."""
    angles = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
