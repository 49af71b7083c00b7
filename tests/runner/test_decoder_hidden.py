"""``_CpuDecoder.hidden`` (rust/py/decoder.rs) on the real default model, through the lean
runner's decoder: the rows' final-norm hidden states, the head's input. On a fresh pool, the
same step through ``step`` writes the same cells, and its logits are the head applied to those
hidden rows: bit for bit through the same block product (float32 and int8 dots alike), and
within the rounding bound of a dot product of ``hidden`` terms against the dequantised head."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

import kvpark._core as _core
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.model.gguf_blocks import Blocks
from kvpark.runner.cpu_decoder import DecoderInputs
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.runner.numpy_pool import NumpyKVPool

PAGE = 16
CHAT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
F32 = npt.NDArray[np.float32]


def runner(block_dot: str) -> LeanCpuRunner:
    model = ModelConfig(threads=1, block_dot=block_dot)
    return LeanCpuRunner.load(
        EngineConfig(model=model, pool=PoolConfig(kv_cells=256, page_size=PAGE))
    )


@pytest.fixture(scope="module")
def f32_lean() -> LeanCpuRunner:
    return runner("float32")


@pytest.fixture(scope="module")
def int8_lean() -> LeanCpuRunner:
    return runner("int8")


@pytest.fixture(params=["float32", "int8"])
def lean(request: pytest.FixtureRequest) -> LeanCpuRunner:
    r: LeanCpuRunner = request.getfixturevalue(
        "f32_lean" if request.param == "float32" else "int8_lean"
    )
    assert r.cpu_paths.block_dot == request.param
    return r


def prompts(r: LeanCpuRunner) -> list[list[int]]:
    """Two sequences in one step: the chat and a plain run of text."""
    tok = r.tokenizer
    return [tok.encode(tok.apply_chat_template(CHAT)), tok.encode("The ocean is deep and " * 3)]


def through(
    r: LeanCpuRunner, seqs: list[list[int]], rows: list[int], method: str
) -> tuple[F32, NumpyKVPool]:
    """``seqs`` as one step's items on a fresh float32 pool (sequence after sequence, page after
    page), through the decoder's ``method``; what it wrote for ``rows``, and the pool."""
    pages = [-(-len(s) // PAGE) for s in seqs]
    pool = NumpyKVPool(r.weights.arch, sum(pages), PAGE, "float32")
    decoder, _inputs = r._build_decoder(pool, r.cpu_paths.decoder_dot)  # alive with it
    tables = [list(range(sum(pages[:i]), sum(pages[: i + 1]))) for i in range(len(seqs))]
    tokens = [t for s in seqs for t in s]
    positions = [p for s in seqs for p in range(len(s))]
    slots = [
        t[p // PAGE] * PAGE + p % PAGE
        for s, t in zip(seqs, tables, strict=True)
        for p in range(len(s))
    ]
    arch = r.weights.arch
    width = arch.vocab_size if method == "step" else arch.hidden_size
    out = np.empty((len(rows), width), dtype=np.float32)
    items = [len(s) for s in seqs]
    args = (tokens, positions, slots, items, tables, PAGE, rows, int(out.ctypes.data))
    getattr(decoder, method)(*args)
    return out, pool


def head_product(head: Blocks, x: F32, int8: bool) -> F32:
    """``x @ head.T`` through the crate's block product, the decoder's head's kernel."""
    m = DecoderInputs().matrix(head)  # checks each array's dtype and contiguity
    n, k = head.shape
    x = np.ascontiguousarray(x)
    y = np.empty((x.shape[0], n), dtype=np.float32)
    kernels = {
        ("4", False): _core._blockmm_q4,
        ("8", False): _core._blockmm_q8,
        ("4", True): _core._blockmm_q4_i8,
        ("8", True): _core._blockmm_q8_i8,
    }
    kernel = kernels[m["kind"], int8]
    kernel(
        int(x.ctypes.data), x.shape[0], k, m["qs"], m["scale"], m["offset"], n, int(y.ctypes.data)
    )
    return y


def picked_rows(seqs: list[list[int]]) -> list[int]:
    """Each sequence's last row, a middle one and the very first, out of row order."""
    first, second = len(seqs[0]), len(seqs[1])
    return [first + second - 1, first - 1, first // 2, 0]


def test_hidden_rows_are_the_heads_input(lean: LeanCpuRunner) -> None:
    seqs = prompts(lean)
    rows = picked_rows(seqs)
    hidden, hidden_pool = through(lean, seqs, rows, "hidden")
    logits, step_pool = through(lean, seqs, rows, "step")
    for layer in (0, len(hidden_pool.k) - 1):  # the same K/V writes
        assert hidden_pool.k[layer].tobytes() == step_pool.k[layer].tobytes()
        assert hidden_pool.v[layer].tobytes() == step_pool.v[layer].tobytes()
    assert hidden_pool.k[0].any()
    int8 = lean.cpu_paths.block_dot == "int8"
    assert head_product(lean.weights.head, hidden, int8).tobytes() == logits.tobytes()


def test_the_float32_logits_are_the_dequantised_heads_product(f32_lean: LeanCpuRunner) -> None:
    """Against the exact product (float64 of the float32 hidden rows and the dequantised head,
    the same weights bit for bit): a dot product of k terms summed in any order, one rounding a
    step, lies within gamma_k = k u / (1 - k u) of the exact sum times sum |h_i w_i|; float64's
    own error adds its gamma_k."""
    r = f32_lean
    seqs = prompts(r)
    rows = picked_rows(seqs)
    hidden, _ = through(r, seqs, rows, "hidden")
    logits, _ = through(r, seqs, rows, "step")
    vocab = np.arange(0, r.weights.arch.vocab_size, 7)  # a spread of the vocabulary: less memory
    vocab = np.union1d(vocab, logits.argmax(axis=1))
    w = r.weights.head.rows(vocab).dequantize().astype(np.float64)
    h = hidden.astype(np.float64)
    exact = h @ w.T
    k = h.shape[1]
    gamma = sum(k * u / (1 - k * u) for u in (2.0**-24, 2.0**-53))
    bound = gamma * (np.abs(h) @ np.abs(w).T)
    assert np.all(np.abs(logits[:, vocab] - exact) <= bound)
    assert np.abs(exact).max() > 1.0  # real logits, not a trivially met bound


def test_a_row_outside_the_step_is_refused(lean: LeanCpuRunner) -> None:
    seqs = prompts(lean)
    with pytest.raises(ValueError, match="outside the step"):
        through(lean, seqs, [len(seqs[0]) + len(seqs[1])], "hidden")
