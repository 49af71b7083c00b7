"""Rotary position embedding, NEOX style: dimension i rotates with dimension i + head_dim / 2.

Hugging Face checkpoints use this layout; GGUF files of the Llama family store Q and K rows permuted
for llama.cpp's interleaved rope, and ``gguf_tensors.py`` undoes that at load so that one rope
serves every model. The cos/sin table is built once per model in float64 (then stored in fp32); a
step looks up its rows once and every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvpark.model.arch import ModelArch
from kvpark.model.rope_angles import rope_angles, rope_tables


@dataclass(frozen=True)
class RopeTable:
    cos: torch.Tensor  # [max_position, head_dim // 2] fp32
    sin: torch.Tensor  # [max_position, head_dim // 2] fp32

    @classmethod
    def build(
        cls, inv_freq: npt.NDArray[np.float64], max_position: int, device: torch.device
    ) -> RopeTable:
        """inv_freq [head_dim // 2] float64 (see ``ModelArch.inv_freq``)."""
        cos, sin = rope_angles(inv_freq, max_position)
        return cls(cos=torch.from_numpy(cos).to(device), sin=torch.from_numpy(sin).to(device))

    @classmethod
    def build_all(
        cls, arch: ModelArch, freq_factors: npt.ArrayLike | None, device: torch.device
    ) -> list[RopeTable]:
        """Every table of ``arch`` (rope_angles.rope_tables), the CPU runner's bits."""
        return [
            cls(cos=torch.from_numpy(cos).to(device), sin=torch.from_numpy(sin).to(device))
            for cos, sin in rope_tables(arch, freq_factors)
        ]

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``apply_rope``, each [T, 1, head_dim], for positions [T] int64."""
        # note: call only with positions < max_position (the runner caps the model length there);
        # checked on CPU only, where it costs no device sync.
        if positions.device.type == "cpu" and positions.numel():
            top = int(positions.max())
            if top >= self.cos.shape[0]:
                raise ValueError(f"position {top} beyond the rope table ({self.cos.shape[0]})")
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        # Signed so that rope is x * cos + roll(x) * sin: 4 elementwise ops instead of 7.
        full_cos = torch.cat((cos, cos), dim=-1).to(dtype)
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)
        return full_cos.unsqueeze(1), signed_sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by position; cos, sin [T, 1, head_dim] from RopeTable.at."""
    half = x.shape[-1] // 2
    # roll gives (x2, x1); with sin signed (-s, s) this is (x1 c - x2 s, x2 c + x1 s).
    return x * cos + x.roll(half, dims=-1) * sin
