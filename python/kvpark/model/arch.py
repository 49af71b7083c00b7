"""The shape of a decoder-only model: everything the forward pass needs to know besides its weights.

One frozen :class:`ModelArch` per loaded model, read from GGUF metadata (``gguf_file.py``) or
from a Hugging Face ``config.json`` (``hf_loader.py``). Every architecture is the Llama layer
with some of these switches set, so both runners have one forward pass:

- Qwen2 adds a bias to the Q/K/V projections; Qwen3 (and Gemma 3) normalise Q and K per head
  before rope;
- Gemma 2 and 3 scale the embedding by sqrt(hidden), use GeGLU (``activation`` "gelu_tanh"),
  put a second norm after attention and after the MLP (``sandwich_norms``), scale scores by
  ``query_pre_attn_scalar`` ** -0.5, and Gemma 2 soft-caps scores and logits (``c * tanh(x / c)``);
- Gemma, Phi-3 and Mistral attend over a sliding window of ``sliding_window`` positions in the
  layers ``sliding_layers`` marks (every layer for Mistral and Phi-3, alternate ones for Gemma 2,
  five of six for Gemma 3), and Gemma 3's sliding layers turn with their own rope base;
- Qwen3-MoE's MLP is a mixture of ``n_experts`` (each a SwiGLU of ``expert_size``), a router
  picking ``experts_per_token`` of them for each row, their outputs summed by the router's
  softmax weights (renormalised over the picked ones where ``norm_topk``), in ``moe_layers``;
- Phi-3 scales rope by LongRoPE (``RopeScaling("longrope")``: per-frequency factors and a cos/sin
  multiplier).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe")
ACTIVATIONS = ("silu", "gelu_tanh")


class ModelLoadError(ValueError):
    """A model file or directory that kvpark cannot load; the message says what and why."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent rope scaling (``rope_type: llama3``), linear scaling, or
    Phi-3's LongRoPE (``longrope``: ``short_factor`` divides each inverse frequency where the
    served context fits ``original_max_position``, ``long_factor`` where it does not, and cos and
    sin are multiplied by ``attention_factor``)."""

    rope_type: str  # "llama3", "linear" or "longrope"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


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
    activation: str = "silu"  # of the gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # the embedding's rows times this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # Gemma: a norm on the attention's and the MLP's output too
    attn_scale: float | None = None  # scores times this; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) before the softmax
    final_softcap: float | None = None  # logits -> c * tanh(logits / c)
    sliding_window: int | None = None  # positions a sliding layer's row attends to, itself included
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it slides (empty: none does)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' rope base, unscaled
    n_experts: int = 0  # a mixture of experts' MLP (0: every MLP is dense)
    experts_per_token: int = 0
    expert_size: int = 0  # each expert's intermediate width
    norm_topk: bool = True  # renormalise the picked experts' weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: whether its MLP is the mixture

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
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ModelLoadError(
                f"{len(self.sliding_layers)} sliding-window flags for {self.n_layers} layers"
            )
        if any(self.sliding_layers) and not (self.sliding_window and self.sliding_window > 0):
            raise ModelLoadError("sliding-window layers without a window size")
        if any(self.moe_layers) and not 0 < self.experts_per_token <= self.n_experts:
            raise ModelLoadError(f"{self.experts_per_token} experts a token of {self.n_experts}")

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends to its whole context."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None

    @property
    def pool_window(self) -> int | None:
        """The window every layer slides over, so that a sequence's pages behind it can leave
        the pool; None where some layer attends to its whole context (Gemma's global layers)."""
        slides = bool(self.sliding_layers) and all(self.sliding_layers)
        return self.sliding_window if slides else None

    @property
    def attention_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def plain_attention(self) -> bool:
        """Whether attention is softmax(q k / sqrt(d)) v over the whole context: what every
        attention kernel of the torch path computes (the others go through masked_attention)."""
        return (
            not any(self.sliding_layers)
            and self.attn_softcap is None
            and self.attention_scale == self.head_dim**-0.5
        )

    def rope_table_of(self, layer: int) -> int:
        """Which of ``rope_inv_freqs``' tables ``layer`` turns with."""
        return 1 if self.local_rope_theta is not None and self.window_of(layer) else 0

    def rope_inv_freqs(
        self, freq_factors: npt.ArrayLike | None = None
    ) -> list[tuple[npt.NDArray[np.float64], float]]:
        """Each rope table's inverse frequencies and cos/sin multiplier: the global one, and the
        sliding layers' (Gemma 3) where they have their own base."""
        tables = [(self.inv_freq(freq_factors), self.rope_multiplier)]
        if self.local_rope_theta is not None:
            tables.append((_base_inv_freq(self.local_rope_theta, self.head_dim), 1.0))
        return tables

    @property
    def rope_multiplier(self) -> float:
        s = self.rope_scaling
        return s.attention_factor if s is not None and s.rope_type == "longrope" else 1.0

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
        inv = _base_inv_freq(self.rope_theta, self.head_dim)
        if freq_factors is not None:
            return inv / np.asarray(freq_factors, dtype=np.float64)
        s = self.rope_scaling
        if s is None:
            return inv
        if s.rope_type == "linear":
            return inv / s.factor
        if s.rope_type == "longrope":  # llama.cpp's rule: the long factors past the trained context
            long = self.max_position > s.original_max_position
            factors = s.long_factor if long else s.short_factor
            if len(factors) != len(inv):
                raise ModelLoadError(f"{len(factors)} LongRoPE factors for {len(inv)} frequencies")
            return inv / np.asarray(factors, dtype=np.float64)
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


def _base_inv_freq(theta: float, head_dim: int) -> npt.NDArray[np.float64]:
    out: npt.NDArray[np.float64] = 1.0 / theta ** (
        np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    )
    return out
