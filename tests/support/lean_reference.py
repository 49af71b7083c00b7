"""The lean runner's logits against a float64 forward of the very values it holds (bf16 widened
exactly, blocks dequantised exactly), and the derived bound between them, for the runner tests
of dense and K-quant models (tests/runner/test_lean_dense_models.py,
test_lean_kquant_models.py).

The bound (as tests/runner/test_decoder_dense.py derives it): each of the forward's ops is
within gamma_k (k the longest sum: the hidden size, the MLP's width, the Q heads' width or the
context) of its exact result relative to the magnitudes it sums, and the norm before every
product keeps each op's error passed on unamplified, so a logit is within ``ops * gamma_k`` of
``|h| @ |W|.T`` (h the final-norm hidden row, W the head): ``OPS_PER_LAYER`` counts a layer's
roundings in sequence (norm, product, bias, Q/K norm, rope, the attention's dot, softmax and
sum, output product, bias, residual; norm, gate/up, silu's exp, divide and product, down,
residual). Block matrices take float32 activations there (``block_dot="float32"``): each
expanded weight is the dequantised one exactly, so the products are float32 sums like the
dense ones. The cells are float32 too (``config``'s default, not the runner's: a bf16 pool
rounds K and V). Greedy tokens must match the float64 forward's wherever its top two logits are
further apart than twice the bound.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.model.arch import ModelArch
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.numpy_weights import NumpyWeights
from kvpark.model.rope_angles import rope_tables
from kvpark.model.weight_arrays import Matrix, Stacked
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.sched.plan import StepItem, StepPlan

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
U = 2.0**-24  # float32's unit roundoff
PAGE, CELLS = 16, 256
OPS_PER_LAYER = 20
PROMPT = [5, 17, 44, 3, 90, 61, 12, 8, 77, 29, 30, 2]  # ids below every vocabulary here
NEW = 8  # greedy tokens after the prompt


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def config(path: str, **options: object) -> EngineConfig:
    """The runner's config, with float32 cells unless ``kv_dtype`` says otherwise: the bound is
    float32's, and the default pool (bf16) rounds each K and V to 8 bits of fraction."""
    options.setdefault("kv_dtype", "float32")
    model = ModelConfig(model=path, threads=1, **options)  # type: ignore[arg-type]
    return EngineConfig(model=model, pool=PoolConfig(kv_cells=CELLS, page_size=PAGE))


