"""A tiny random Llama for the op-set, kernel and CUDA-graph tests, on :data:`DEVICE`: CUDA,
unless there is none or Triton runs interpreted (conftest.py sets ``TRITON_INTERPRET=1`` without an
NVIDIA device node), then CPU."""

from __future__ import annotations

import os

import torch

from kvpark.model.arch import ModelArch
from kvpark.model.llama import LlamaModel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")


def tiny_model(**arch_kw: object) -> LlamaModel:
    """2 layers, hidden 64, 4 heads / 2 KV heads of 16, random weights (norm weights near 1)."""
    base: dict[str, object] = dict(
        arch="llama",
        n_layers=2,
        hidden_size=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_size=96,  # a multiple of 32: no row lands in a vector loop's scalar tail
        vocab_size=128,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_position=128,
        tie_embeddings=False,
    )
    base.update(arch_kw)
    model = LlamaModel(ModelArch(**base), torch.float32, DEVICE)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=g)
        param.data.copy_(1 + 0.1 * noise if name.endswith("norm") else 0.1 * noise)
    return model
