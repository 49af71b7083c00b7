"""A GGUF model's weights as numpy arrays for the Rust decoder, without torch.

The torch-free CPU runner (runner/lean_runner.py) hands the Rust decoder the address of every
weight; this module reads them from the file as the torch model would hold them, bit for bit:
matrices kept in their 32-weight blocks (gguf_blocks.py), Q and K rows unpermuted for Llama
files (gguf_loader.py says why), fused as the model fuses them (Q/K/V, gate/up;
weight_names.py), vectors widened to float32 and the rope table built by the same numpy code
(ops/rope.py). A file this cannot take whole (a matrix in another format, such as Q6_K or the
K-quants the torch loader repacks, or fused parts of two kinds) gets the reason instead, and the
model loads through torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType

from kvpark.model.arch import ModelArch, ModelLoadError
from kvpark.model.gguf_blocks import BLOCK_TYPES, Blocks, blocks_from_gguf, unpermute_rows
from kvpark.model.gguf_file import GgufFile, TensorInfo, arch_from_gguf, hf_name
from kvpark.model.weight_names import LAYER_NAMES, LAYER_RE, MATRICES

F32 = npt.NDArray[np.float32]


@dataclass
class NumpyLayer:
    """One layer: its vectors (float32) and its block matrices, fused."""

    vectors: dict[str, F32] = field(default_factory=dict)  # attn_norm, qkv_b, o_b, q_norm, ...
    matrices: dict[str, Blocks] = field(default_factory=dict)  # qkv_w, o_w, gate_up_w, down_w


@dataclass
class NumpyWeights:
    arch: ModelArch
    layers: list[NumpyLayer]
    embed: Blocks  # the token embedding, looked up from its blocks
    head: Blocks  # the output matrix; the embedding's blocks themselves when tied
    norm: F32
    rope_freqs: F32 | None  # a GGUF's llama3 rope scaling (per-frequency divisors), if any

    @property
    def nbytes(self) -> int:
        blocks = [m for layer in self.layers for m in layer.matrices.values()]
        vectors = [v for layer in self.layers for v in layer.vectors.values()]
        head = 0 if self.head is self.embed else self.head.nbytes
        return sum(b.nbytes for b in blocks) + sum(v.nbytes for v in vectors) + head


class Unfit(Exception):
    """The file holds something the decoder's weights cannot (the message says what)."""


def load_numpy_weights(g: GgufFile) -> NumpyWeights:
    """Every tensor of ``g`` read once (each tensor's file pages released after its copy).
    Raises Unfit for a file the decoder cannot run, ModelLoadError for a broken one."""
    arch = arch_from_gguf(g)
    parts: list[dict[str, dict[int, Blocks]]] = [{} for _ in range(arch.n_layers)]
    bias_parts: list[dict[int, F32]] = [{} for _ in range(arch.n_layers)]
    layers = [NumpyLayer() for _ in range(arch.n_layers)]
    embed = head = norm = rope_freqs = None
    for info in g.tensors:
        name = hf_name(info.name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            blocks = _blocks(g, info, name)
            embed, head = (blocks, head) if name.startswith("model.") else (embed, blocks)
            continue
        if name == "model.norm.weight":
            norm = _vector(g, info, name)
            continue
        if name == "rope_freqs":
            rope_freqs = _vector(g, info, name)
            continue
        m = LAYER_RE.fullmatch(name)
        if m is None or int(m.group(1)) >= arch.n_layers or m.group(2) not in LAYER_NAMES:
            raise ModelLoadError(f"unexpected tensor {name!r} for a {arch.arch} model")
        i, (attr, part) = int(m.group(1)), LAYER_NAMES[m.group(2)]
        heads = _permuted_heads(arch, name)
        if attr in MATRICES:
            blocks = _blocks(g, info, name)
            if heads:
                blocks = blocks.rows(unpermute_rows(blocks.shape[0], heads))
            parts[i].setdefault(attr, {})[part or 0] = blocks
        elif attr == "qkv_b":
            vector = _vector(g, info, name)
            bias_parts[i][part or 0] = (
                vector[unpermute_rows(len(vector), heads)] if heads else vector
            )
        else:
            layers[i].vectors[attr] = _vector(g, info, name)
    if embed is None or norm is None:
        raise ModelLoadError(f"{g.path}: no token embedding or output norm")
    if head is None:
        if not arch.tie_embeddings:
            raise ModelLoadError(f"{g.path}: no output.weight")
        head = embed  # a tied head multiplies the embedding's blocks
    for i, layer in enumerate(layers):
        for attr, n_parts in MATRICES.items():
            got = parts[i].get(attr, {})
            if sorted(got) != list(range(n_parts)):
                raise ModelLoadError(f"{g.path}: layer {i} lacks parts of {attr}")
            try:
                layer.matrices[attr] = Blocks.cat([got[j] for j in range(n_parts)])
            except ValueError as e:  # parts of two kinds: the torch model dequantises them
                raise Unfit(f"layer {i}'s {attr}: {e}") from e
        if bias_parts[i]:
            layer.vectors["qkv_b"] = np.concatenate([bias_parts[i][j] for j in range(3)])
    weights = NumpyWeights(arch, layers, embed, head, norm, rope_freqs)
    _check_shapes(weights)
    return weights


def _permuted_heads(arch: ModelArch, name: str) -> int:
    """Heads whose rows llama.cpp permuted in this tensor (Q and K of Llama files), else 0."""
    if arch.arch != "llama":
        return 0
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return arch.n_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return arch.n_kv_heads
    return 0


def _blocks(g: GgufFile, info: TensorInfo, name: str) -> Blocks:
    if len(info.shape) != 2 or info.qtype not in BLOCK_TYPES:
        kind = GGMLQuantizationType(info.qtype).name if info.qtype in _TYPE_IDS else info.qtype
        raise Unfit(f"{name} is {kind}, not Q4_0, Q4_1 or Q8_0 blocks")
    _, raw = g.raw(info)
    blocks = blocks_from_gguf(info.qtype, raw, (info.shape[1], info.shape[0]))
    g.release(info, raw.nbytes)
    return blocks


_TYPE_IDS = {t.value for t in GGMLQuantizationType}
_FLOATS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
}


