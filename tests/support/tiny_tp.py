"""A tiny Llama whose head counts divide by 2 (8 query heads, 2 KV heads, an MLP of 96), built by
transformers from its config with seeded random weights and saved as safetensors with the default
model's tokenizer: the model the tensor-parallel tests shard over two gloo ranks (the default
model's 9 and 3 heads do not divide by 2). Its embedding and head are separate matrices, so both
vocabulary-parallel paths run."""

from __future__ import annotations

from pathlib import Path

from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.model.sources import load_tokenizer
from support.tiny_hf import save_tiny

PAGE, CELLS = 16, 256
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
)
# the flags that make a server or runner comparable bit for bit with another of one rank: the
# dense float32 torch path with float32 cells, one thread per rank
FLAGS = ("--runner", "torch", "--weights", "dense", "--dtype", "float32", "--kv-dtype", "f32")


def save_tiny_tp(root: Path) -> str:
    """Build and save the model in ``root`` (a plain Llama: no rope scaling); its path."""
    save_tiny("llama3 rope scaling", load_tokenizer(), root, rope_parameters=None, **SHAPE)
    return str(root)


def config(path: str, tensor_parallel: int, *, exact: bool = True, **pool: int) -> EngineConfig:
    """The runner-level config of the tests: the dense float32 torch path, float32 cells (the
    derived bound is float32's), one thread per rank."""
    model = ModelConfig(
        model=path,
        threads=1,
        runner="torch",
        weights="dense",
        dtype="float32",
        kv_dtype="float32",
        exact=exact,
        tensor_parallel=tensor_parallel,
    )
    sizes = {"kv_cells": CELLS, "page_size": PAGE} | pool
    return EngineConfig(model=model, pool=PoolConfig(**sizes))
