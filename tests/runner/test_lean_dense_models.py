"""The lean runner over dense models: tiny Hugging Face checkpoints of each variant (Qwen2's
Q/K/V biases and tied head, Qwen3's per-head Q/K norms and head_dim 32, Llama 3's rope scaling;
saved by transformers, tests/model/test_loader.py) in float32 and bfloat16 safetensors, and tiny
F16 and BF16 GGUFs (tests/model/test_numpy_weights.py writes them), each against a float64
forward of the very values the runner holds (bf16 widened exactly, blocks dequantised exactly)
and the checkpoints against transformers' own float32 forward too.

The bound (as tests/runner/test_decoder_dense.py derives it): each of the forward's ops is
within gamma_k (k the longest sum: the hidden size, the MLP's width, the Q heads' width or the
context) of its exact result relative to the magnitudes it sums, and the norm before every
product keeps each op's error passed on unamplified, so a logit is within ``ops * gamma_k`` of
``|h| @ |W|.T`` (h the final-norm hidden row, W the head): ``OPS_PER_LAYER`` counts a layer's
roundings in sequence (norm, product, bias, Q/K norm, rope, the attention's dot, softmax and
sum, output product, bias, residual; norm, gate/up, silu's exp, divide and product, down,
residual). Greedy tokens must match the float64 forward's wherever its top two logits are
further apart than twice the bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import kvpark
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.engine.props import cpu_paths
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.gguf_file import GgufFile
from kvpark.model.numpy_weights import NumpyWeights, Unfit, load_numpy_weights
from kvpark.model.rope_angles import rope_angles
from kvpark.model.weight_arrays import Matrix
from kvpark.runner.cpu_decoder import Dense
from kvpark.runner.lean_runner import LeanCpuRunner, try_lean
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sched.plan import StepItem, StepPlan
from kvpark.tokenizer.tokenizer import Tokenizer
from support.tiny_gguf import write_tiny
from support.tiny_hf import VARIANTS, save_tiny

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]
U = 2.0**-24  # float32's unit roundoff
PAGE, CELLS = 16, 256
OPS_PER_LAYER = 20
PROMPT = [5, 17, 44, 3, 90, 61, 12, 8, 77, 29, 30, 2]  # ids below every vocabulary here
NEW = 8  # greedy tokens after the prompt


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GgufFile(default_gguf_path).metadata)


def config(path: str, **options: object) -> EngineConfig:
    model = ModelConfig(model=path, threads=1, **options)  # type: ignore[arg-type]
    return EngineConfig(model=model, pool=PoolConfig(kv_cells=CELLS, page_size=PAGE))


def hf_checkpoint(kind: str, dtype: torch.dtype, tokenizer: Tokenizer, root: Path) -> Path:
    """A tiny random checkpoint of ``kind`` (test_loader.VARIANTS) saved in ``dtype``."""
    torch.set_num_threads(1)
    model = save_tiny(kind, tokenizer, root)
    if dtype != torch.float32:
        model.to(dtype).save_pretrained(str(root))
    return root


# ---------------------------------------------------------------- the float64 forward
def exact(m: Matrix) -> F64:
    """A matrix's values as the runner multiplies them, widened exactly."""
    if isinstance(m, Blocks):
        return m.dequantize().astype(np.float64)
    if m.dtype == np.uint16:  # bfloat16 bits
        return (m.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return m.astype(np.float64)


def reference(w: NumpyWeights, tokens: list[int]) -> tuple[F64, F64]:
    """Every row's final-norm hidden state and logits, in float64, over the runner's rope
    tables (float32, widened)."""
    a = w.arch
    t, d, half = len(tokens), a.head_dim, a.head_dim // 2
    nq, nkv, group = a.n_heads * d, a.n_kv_heads * d, a.n_heads // a.n_kv_heads
    cos, sin = (x.astype(np.float64)[:t, None, :] for x in rope_angles(a.inv_freq(w.rope_freqs), t))

    def rms(v: F64, weight: F32) -> F64:
        out: F64 = v / np.sqrt((v * v).mean(-1, keepdims=True) + a.rms_eps) * weight
        return out

    def rope(v: F64) -> F64:
        x1, x2 = v[..., :half], v[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    causal = np.tril(np.ones((t, t), dtype=bool))
    x = exact(w.embed)[tokens]
    for layer in w.layers:
        vec, mat = layer.vectors, {k: exact(m) for k, m in layer.matrices.items()}
        qkv = rms(x, vec["attn_norm"]) @ mat["qkv_w"].T + vec.get("qkv_b", 0.0)
        q = qkv[:, :nq].reshape(t, a.n_heads, d)
        k = qkv[:, nq : nq + nkv].reshape(t, a.n_kv_heads, d)
        v = qkv[:, nq + nkv :].reshape(t, a.n_kv_heads, d)
        if "q_norm" in vec:
            q, k = rms(q, vec["q_norm"]), rms(k, vec["k_norm"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(d), -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(t, nq)
        x = x + att @ mat["o_w"].T + vec.get("o_b", 0.0)
        gu = rms(x, vec["mlp_norm"]) @ mat["gate_up_w"].T
        gate, up = gu[:, : a.intermediate_size], gu[:, a.intermediate_size :]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ mat["down_w"].T
    hidden = rms(x, w.norm)
    return hidden, hidden @ exact(w.head).T


def budget(w: NumpyWeights, context: int) -> float:
    """The bound's factor: ``ops * gamma_k`` (module doc)."""
    a = w.arch
    k = max(a.hidden_size, a.intermediate_size, a.n_heads * a.head_dim, context)
    return (OPS_PER_LAYER * a.n_layers + 2) * gamma(k)


# ---------------------------------------------------------------- the runner's steps
def step(r: LeanCpuRunner, start: int, tokens: list[int]) -> F32:
    """``tokens`` of sequence 0 from position ``start``: the last row's logits."""
    cells = list(range(start, start + len(tokens)))  # page table 0, 1, ...: cell = position
    plan = StepPlan([StepItem(0, start, tokens, True)], cells, [list(range(CELLS // PAGE))])
    logits: F32 = r.execute(plan)[0]
    return logits


def greedy(r: LeanCpuRunner) -> tuple[list[int], F32]:
    """Half the prompt as one chunk, the rest a row a step, then ``NEW`` greedy tokens: the
    sequence and the logits after each of its rows from the chunk's last on."""
    first = len(PROMPT) // 2
    rows = [step(r, 0, PROMPT[:first])]
    seq = list(PROMPT)
    for pos in range(first, len(PROMPT) + NEW - 1):
        if pos >= len(PROMPT):
            seq.append(int(rows[-1].argmax()))
        rows.append(step(r, pos, [seq[pos]]))
    seq.append(int(rows[-1].argmax()))
    return seq, np.stack(rows)


def check_logits(r: LeanCpuRunner, want: F64 | None = None) -> None:
    """The runner's logits within the bound of the float64 forward (and of ``want``, another
    float32 forward's, within twice it), and its greedy tokens the float64 forward's wherever
    the margin is wider than the bound."""
    seq, got = greedy(r)
    first = len(PROMPT) // 2 - 1
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
    clear = (top2[:, 1] - top2[:, 0] > 2 * bound.max(axis=-1))[len(PROMPT) - 1 - first :]
    picked = np.array(seq[len(PROMPT) :])
    assert clear.sum() >= NEW // 2  # most steps decide: the check is not vacuous
    best = ref_logits[len(PROMPT) - 1 - first :].argmax(-1)
    assert np.array_equal(picked[clear], best[clear])


def transformers_logits(root: Path, tokens: list[int]) -> F64:
    """transformers' float32 forward of the checkpoint (a bf16 one widened exactly)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    with torch.inference_mode():
        out: F64 = model(torch.tensor([tokens])).logits[0].double().numpy()
    return out


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", list(VARIANTS))
def test_a_hugging_face_checkpoint_runs_lean_as_its_float64_forward(
    kind: str, dtype: torch.dtype, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = hf_checkpoint(kind, dtype, tokenizer, tmp_path)
    r = LeanCpuRunner.load(config(str(root)))
    assert r.cpu_paths.weights == "dense" and r.cpu_paths.describe()["block_dot"] is None
    kind_of = "bf16" if dtype == torch.bfloat16 else "f32"
    matrices = [r.embed_matrix, r.head_matrix, *(m for ms in r.matrices for m in ms.values())]
    assert all(isinstance(m, Dense) and m.kind == kind_of for m in matrices)
    # the file's dtype, not a float32 copy: 2 bytes a weight for bf16
    itemsize = 2 if dtype == torch.bfloat16 else 4
    assert r.weights.layers[0].matrices["qkv_w"].dtype.itemsize == itemsize
    assert (r.head_matrix is r.embed_matrix) == r.weights.arch.tie_embeddings
    seq, _ = greedy(r)
    check_logits(LeanCpuRunner.load(config(str(root))), transformers_logits(root, seq[:-1]))


GGUF_FILES = {
    "F16, tied": (dict(attn=Q.F16, mlp=Q.F16, embed=Q.F16), "dense"),
    "BF16, untied": (dict(attn=Q.BF16, mlp=Q.BF16, embed=Q.BF16, head=Q.BF16), "dense"),
    "F16 attention and head beside Q8_0 MLP blocks, a Q4_1 embedding": (
        dict(attn=Q.F16, head=Q.F16),
        "blocks and dense",
    ),
}


@pytest.mark.parametrize("case", list(GGUF_FILES))
def test_a_dense_gguf_runs_lean_as_its_float64_forward(
    case: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The tiny GGUFs carry no tokenizer: the runner is built over their weights. Blocks take
    float32 activations here (the bound is float32's; int8's is rust/cpu_ops/tests), and the
    cells are float32 (the default pool under that dot is bf16, which rounds K and V)."""
    options, weights = GGUF_FILES[case]
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", **options)  # type: ignore[arg-type]
    c = config(str(path), block_dot="float32", kv_dtype="float32")
    r = LeanCpuRunner(c.model, c.pool, load_numpy_weights(GgufFile(str(path))), tokenizer, "t")
    assert r.cpu_paths.weights == weights
    check_logits(r)


def test_the_embedding_of_a_dense_model_is_its_float64_pooled_hidden_state(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The mean of the final-norm rows, normalised. Each hidden value is within ``ops *
    gamma_k`` of its magnitude (the premise of the logits' bound), the float32 mean adds ``n``
    roundings of the same, and normalising a vector moves it by at most twice its error over
    its length."""
    root = hf_checkpoint("qwen3 (qk norm, head_dim 32)", torch.bfloat16, tokenizer, tmp_path)
    r = LeanCpuRunner.load(config(str(root)))
    got = r.embed(PROMPT)
    hidden, _ = reference(r.weights, PROMPT)
    mean = hidden.mean(axis=0)
    eps = budget(r.weights, len(PROMPT)) + len(PROMPT) * U
    bound = 2 * eps * float(np.linalg.norm(np.abs(hidden).mean(axis=0))) / np.linalg.norm(mean)
    assert got.dtype == np.float32 and got.shape == (r.weights.arch.hidden_size,)
    assert float(np.linalg.norm(got - mean / np.linalg.norm(mean))) <= bound < 1e-2
    assert not np.allclose(r.embed(PROMPT[::-1]), got, atol=1e-2)


def test_in_exact_mode_a_dense_rows_bits_do_not_depend_on_its_step(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = hf_checkpoint("qwen2 (qkv bias, tied)", torch.bfloat16, tokenizer, tmp_path)
    r = LeanCpuRunner.load(config(str(root), exact=True))
    assert r.row_invariant
    table = [list(range(p * 4, p * 4 + 4)) for p in range(4)]  # sequence s: pages 4 s ..

    def plan(items: list[StepItem]) -> StepPlan:
        slots = [
            table[it.seq_id][p // PAGE] * PAGE + p % PAGE
            for it in items
            for p in range(it.start, it.start + len(it.token_ids))
        ]
        return StepPlan(items, slots, [table[it.seq_id] for it in items])

    alone = r.execute(plan([StepItem(0, 0, PROMPT, True)]))[0]
    start = 0
    for i, n in enumerate((5, 1, len(PROMPT) - 6)):  # in chunks, beside other rows
        others = [StepItem(1 + j, i, [40 + j], True) for j in range(3)]
        last = r.execute(plan([*others, StepItem(0, start, PROMPT[start : start + n], True)]))
        start += n
    assert np.array_equal(last[-1], alone)


def test_auto_serves_a_hugging_face_directory_on_the_lean_runner(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = hf_checkpoint("llama3 rope scaling", torch.bfloat16, tokenizer, tmp_path)
    llm = kvpark.LLM(str(root), threads=1, kv_cells=CELLS)
    assert isinstance(llm.engine.runner, LeanCpuRunner)
    shown = cpu_paths(llm.engine)
    assert shown is not None and shown["runner"] == "lean" and shown["weights"] == "dense"
    params = kvpark.SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    assert out.error is None
    seq, _ = greedy(LeanCpuRunner.load(config(str(root))))
    assert out.choices[0].token_ids == seq[len(PROMPT) :]


def test_what_the_decoder_cannot_run_goes_to_the_torch_runner(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """bf16 activations (``--dtype bfloat16``: the decoder's are float32) and a float64
    checkpoint (no product for F64 values) are refused with the reason; auto runs them in
    torch."""
    torch.set_num_threads(1)
    root = hf_checkpoint("qwen2 (qkv bias, tied)", torch.float64, tokenizer, tmp_path)
    runner, why = try_lean(config(str(root)))
    assert runner is None and why is not None and " is F64, which the decoder" in why
    with pytest.raises(Unfit, match="F64"):
        LeanCpuRunner.load(config(str(root)))
    assert isinstance(kvpark.LLM(str(root), threads=1, kv_cells=CELLS).engine.runner, TorchRunner)
    root = hf_checkpoint("qwen2 (qkv bias, tied)", torch.bfloat16, tokenizer, tmp_path / "bf16")
    runner, why = try_lean(config(str(root), dtype="bfloat16"))
    assert runner is None and why == "its activations are float32, not bfloat16 (--dtype)"
    with pytest.raises(ValueError, match="--runner lean cannot run this model: its activations"):
        kvpark.LLM(str(root), runner="lean", dtype="bfloat16", threads=1, kv_cells=CELLS)
