"""A model of a real model's size with random weights, as the F32 GGUF that ``kvpark bench
make-quant-files --random-shape NAME`` quantises into each type.

Why: the default model's rows are 576 wide, not a multiple of 256, so llama-quantize gives most
of a K-quant file's tensors a fallback type (Q4_K -> Q5_0, Q6_K -> Q8_0), and the whole model
(~100-500 MiB) sits in a large last-level cache. A Llama-1B shape (rows of 2048 and 8192) makes
a Q4_K_M file of real Q4_K and Q6_K tensors and ~640 MiB, read from memory every step: the
files people download, in size and types, which no model hub is needed to make. The weights are
seeded random normals, so its text is noise; speed and memory depend on the shapes and the types.

The source model gives everything but the weights and the shapes: its tokenizer (so the vocabulary
and the embedding's rows), chat template, rope base and norm epsilon; it must be a Llama GGUF.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int


# Llama-3.2-1B's shapes (its 128k vocabulary aside: the source's tokenizer decides the vocabulary)
SHAPES = {"llama-1b": Shape(hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8)}


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama GGUF of ``shape`` in llama.cpp's names, numpy order ``(rows, in)``;
    the output head tied to the embedding (none of its own)."""
    h, kv = shape.hidden, shape.kv_heads * (shape.hidden // shape.heads)
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        out += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (h, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, h)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, h)),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, h)),
            (f"blk.{i}.ffn_down.weight", (h, shape.ffn)),
        ]
    return [*out, ("output_norm.weight", (h,))]


def write_random(source: Path, dest: Path, shape: Shape, seed: int = 0) -> dict[str, object]:
    """Write an F32 GGUF of ``shape`` at ``dest`` with ``source``'s metadata (its shape keys and
    file type replaced) and seeded random weights: norms 1, the embedding N(0, 0.02), each matrix
    N(0, 1 / in) so activations keep their scale through the layers. One tensor is held at a
    time; written to a side file and renamed, so a file at ``dest`` is always whole."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    if arch != "llama":
        raise ValueError(f"--random-shape needs a Llama source; {source} is {arch!r}")
    vocab = len(reader.fields[gguf.Keys.Tokenizer.LIST].contents())
    replaced: dict[str, object] = {
        "llama.block_count": shape.layers,
        "llama.embedding_length": shape.hidden,
        "llama.feed_forward_length": shape.ffn,
        "llama.attention.head_count": shape.heads,
        "llama.attention.head_count_kv": shape.kv_heads,
        "llama.rope.dimension_count": shape.hidden // shape.heads,
        "llama.vocab_size": vocab,
        gguf.Keys.General.FILE_TYPE: int(gguf.LlamaFileType.ALL_F32),
    }
    partial = dest.with_name(dest.name + ".partial")
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        value = replaced.get(field.name, field.contents())
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    names = tensors(shape, vocab)
    for name, dims in names:
        writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in names:
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
            continue
        std = 0.02 if name == "token_embd.weight" else dims[1] ** -0.5
        writer.write_tensor_data(rng.standard_normal(dims, dtype=np.float32) * np.float32(std))
    writer.close()
    partial.replace(dest)
    return {"tensors": len(names), "bytes": dest.stat().st_size, "shape": asdict(shape)}
