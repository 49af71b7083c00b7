"""The numeric ops the model runs (op_set.py: one OpSet per mode), the KV cache and its host-buffer
layout, block weights and the Triton op sets. Imports config, the Rust core (CPU kernels), kernels/.
"""

from __future__ import annotations

from kvpark.model.ops.block_weights import BlockWeight
from kvpark.model.ops.kv_cache import KVCache
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.model.ops.op_set import OpSet, Weight, with_blocks

__all__ = ["AttentionMetadata", "BlockWeight", "KVCache", "OpSet", "Weight", "with_blocks"]