def _vector(g: GgufFile, info: TensorInfo, name: str) -> F32:
    """A 1-D tensor (a norm, a bias, the rope factors) as float32, as the model's parameter."""
    qtype, raw = g.raw(info)
    if len(info.shape) != 1:
        raise ModelLoadError(f"{name} has shape {info.shape}, expected a vector")
    if qtype == GGMLQuantizationType.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif qtype in _FLOATS:
        out = raw.view(_FLOATS[qtype]).astype(np.float32)  # a copy: the mmap is read-only
    else:
        raise Unfit(f"{name} is {qtype.name}, not a float vector")
    g.release(info, raw.nbytes)
    return out


def _check_shapes(w: NumpyWeights) -> None:
    """The decoder reads raw memory: every array must be the size the architecture says."""
    a, hidden = w.arch, w.arch.hidden_size
    want = {
        "qkv_w": (a.qkv_size, hidden),
        "o_w": (hidden, a.n_heads * a.head_dim),
        "gate_up_w": (2 * a.intermediate_size, hidden),
        "down_w": (hidden, a.intermediate_size),
    }
    vectors = {"attn_norm": hidden, "mlp_norm": hidden}
    vectors |= {"qkv_b": a.qkv_size} if a.qkv_bias else {}
    vectors |= {"o_b": hidden} if a.o_bias else {}
    vectors |= {"q_norm": a.head_dim, "k_norm": a.head_dim} if a.qk_norm else {}
    for i, layer in enumerate(w.layers):
        for attr, shape in want.items():
            if layer.matrices[attr].shape != shape:
                got = layer.matrices[attr].shape
                raise ModelLoadError(f"layer {i}'s {attr} is {got}, expected {shape}")
        if set(layer.vectors) != set(vectors):
            raise ModelLoadError(
                f"layer {i} has {sorted(layer.vectors)}, expected {sorted(vectors)}"
            )
        for attr, size in vectors.items():
            if layer.vectors[attr].shape != (size,):
                raise ModelLoadError(f"layer {i}'s {attr} has {layer.vectors[attr].shape} values")
    for what, blocks in (("embedding", w.embed), ("head", w.head)):
        if blocks.shape != (a.vocab_size, hidden):
            raise ModelLoadError(f"the {what} is {blocks.shape}, expected {(a.vocab_size, hidden)}")
    if w.norm.shape != (hidden,):
        raise ModelLoadError(f"the output norm has {w.norm.shape} values")