def exact(m: Matrix) -> F64:
    """A matrix's values as the runner multiplies them, widened exactly."""
    if isinstance(m, Stacked):
        return np.concatenate([exact(p) for p in m.parts])
    if isinstance(m, Blocks):
        return m.dequantize().astype(np.float64)
    if m.dtype == np.uint16:  # bfloat16 bits
        return (m.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return m.astype(np.float64)


def reference(
    w: NumpyWeights, tokens: list[int], routed: set[int] | None = None
) -> tuple[F64, F64]:
    """Every row's final-norm hidden state and logits, in float64, over the runner's rope
    tables (float32, widened)."""
    a = w.arch
    t, d, half = len(tokens), a.head_dim, a.head_dim // 2
    nq, nkv, group = a.n_heads * d, a.n_kv_heads * d, a.n_heads // a.n_kv_heads
    tables = [
        (c.astype(np.float64)[:t, None, :], s.astype(np.float64)[:t, None, :])
        for c, s in rope_tables(a, w.rope_freqs)
    ]

    def rms(v: F64, weight: F32) -> F64:
        out: F64 = v / np.sqrt((v * v).mean(-1, keepdims=True) + a.rms_eps) * weight
        return out

    def rope(v: F64, table: int) -> F64:
        cos, sin = tables[table]
        x1, x2 = v[..., :half], v[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def cap(v: F64, c: float | None) -> F64:
        return v if c is None else c * np.tanh(v / c)

    rows, cols = np.arange(t)[:, None], np.arange(t)[None, :]
    x = exact(w.embed)[tokens] * np.float64(np.float32(a.embed_scale))
    for i, layer in enumerate(w.layers):
        window = a.window_of(i)
        causal = (cols <= rows) & (window is None or cols > rows - (window or 0))
        vec, mat = layer.vectors, {k: exact(m) for k, m in layer.matrices.items()}
        qkv = rms(x, vec["attn_norm"]) @ mat["qkv_w"].T + vec.get("qkv_b", 0.0)
        q = qkv[:, :nq].reshape(t, a.n_heads, d)
        k = qkv[:, nq : nq + nkv].reshape(t, a.n_kv_heads, d)
        v = qkv[:, nq + nkv :].reshape(t, a.n_kv_heads, d)
        if "q_norm" in vec:
            q, k = rms(q, vec["q_norm"]), rms(k, vec["k_norm"])
        q, k = rope(q, a.rope_table_of(i)), rope(k, a.rope_table_of(i))
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = cap(np.einsum("thd,shd->hts", q, k) * a.attention_scale, a.attn_softcap)
        scores = np.where(causal, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(t, nq)
        out = att @ mat["o_w"].T + vec.get("o_b", 0.0)
        x = x + (rms(out, vec["post_attn_norm"]) if a.sandwich_norms else out)
        h = rms(x, vec["mlp_norm"])
        out = moe(a, h, mat, routed) if a.is_moe(i) else mlp(a, h, mat["gate_up_w"], mat["down_w"])
        x = x + (rms(out, vec["post_mlp_norm"]) if a.sandwich_norms else out)
    hidden = rms(x, w.norm)
    return hidden, cap(hidden @ exact(w.head).T, a.final_softcap)


def mlp(a: ModelArch, h: F64, gate_up: F64, down: F64) -> F64:
    gu = h @ gate_up.T
    width = gu.shape[1] // 2
    gate, up = gu[:, :width], gu[:, width:]
    if a.activation == "gelu_tanh":
        act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
    else:
        act = gate / (1 + np.exp(-gate))
    out: F64 = (act * up) @ down.T
    return out


def moe(a: ModelArch, h: F64, mat: dict[str, F64], routed: set[int] | None) -> F64:
    """The mixture: each row's top experts by its router logits, their softmax weights
    (renormalised where ``norm_topk``), their MLPs summed; ``routed`` gets the experts picked."""
    logits = h @ mat["router_w"].T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for r in range(h.shape[0]):
        picked = np.argsort(-logits[r], kind="stable")[: a.experts_per_token]
        w = p[r, picked] / (p[r, picked].sum() if a.norm_topk else 1.0)
        if routed is not None:
            routed |= {int(e) for e in picked}
        for e, weight in zip(picked, w, strict=True):
            gate_up, down = mat[f"expert.{e}.gate_up_w"], mat[f"expert.{e}.down_w"]
            out[r] += weight * mlp(a, h[r : r + 1], gate_up, down)[0]
    return out


def budget(w: NumpyWeights, context: int) -> float:
    """The bound's factor: ``ops * gamma_k`` (module doc)."""
    a = w.arch
    k = max(a.hidden_size, a.intermediate_size, a.n_heads * a.head_dim, context)
    # Gemma's extra roundings a layer: two norms, two adds, the soft-cap's divide, tanh, product
    ops = OPS_PER_LAYER + (7 if a.sandwich_norms else 0)
    ops += 2 * a.experts_per_token + 4 if a.n_experts else 0  # the router, weights, the sum
    return (ops * a.n_layers + 2 + (2 if a.final_softcap else 0)) * gamma(k)


# ---------------------------------------------------------------- the runner's steps
def step(r: LeanCpuRunner, start: int, tokens: list[int]) -> F32:
    """``tokens`` of sequence 0 from position ``start``: the last row's logits."""
    cells = list(range(start, start + len(tokens)))  # page table 0, 1, ...: cell = position
    plan = StepPlan([StepItem(0, start, tokens, True)], cells, [list(range(CELLS // PAGE))])
    logits: F32 = r.execute(plan)[0]
    return logits


def greedy(r: LeanCpuRunner, prompt: list[int] = PROMPT) -> tuple[list[int], F32]:
    """Half the prompt as one chunk, the rest a row a step, then ``NEW`` greedy tokens: the
    sequence and the logits after each of its rows from the chunk's last on."""
    first = len(prompt) // 2
    rows = [step(r, 0, prompt[:first])]
    seq = list(prompt)
    for pos in range(first, len(prompt) + NEW - 1):
        if pos >= len(prompt):
            seq.append(int(rows[-1].argmax()))
        rows.append(step(r, pos, [seq[pos]]))
    seq.append(int(rows[-1].argmax()))
    return seq, np.stack(rows)


def check_logits(
    r: LeanCpuRunner, want: F64 | None = None, prompt: list[int] = PROMPT
) -> list[int]:
    """The runner's logits within the bound of the float64 forward (and of ``want``, another
    float32 forward's of the sequence, within twice it), and its greedy tokens the float64
    forward's wherever the margin is wider than the bound; returns the sequence."""
    seq, got = greedy(r, prompt)
    first = len(prompt) // 2 - 1
    ref_hidden, ref_logits = reference(r.weights, seq[:-1])
    ref_hidden, ref_logits = ref_hidden[first:], ref_logits[first:]
    factor = budget(r.weights, len(seq))
    bound = factor * (np.abs(ref_hidden) @ np.abs(exact(r.weights.head)).T)
    err = np.abs(got - ref_logits)
    assert np.all(err <= bound), float((err / bound).max())
    assert np.abs(ref_logits).max() > 100 * bound.max()  # real logits, a tight bound
    if want is not None:
        assert np.all(np.abs(got - want[first:]) <= 2 * bound)
    top2 = np.sort(ref_logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0] > 2 * bound.max(axis=-1))[len(prompt) - 1 - first :]
    picked = np.array(seq[len(prompt) :])
    assert clear.sum() >= NEW // 2  # most steps decide: the check is not vacuous
    best = ref_logits[len(prompt) - 1 - first :].argmax(-1)
    assert np.array_equal(picked[clear], best[clear])
    return seq


def alone_and_beside_others(r: LeanCpuRunner) -> tuple[F32, F32]:
    """The prompt's last logits run alone in one step, and run in chunks of 5, 1 and the rest,
    each beside three other sequences' rows: in exact mode the two must be the same bits."""
    table = [list(range(p * 4, p * 4 + 4)) for p in range(4)]  # sequence s: pages 4 s ..

    def plan(items: list[StepItem]) -> StepPlan:
        slots = [
            table[it.seq_id][p // PAGE] * PAGE + p % PAGE
            for it in items
            for p in range(it.start, it.start + len(it.token_ids))
        ]
        return StepPlan(items, slots, [table[it.seq_id] for it in items])

    alone: F32 = r.execute(plan([StepItem(0, 0, PROMPT, True)]))[0]
    start = 0
    for i, n in enumerate((5, 1, len(PROMPT) - 6)):
        others = [StepItem(1 + j, i, [40 + j], True) for j in range(3)]
        last = r.execute(plan([*others, StepItem(0, start, PROMPT[start : start + n], True)]))
        start += n
    beside: F32 = last[-1]
    return alone, beside
