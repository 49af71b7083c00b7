"""Where ``--device`` puts the model, decided without importing torch where no GPU can be.

torch's import alone leaves ~360 MiB resident (its operator tables, its Python modules, the CUDA
build's libraries), more than the default model and its KV pool together; the CPU server runs
without it (runner/lean_runner.py). ``--device auto`` asks ``torch.cuda.is_available()`` only on
a host with an NVIDIA driver loaded: without one, CUDA cannot be available, and the answer is
the CPU.
"""

from __future__ import annotations

import os

NVIDIA_DRIVER = "/proc/driver/nvidia/version"


def may_have_cuda() -> bool:
    """False only where CUDA cannot be available: no NVIDIA driver is loaded."""
    return os.path.exists(NVIDIA_DRIVER)


def device_kind(name: str) -> str:
    """``--device`` (``auto``, ``cpu``, ``cuda``, ``cuda:1``) as the kind of device it resolves
    to: ``cpu`` or ``cuda`` (or whatever torch would name)."""
    if name != "auto":
        return name.split(":", 1)[0]
    if not may_have_cuda():
        return "cpu"
    import torch  # a driver is there: only torch can say whether CUDA works

    return "cuda" if torch.cuda.is_available() else "cpu"
