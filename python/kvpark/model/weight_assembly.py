"""A checkpoint's tensors (a GGUF's or a Hugging Face directory's, as its reader yields them)
assembled into ``NumpyWeights``: each tensor put in its layer, the fused matrices joined (Q/K/V,
gate/up; weight_names.py), vectors widened to float32, every shape checked against the
architecture. The one fusing code for the torch model and the lean runner.

A fused matrix whose parts are all blocks of one kind stays blocks (``Blocks.cat``), and one
whose parts are all dense of one dtype stays in it; one that mixes kinds (Q4_K's q4 beside
Q6_K's q6, as in a Q4_K_M file's layers whose attn_v is Q6_K) is ``Stacked``, its parts kept as
they are: the decoder multiplies each in its kind. Only a part neither in blocks nor dense
F32/F16/BF16 (a Q2_K one, say) makes the matrix float32, for the torch model; ``unfit_why``
records why for every matrix the decoder cannot multiply: what numpy_weights.decoder_unfit
reports.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvpark.model.arch import ModelArch, ModelLoadError
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.weight_arrays import (
    DENSE_ARRAYS,
    DENSE_FORMATS,
    F32,
    Dense,
    Matrix,
    NamedTensor,
    NumpyLayer,
    NumpyWeights,
    Stacked,
    Unfit,
    widened,
)
from kvpark.model.weight_names import LAYER_RE, WHOLE, expert_attr, layer_entry, layer_matrices

# gguf_tensors.KEPT_TYPES, as a message says them
KEPT_NAMES = "Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS"


def assemble_weights(
    arch: ModelArch, tensors: Iterable[NamedTensor], where: str, *, strict: bool = False
) -> NumpyWeights[Matrix]:
    """The weights of ``arch`` from ``tensors`` (any order); ``where`` names the checkpoint in
    errors. ``strict``: raise Unfit at the first matrix the decoder cannot multiply (the lean
    runner's load stops there rather than read the rest for nothing)."""
    layer_parts: list[dict[str, dict[int, NamedTensor]]] = [{} for _ in range(arch.n_layers)]
    bias_parts: list[dict[int, F32]] = [{} for _ in range(arch.n_layers)]
    layers: list[NumpyLayer[Matrix]] = [NumpyLayer() for _ in range(arch.n_layers)]
    found: dict[str, NamedTensor] = {}
    norm = rope_freqs = None
    wanted = [layer_matrices(arch.n_experts, arch.is_moe(i)) for i in range(arch.n_layers)]
    for t in tensors:
        name = t.name
        if name.endswith("rotary_emb.inv_freq"):  # a stale rope buffer of old checkpoints
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name == "lm_head.weight" and arch.tie_embeddings:
                continue  # a tied checkpoint's copy of the head: the embedding is what HF uses
            if strict and not runnable(t):
                raise Unfit(not_runnable(t))
            found[name] = t
            continue
        if name == "model.norm.weight":
            norm = vector(t)
            continue
        if name == "rope_freqs":
            rope_freqs = vector(t)
            continue
        m = LAYER_RE.fullmatch(name)
        entry = None if m is None else layer_entry(arch.arch, m.group(2))
        if m is None or entry is None or int(m.group(1)) >= arch.n_layers:
            raise ModelLoadError(f"unexpected tensor {name!r} for a {arch.arch} model")
        i, (attr, part) = int(m.group(1)), entry
        if attr in wanted[i] or attr.startswith("expert.") or attr == "router_w":
            if strict and not runnable(t):
                raise Unfit(not_runnable(t))
            layer_parts[i].setdefault(attr, {})[part or 0] = t
        elif attr == "qkv_b":
            bias_parts[i][part or 0] = vector(t)
        else:
            layers[i].vectors[attr] = vector(t)
    embed = found.get("model.embed_tokens.weight")
    if embed is None or norm is None:
        raise ModelLoadError(f"{where}: no token embedding or output norm")
    head = found.get("lm_head.weight")
    if head is None and not arch.tie_embeddings:
        raise ModelLoadError(f"{where}: no output matrix (output.weight, lm_head.weight)")
    unfit_why: dict[str, str] = {}
    for what, matrix in (("the embedding", embed), ("the head", head)):
        if matrix is not None and not runnable(matrix):
            unfit_why[what] = not_runnable(matrix)
    for i, layer in enumerate(layers):
        if set(layer_parts[i]) - set(wanted[i]):
            extra = sorted(set(layer_parts[i]) - set(wanted[i]))[:3]
            raise ModelLoadError(f"{where}: layer {i} has unexpected matrices {extra}")
        for attr, n_parts in wanted[i].items():
            got = layer_parts[i].get(attr, {})
            if list(got) == [WHOLE]:  # stored fused (Phi-3)
                got, n_parts = {0: got[WHOLE]}, 1
            if sorted(got) != list(range(n_parts)):
                raise ModelLoadError(f"{where}: layer {i} lacks parts of {attr}")
            layer.matrices[attr], why = fused([got[j] for j in range(n_parts)])
            if why is not None:
                why = f"layer {i}'s {attr}: {why}"
                if strict:
                    raise Unfit(why)
                unfit_why[f"layer {i}'s {attr}"] = why
        layer_parts[i].clear()  # the parts' memory goes as each layer is fused
        if bias_parts[i]:
            layer.vectors["qkv_b"] = np.concatenate([bias_parts[i][j] for j in range(3)])
    head_value = embed.value if head is None else head.value  # tied: the same object
    weights = NumpyWeights(arch, layers, embed.value, head_value, norm, rope_freqs, unfit_why)
    check_shapes(weights)
    return weights


def runnable(t: NamedTensor) -> bool:
    """Whether the decoder multiplies this tensor as read: blocks, or dense values as the file
    stores them (a tensor dequantised from another type, Q5_0 say, is float32 it never held)."""
    v = t.value
    return isinstance(v, Blocks) or (t.fmt in DENSE_FORMATS and v.dtype.type in DENSE_ARRAYS)


def not_runnable(t: NamedTensor) -> str:
    return (
        f"{t.name} is {t.fmt}, which the decoder does not multiply (it takes {KEPT_NAMES} "
        "blocks, or dense F32, F16 or BF16)"
    )


def fused(parts: list[NamedTensor]) -> tuple[Matrix, str | None]:
    """The parts' rows in order as one matrix, and why the decoder cannot multiply it (None
    where it can: every part blocks, or dense values as the file stores them)."""
    values = [p.value for p in parts]
    if len(values) == 1:
        return values[0], None if runnable(parts[0]) else not_runnable(parts[0])
    blocks = [v for v in values if isinstance(v, Blocks)]
    kinds = {v.kind if isinstance(v, Blocks) else v.dtype.str for v in values}
    if all(runnable(p) for p in parts):
        if len(blocks) == len(values) and len(kinds) == 1:
            return Blocks.cat(blocks), None
        if len(kinds) > 1:  # each part multiplied in its own kind
            return Stacked(tuple(values)), None
    why = None
    if not all(runnable(p) for p in parts):
        why = not_runnable(next(p for p in parts if not runnable(p)))
    arrays: list[Dense] = [v.dequantize() if isinstance(v, Blocks) else v for v in values]
    if len(arrays) == 1:
        return arrays[0], why
    if len({a.dtype for a in arrays}) > 1:  # float32 holds each exactly: the same bits after
        arrays = [widened(a).astype(np.float32, copy=False) for a in arrays]
    return np.concatenate(arrays), why


def vector(t: NamedTensor) -> F32:
    """A 1-D tensor (a norm, a bias, the rope factors) as float32, as the model's parameter."""
    if isinstance(t.value, Blocks) or t.value.ndim != 1:
        raise ModelLoadError(f"{t.name} has shape {t.value.shape}, expected a vector")
    out: F32 = widened(t.value).astype(np.float32, copy=False)
    return out


def check_shapes(w: NumpyWeights[Matrix]) -> None:
    """The decoder reads raw memory: every array must be the size the architecture says."""
    a, hidden = w.arch, w.arch.hidden_size
    dense = {
        "qkv_w": (a.qkv_size, hidden),
        "o_w": (hidden, a.n_heads * a.head_dim),
        "gate_up_w": (2 * a.intermediate_size, hidden),
        "down_w": (hidden, a.intermediate_size),
    }
    moe = {"qkv_w": dense["qkv_w"], "o_w": dense["o_w"], "router_w": (a.n_experts, hidden)}
    for e in range(a.n_experts):
        moe[expert_attr(e, "gate_up_w")] = (2 * a.expert_size, hidden)
        moe[expert_attr(e, "down_w")] = (hidden, a.expert_size)
    vectors = {"attn_norm": hidden, "mlp_norm": hidden}
    vectors |= {"qkv_b": a.qkv_size} if a.qkv_bias else {}
    vectors |= {"o_b": hidden} if a.o_bias else {}
    vectors |= {"q_norm": a.head_dim, "k_norm": a.head_dim} if a.qk_norm else {}
    vectors |= {"post_attn_norm": hidden, "post_mlp_norm": hidden} if a.sandwich_norms else {}
    for i, layer in enumerate(w.layers):
        for attr, shape in (moe if a.is_moe(i) else dense).items():
            got = tuple(layer.matrices[attr].shape)
            if got != shape:
                raise ModelLoadError(f"layer {i}'s {attr} is {got}, expected {shape}")
        if set(layer.vectors) != set(vectors):
            raise ModelLoadError(
                f"layer {i} has {sorted(layer.vectors)}, expected {sorted(vectors)}"
            )
        for attr, size in vectors.items():
            if layer.vectors[attr].shape != (size,):
                raise ModelLoadError(f"layer {i}'s {attr} has {layer.vectors[attr].shape} values")
    for what, m in (("embedding", w.embed), ("head", w.head)):
        if tuple(m.shape) != (a.vocab_size, hidden):
            raise ModelLoadError(f"the {what} is {m.shape}, expected {(a.vocab_size, hidden)}")
    if w.norm.shape != (hidden,):
        raise ModelLoadError(f"the output norm has {w.norm.shape} values")
