"""One rank's share of a model for tensor parallelism (``--tensor-parallel N``), cut from the full
weights as they are read (numpy_weights.py), without torch: which architectures and sizes can be
cut (``tp_refusal``), the shard's ``ModelArch`` and its arrays.

::

    rank r of N          rows / columns it keeps                      how the ranks combine
    qkv_w, qkv_b         its n_heads/N Q heads, n_kv_heads/N K and V   column-parallel: none
    o_w  [hidden, q]     the columns of its Q heads                    row-parallel: all-reduce
    o_b                  rank 0 only                                   added once, in the sum
    gate_up_w            its intermediate/N gate rows and up rows      column-parallel: none
    down_w [hidden, I]   the columns of its intermediate slice         row-parallel: all-reduce
    embed, head          vocabulary rows r*V'..(r+1)*V' (V' = ceil(V/N),  embedding: all-reduce
                         the last rank's padded with zero rows)        logits: gathered on rank 0
    norms, rope          whole

Each rank holds whole heads, so its attention is the full model's for those heads and its K/V
cells hold just their share: the head counts must divide by N (and the MLP's width, for the
same reason). A mixture of experts is not sharded (refused).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from kvpark.model import hf_loader
from kvpark.model.arch import ModelArch
from kvpark.model.gguf_arch import arch_from_gguf
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.gguf_file import GgufFile, is_gguf
from kvpark.model.weight_arrays import Dense, Matrix, NumpyLayer, NumpyWeights, Stacked


def read_arch(path: str) -> ModelArch:
    """A model's architecture from its metadata alone (a GGUF's header, a directory's
    config.json): no tensor is read."""
    p = Path(path)
    if p.is_dir():
        cfg = hf_loader.read_json(p / "config.json")
        return hf_loader.arch_from_config(cfg, has_lm_head=True)  # heads do not depend on it
    if is_gguf(p):
        return arch_from_gguf(GgufFile(path))
    raise ValueError(f"{path} is neither a GGUF file nor a Hugging Face model directory")


def tp_refusal(arch: ModelArch, n: int) -> str | None:
    """Why ``arch`` cannot be cut into ``n`` ranks (None: it can)."""
    if n <= 1:
        return None
    if arch.n_experts:
        return f"--tensor-parallel {n}: a mixture of experts ({arch.arch}) is not sharded"
    if arch.n_heads % n or arch.n_kv_heads % n:
        return (
            f"--tensor-parallel {n}: the model's {arch.n_heads} query heads and "
            f"{arch.n_kv_heads} KV heads do not both divide by {n} (each rank holds whole heads "
            f"and its share of every cell); use a size that divides both"
        )
    if arch.intermediate_size % n:
        return (
            f"--tensor-parallel {n}: the model's MLP width {arch.intermediate_size} does not "
            f"divide by {n}"
        )
    return None


def shard_vocab(vocab: int, n: int) -> int:
    """Rows of the embedding and the head each rank holds: ``ceil(vocab / n)``."""
    return -(-vocab // n)


def shard_arch(arch: ModelArch, rank: int, n: int) -> ModelArch:
    """The architecture of rank ``rank``'s shard: its heads, its MLP width, its vocabulary rows,
    and the output bias on rank 0 alone (added once in the all-reduce's sum)."""
    why = tp_refusal(arch, n)
    if why is not None:
        raise ValueError(why)
    return replace(
        arch,
        n_heads=arch.n_heads // n,
        n_kv_heads=arch.n_kv_heads // n,
        intermediate_size=arch.intermediate_size // n,
        vocab_size=shard_vocab(arch.vocab_size, n),
        o_bias=arch.o_bias and rank == 0,
    )


def shard_weights(w: NumpyWeights[Matrix], rank: int, n: int) -> NumpyWeights[Matrix]:
    """Rank ``rank``'s arrays of the dense weights ``w`` (blocks dequantised), each a copy of
    its slice, so the full arrays can be freed."""
    a = w.arch
    d, nh, nkv, width = a.head_dim, a.n_heads // n, a.n_kv_heads // n, a.intermediate_size // n
    q_rows = _span(rank * nh * d, nh * d)
    k_rows = _span(a.n_heads * d + rank * nkv * d, nkv * d)
    v_rows = _span((a.n_heads + a.n_kv_heads) * d + rank * nkv * d, nkv * d)
    gate_rows = _span(rank * width, width)
    up_rows = _span(a.intermediate_size + rank * width, width)
    layers: list[NumpyLayer[Matrix]] = []
    for layer in w.layers:
        m = {k: _dense(v) for k, v in layer.matrices.items()}
        vec = dict(layer.vectors)
        out = NumpyLayer[Matrix](
            vectors={k: v for k, v in vec.items() if k not in ("qkv_b", "o_b")},
            matrices={
                "qkv_w": _rows(m["qkv_w"], q_rows, k_rows, v_rows),
                "o_w": _copy(m["o_w"][:, q_rows[0] : q_rows[1]]),
                "gate_up_w": _rows(m["gate_up_w"], gate_rows, up_rows),
                "down_w": _copy(m["down_w"][:, gate_rows[0] : gate_rows[1]]),
            },
        )
        if "qkv_b" in vec:
            out.vectors["qkv_b"] = _rows(vec["qkv_b"], q_rows, k_rows, v_rows)
        if "o_b" in vec and rank == 0:
            out.vectors["o_b"] = vec["o_b"]
        layers.append(out)
    embed = _vocab_rows(_dense(w.embed), rank, n)
    head = embed if a.tie_embeddings else _vocab_rows(_dense(w.head), rank, n)
    return NumpyWeights[Matrix](
        arch=shard_arch(a, rank, n),
        layers=layers,
        embed=embed,
        head=head,
        norm=w.norm,
        rope_freqs=w.rope_freqs,
    )


def _span(start: int, size: int) -> tuple[int, int]:
    return start, start + size


def _dense(m: Matrix) -> Dense:
    return m.dequantize() if isinstance(m, Blocks | Stacked) else m


def _copy(a: Dense) -> Dense:
    return np.ascontiguousarray(a).copy()


def _rows(a: Dense, *spans: tuple[int, int]) -> Dense:
    """The rows of each span, in order, as one new array."""
    return np.concatenate([a[lo:hi] for lo, hi in spans])


def _vocab_rows(a: Dense, rank: int, n: int) -> Dense:
    """Rank ``rank``'s rows of an embedding or head, zero rows past the vocabulary."""
    rows = shard_vocab(a.shape[0], n)
    part = a[rank * rows : (rank + 1) * rows]
    out = np.zeros((rows, a.shape[1]), dtype=a.dtype)
    out[: part.shape[0]] = part
    return out
