"""``_CpuDecoder`` (rust/py/decoder.rs) over dense matrices: a tiny random Llama (hidden 64, 2
layers) whose matrices are float32, float16 or bfloat16 (``cpu_decoder.Dense``), or a mix of
those and Q4/Q8 blocks, against a float64 numpy forward of the same weights (every dense value
widened exactly, every block dequantised exactly: the reference sees the weights the kernels
multiply, so the only differences are float32 roundings)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

import kvpark._core as _core
from kvpark.model.arch import ModelArch
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.rope_angles import rope_angles
from kvpark.runner.cpu_decoder import DecoderInputs, DecoderLayer, Dense, Matrix, build_decoder

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
U = 2.0**-24  # float32's unit roundoff
PAGE = 4
SEQS = [[3, 17, 99, 5, 64], [120, 1, 42]]  # two items of one step


def arch(intermediate: int) -> ModelArch:
    return ModelArch(
        arch="llama",
        n_layers=2,
        hidden_size=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_size=intermediate,
        vocab_size=128,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_position=32,
        tie_embeddings=False,
    )


def gamma(n: int, u: float = U) -> float:
    return n * u / (1 - n * u)


def weight(kind: str, n: int, k: int, rng: np.random.Generator, sd: float) -> tuple[Matrix, F64]:
    """An [n, k] matrix of ``kind`` (f32, f16, bf16, q4, q8) and its exact values."""
    raw = (sd * rng.standard_normal((n, k))).astype(np.float32)
    if kind == "f32":
        return Dense(raw, "f32"), raw.astype(np.float64)
    if kind == "f16":
        half = raw.astype(np.float16)
        return Dense(half, "f16"), half.astype(np.float64)
    if kind == "bf16":
        bits = (raw.view(np.uint32) >> 16).astype(np.uint16)
        exact = (bits.astype(np.uint32) << 16).view(np.float32)
        return Dense(bits, "bf16"), exact.astype(np.float64)
    # f16-representable scales, as GGUF stores them: scale * quant is exact, as the kernels assume
    blocks = (n, k // 32)
    scale = (sd / 8 * (0.5 + rng.random(blocks))).astype(np.float16).astype(np.float32)
    if kind == "q8":
        qs = rng.integers(-127, 128, (n, k), dtype=np.int8)
        b = Blocks("q8", qs, scale, None)
    else:
        offset = (-8 * scale).astype(np.float32)  # Q4_0 as the loader stores it
        b = Blocks("q4", rng.integers(0, 256, (n, k // 2), dtype=np.uint8), scale, offset)
    return b, b.dequantize().astype(np.float64)


class Model:
    """Random weights of the given kinds, the decoder over them, and the float64 forward."""

    def __init__(self, kinds: dict[str, str], intermediate: int, dot: str = "float32") -> None:
        rng = np.random.default_rng(0)
        self.arch = a = arch(intermediate)
        h, d, i = a.hidden_size, a.head_dim, intermediate
        qkv = (a.n_heads + 2 * a.n_kv_heads) * d
        shapes = {"qkv": (qkv, h), "o": (h, a.n_heads * d), "gate_up": (2 * i, h), "down": (h, i)}
        self.embed, self.embed64 = weight(kinds["embed"], a.vocab_size, h, rng, 0.5)
        self.head, self.head64 = weight(kinds["head"], a.vocab_size, h, rng, 0.1)
        self.norm = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        self.layers: list[dict[str, tuple[Matrix, F64]]] = []
        self.norms: list[tuple[F32, F32]] = []
        for _ in range(a.n_layers):
            self.layers.append(
                {name: weight(kinds[name], n, k, rng, 0.1) for name, (n, k) in shapes.items()}
            )
            pair = [(1 + 0.1 * rng.standard_normal(h)).astype(np.float32) for _ in range(2)]
            self.norms.append((pair[0], pair[1]))
        self.rope = rope_angles(a.inv_freq(), a.max_position)
        cells = PAGE * sum(-(-len(s) // PAGE) for s in SEQS)
        self.cells = [
            (
                np.zeros((cells, a.n_kv_heads, d), np.float32),
                np.zeros((cells, a.n_kv_heads, d), np.float32),
            )
            for _ in range(a.n_layers)
        ]
        layers = [
            DecoderLayer(
                attn_norm=n1,
                qkv=m["qkv"][0],
                o=m["o"][0],
                mlp_norm=n2,
                gate_up=m["gate_up"][0],
                down=m["down"][0],
                k_cells=k,
                v_cells=v,
            )
            for m, (n1, n2), (k, v) in zip(self.layers, self.norms, self.cells, strict=True)
        ]
        self.inputs = DecoderInputs()  # alive with the decoder
        self.decoder = build_decoder(
            a, layers, self.embed, self.norm, self.head, [self.rope], "float32", dot, self.inputs
        )

    def run(self, method: str) -> F32:
        """Every row of :data:`SEQS` as one step, through ``method`` (step or hidden)."""
        pages = [-(-len(s) // PAGE) for s in SEQS]
        tables = [list(range(sum(pages[:j]), sum(pages[: j + 1]))) for j in range(len(SEQS))]
        tokens = [t for s in SEQS for t in s]
        positions = [p for s in SEQS for p in range(len(s))]
        slots = [
            t[p // PAGE] * PAGE + p % PAGE
            for s, t in zip(SEQS, tables, strict=True)
            for p in range(len(s))
        ]
        rows = list(range(len(tokens)))
        width = self.arch.vocab_size if method == "step" else self.arch.hidden_size
        out = np.empty((len(rows), width), dtype=np.float32)
        items = [len(s) for s in SEQS]
        getattr(self.decoder, method)(
            tokens, positions, slots, items, tables, PAGE, rows, int(out.ctypes.data)
        )
        return out

    def reference(self) -> tuple[F64, F64]:
        """The float64 forward: every row's final-norm hidden state and its logits."""
        a = self.arch
        d, half, nq, nkv = (
            a.head_dim,
            a.head_dim // 2,
            a.n_heads * a.head_dim,
            a.n_kv_heads * a.head_dim,
        )
        cos, sin = (t.astype(np.float64) for t in self.rope)
        tokens = [t for s in SEQS for t in s]
        positions = np.array([p for s in SEQS for p in range(len(s))])
        seq_of = np.repeat(np.arange(len(SEQS)), [len(s) for s in SEQS])
        x = self.embed64[tokens]

        def rms(v: F64, w: F32) -> F64:
            out: F64 = v / np.sqrt((v * v).mean(-1, keepdims=True) + a.rms_eps) * w
            return out

        def rope(v: F64) -> F64:
            v = v.reshape(len(tokens), -1, d)
            c, s = cos[positions][:, None], sin[positions][:, None]
            x1, x2 = v[..., :half], v[..., half:]
            return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

        for m, (n1, n2) in zip(self.layers, self.norms, strict=True):
            qkv = rms(x, n1) @ m["qkv"][1].T
            q, k, v = rope(qkv[:, :nq]), rope(qkv[:, nq : nq + nkv]), qkv[:, nq + nkv :]
            v = v.reshape(len(tokens), a.n_kv_heads, d)
            att = np.zeros((len(tokens), a.n_heads, d))
            group = a.n_heads // a.n_kv_heads
            for r in range(len(tokens)):
                seen = (seq_of == seq_of[r]) & (positions <= positions[r])
                for hd in range(a.n_heads):
                    scores = k[seen, hd // group] @ q[r, hd] / np.sqrt(d)
                    p = np.exp(scores - scores.max())
                    att[r, hd] = (p / p.sum()) @ v[seen, hd // group]
            x = x + att.reshape(len(tokens), nq) @ m["o"][1].T
            gu = rms(x, n2) @ m["gate_up"][1].T
            gate, up = gu[:, : a.intermediate_size], gu[:, a.intermediate_size :]
            x = x + (gate / (1 + np.exp(-gate)) * up) @ m["down"][1].T
        hidden = rms(x, self.norm)
        return hidden, hidden @ self.head64.T


DENSE = ["f32", "f16", "bf16"]
# intermediate 88: the down product's k = 88 ends in a tail of 8 past whole chunks of 16
ALL_DENSE = {
    kind: {m: kind for m in ("embed", "qkv", "o", "gate_up", "down", "head")} for kind in DENSE
}
MIXED = {"embed": "q8", "qkv": "q4", "o": "f16", "gate_up": "bf16", "down": "q8", "head": "f32"}


def check_against_reference(model: Model) -> None:
    """The logits within an error budget of the float64 forward, and the head's product of the
    decoder's own hidden rows within its derived bound.

    The head: each product term is exact inside an FMA and meets at most m + 4 roundings
    (m = ceil(hidden / 16) lane updates and the 4-level reduction), so |logit - h @ W.T| <=
    gamma_{m+4} |h| @ |W|.T; float64's own error adds its gamma_k. The whole forward: ~10 ops
    a layer, each within gamma_k (k <= 176, the longest dot) of its exact result relative to the
    magnitudes it sums, one after another: ops * gamma_176 of the logits' magnitudes (|h| @
    |W|.T) takes each op's error as passed on unamplified, which the norm before every product
    and weights of 0.1 keep true to well within its margin (the error seen is ~2e-7 of the
    magnitudes, the budget ~2e-4); a wrong widening, row or kind misses it by orders.
    """
    hidden, logits = model.run("hidden"), model.run("step")
    ref_hidden, ref_logits = model.reference()
    h = hidden.astype(np.float64)
    w = model.head64
    k = h.shape[1]
    head_bound = (gamma(k // 16 + 4) + gamma(k, 2.0**-53)) * (np.abs(h) @ np.abs(w).T)
    assert np.all(np.abs(logits - h @ w.T) <= head_bound)
    ops = 10 * model.arch.n_layers + 2
    magnitude = np.abs(ref_hidden) @ np.abs(w).T
    budget = ops * gamma(176) * magnitude
    err = np.abs(logits - ref_logits)
    assert np.all(err <= budget), float((err / magnitude).max())
    assert np.abs(ref_logits).max() > 100 * budget.max()  # real logits, a tight budget


@pytest.mark.parametrize("kind", DENSE)
def test_a_dense_model_is_the_float64_forward(kind: str) -> None:
    check_against_reference(Model(ALL_DENSE[kind], intermediate=88))


def test_a_model_mixing_blocks_and_dense_matrices() -> None:
    check_against_reference(Model(MIXED, intermediate=96))


@pytest.mark.parametrize("kind", DENSE)
def test_dense_products_ignore_the_block_dot(kind: str) -> None:
    """int8 activations are defined only against blocks: a dense model's bits are the same, and
    bf16 activations (``int8+bf16``) only against BF16 matrices."""
    f32 = Model(ALL_DENSE[kind], intermediate=88).run("step")
    int8 = Model(ALL_DENSE[kind], intermediate=88, dot="int8").run("step")
    assert f32.tobytes() == int8.tobytes()
    if kind != "bf16":
        pairs = Model(ALL_DENSE[kind], intermediate=88, dot="int8+bf16").run("step")
        assert f32.tobytes() == pairs.tobytes()


def round_bf16(x: F32) -> F64:
    """Each value rounded to bf16 as the decoder rounds activations for bf16 pairs (to nearest
    even; a zero or subnormal to a zero of its sign), as float64."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    r = np.where((b & 0x7F800000) == 0, b & 0x80000000, r)
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def test_bf16_matrices_take_bf16_activations_under_the_pairs_dot() -> None:
    """``int8+bf16``: a BF16 matrix whose k is whole chunks of 32 multiplies activations
    rounded to bf16 (rust/cpu_ops/src/dense/bf16_pairs.rs). The head's logits are the product
    of the decoder's own hidden rows so rounded, within the pairs' derived bound (m = k / 16
    updates a lane, then the 4-level reduction); the forward stays within the float64 one's
    budget widened by each product's rounding of its inputs (at most 2^-8 of each, bf16's unit
    roundoff) and so parts from the float32 dot's bits. The down product (k = 88, not whole
    chunks) keeps float32 activations."""
    model = Model(ALL_DENSE["bf16"], intermediate=88, dot="int8+bf16")
    hidden, logits = model.run("hidden"), model.run("step")
    h, w = round_bf16(hidden), model.head64
    k = h.shape[1]
    head_bound = (gamma(k // 16 + 4) + gamma(k, 2.0**-53)) * (np.abs(h) @ np.abs(w).T)
    assert np.all(np.abs(logits - h @ w.T) <= head_bound)
    ref_hidden, ref_logits = model.reference()
    ops = 10 * model.arch.n_layers + 2
    rounded = 3 * model.arch.n_layers + 1  # qkv, o, gate_up and the head take bf16 rows
    magnitude = np.abs(ref_hidden) @ np.abs(w).T
    budget = (ops * gamma(176) + rounded * 2.0**-8) * magnitude
    err = np.abs(logits - ref_logits)
    assert np.all(err <= budget), float((err / magnitude).max())
    f32 = Model(ALL_DENSE["bf16"], intermediate=88).run("step")
    assert f32.tobytes() != logits.tobytes()


def test_dense_matrices_are_checked() -> None:
    inputs = DecoderInputs()
    with pytest.raises(ValueError, match="C-contiguous uint16"):
        inputs.matrix(Dense(np.zeros((4, 8), np.float16), "bf16"))
    m = inputs.matrix(Dense(np.zeros((4, 8), np.float16), "f16"))
    assert (m["kind"], m["n"], m["k"], m["scale"], m["offset"]) == ("h", 4, 8, 0, 0)
    a = arch(96)
    head = Dense(np.zeros((a.vocab_size, a.hidden_size + 1), np.float32), "f32")  # k is off by one
    model = Model(ALL_DENSE["f32"], intermediate=96)
    with pytest.raises(ValueError, match="head"):
        _core._CpuDecoder(
            (64, 4, 2, 16, 96, a.vocab_size),
            1e-6,
            inputs.matrix(model.embed),
            inputs.addr(model.norm),
            inputs.matrix(head),
            [(inputs.addr(model.rope[0]), inputs.addr(model.rope[1]))],
            model.rope[0].size,
            [],
            1,
            "float32",
            "float32",
            {
                "act": "s",
                "embed_scale": 1.0,
                "attn_scale": 0.25,
                "attn_softcap": 0.0,
                "final_softcap": 0.0,
                "window": 0,
            },
        )
