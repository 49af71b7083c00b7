"""The shape of a Llama-family model: everything the forward pass needs to know besides its weights.

One frozen :class:`ModelArch` per loaded model, read from GGUF metadata (``gguf_file.py``) or
from a Hugging Face ``config.json`` (``hf_loader.py``). The variants differ only in flags: Qwen2
adds a bias to the Q/K/V projections, Qwen3 normalises Q and K per head before rope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


class ModelLoadError(ValueError):
    """A model file or directory that kvpark cannot load; the message says what and why."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent rope scaling (``rope_type: llama3``) or linear scaling."""

    rope_type: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelArch:
    arch: str  # one of SUPPORTED_ARCHS
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding (may exceed the tokenizer's vocabulary)
    rope_theta: float
    rms_eps: float
    max_position: int  # context length the model was trained for
    tie_embeddings: bool
    qkv_bias: bool = False  # Qwen2, or Llama/Qwen3 with attention_bias
    o_bias: bool = False  # Llama/Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ModelLoadError(
                f"n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for rope")

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def qkv_size(self) -> int:
        """Output width of the fused Q/K/V projection."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def inv_freq(self, freq_factors: npt.ArrayLike | None = None) -> npt.NDArray[np.float64]:
        """Rope inverse frequencies [head_dim // 2], float64 so long positions keep their precision.
        numpy, not torch: the CPU server builds its rope tables without torch (lean_runner.py).

        ``freq_factors`` is a GGUF's ``rope_freqs`` tensor: llama.cpp stores Llama 3's scaling as
        per-frequency divisors instead of config numbers.
        """
        d = self.head_dim
        inv: npt.NDArray[np.float64] = 1.0 / self.rope_theta ** (
            np.arange(0, d, 2, dtype=np.float64) / d
        )
        if freq_factors is not None:
            return inv / np.asarray(freq_factors, dtype=np.float64)
        s = self.rope_scaling
        if s is None:
            return inv
        if s.rope_type == "linear":
            return inv / s.factor
        # llama3: long wavelengths slowed by `factor`, short ones kept, the band between blended.
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        out: npt.NDArray[np.float64] = np.where(medium, blended, scaled)
        return out
