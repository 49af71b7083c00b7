"""The built-in runners' ``embed`` on the real default model: the torch runner's
(runner/embedding.py) and the lean runner's (the Rust decoder over a pool of its own). Neither
reads nor writes the pool's cells, so a running request's K/V stays bit for bit and the vector
does not depend on what the pool holds; and it is the mean of the final-norm hidden states,
normalised (the pooling the docs promise), on the dense prompt path and on the block path alike,
with float32 activations against the blocks even where decode rows take int8 ones (the default).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.model.ops import KVCache
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.runner.numpy_pool import NumpyKVPool
from kvpark.runner.torch_runner import TorchRunner

PAGE = 16
PROMPT = "Explain in two sentences why the sky is blue. " * 8  # > 64 rows: prompt-sized GEMMs


def build(block_dot: str) -> TorchRunner:
    prompt_path = "float32" if block_dot == "float32" else "auto"
    config = ModelConfig(threads=1, block_dot=block_dot, weights="blocks", prompt_path=prompt_path)
    return TorchRunner(config, PoolConfig(kv_cells=512, page_size=PAGE))


@pytest.fixture(scope="module", params=["float32", "auto"])
def runner(request: pytest.FixtureRequest) -> TorchRunner:
    """``float32``: float32 activations, whose prompts take a dense float32 GEMM, which embed
    uses too; ``auto``: int8 activations for decode rows, prompts on the block products."""
    torch.set_num_threads(1)
    return build(str(request.param))


def test_embed_leaves_the_pool_alone_and_ignores_what_it_holds(runner: TorchRunner) -> None:
    ids = runner.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert len(ids) > 64
    before = runner.embed(ids)
    for layer in (*runner.kv.k, *runner.kv.v):  # as if other requests had filled every cell
        layer.copy_(torch.randn(layer.shape).to(layer.dtype))
    saved = [t.clone() for t in (*runner.kv.k, *runner.kv.v)]
    again = runner.embed(ids)
    assert torch.equal(before, again)
    assert all(torch.equal(t, s) for t, s in zip((*runner.kv.k, *runner.kv.v), saved, strict=True))
    assert before.dtype == torch.float32 and before.shape == (runner.loaded.arch.hidden_size,)
    assert abs(before.norm().item() - 1.0) < 1e-6
    # the order of tokens matters (causal attention), so a shuffled prompt gives another vector
    assert not torch.allclose(runner.embed(ids[::-1]), before, atol=1e-3)


def test_embed_is_the_normalised_mean_of_the_final_norm_hidden_states(
    runner: TorchRunner,
) -> None:
    ids = runner.tokenizer.encode("The capital of France is Paris.", add_special_tokens=True)
    n, model = len(ids), runner.loaded.model
    kv = KVCache.allocate(runner.loaded.arch, 1, PAGE * 2, torch.float32, torch.device("cpu"))
    cells = torch.arange(n)
    meta = AttentionMetadata(cells, [0, n], [n], cells[None], n)
    paths = runner.cpu_paths
    assert paths is not None
    # the dense prompt GEMM where it is float32
    ops = runner.ops_for_prompts if paths.prompt_dtype == paths.dtype else runner.ops
    int8 = paths.block_dot == "int8"
    assert int8 == (paths.prompt_dtype is None)  # the defaults: int8 rows, prompts on the blocks
    model.set_block_dot(int8=False)  # the float32 product embed() uses under either block dot
    try:
        hidden = model.final_hidden(torch.tensor(ids), cells, meta, kv, ops)
    finally:
        model.set_block_dot(int8=int8)
    got = runner.embed(ids)
    assert torch.equal(got, F.normalize(hidden.mean(dim=0), dim=0))
    assert model.lm_head.int8 == int8  # embed() put the decode rows' product back


@pytest.fixture(scope="module")
def lean() -> LeanCpuRunner:
    pool = PoolConfig(kv_cells=512, page_size=PAGE)
    return LeanCpuRunner.load(EngineConfig(model=ModelConfig(threads=1), pool=pool))


def test_the_lean_embed_leaves_the_pool_alone(lean: LeanCpuRunner) -> None:
    ids = lean.tokenizer.encode(PROMPT, add_special_tokens=True)
    before = lean.embed(ids)
    rng = np.random.default_rng(5)
    for layer in (*lean.pool.k, *lean.pool.v):  # as if other requests had filled every cell
        layer[...] = rng.standard_normal(layer.shape).astype(layer.dtype)
    saved = [t.copy() for t in (*lean.pool.k, *lean.pool.v)]
    again = lean.embed(ids)
    assert np.array_equal(before, again)
    assert all(
        np.array_equal(t, s) for t, s in zip((*lean.pool.k, *lean.pool.v), saved, strict=True)
    )
    assert before.dtype == np.float32 and before.shape == (lean.weights.arch.hidden_size,)
    assert abs(float(np.linalg.norm(before)) - 1.0) < 1e-6
    assert not np.allclose(lean.embed(ids[::-1]), before, atol=1e-3)


def test_the_lean_embed_is_the_pooled_hidden_states_and_the_torch_models(
    lean: LeanCpuRunner,
) -> None:
    """The mean of the decoder's final-norm rows, normalised; and the torch runner's vector
    under the same float32 product, up to float32's reordering. The two sum the same products in
    other orders: a few ulps (~1e-7 relative) an op, ~1e-5 over the 30 layers. Between unit
    vectors 1 - cos is half their squared distance, so 1e-4 allows them 1.4 % apart: far above
    reordering, far below any wrong computation (another pooling, a missing norm, int8 rows)."""
    ids = lean.tokenizer.encode("The capital of France is Paris.", add_special_tokens=True)
    n, pages = len(ids), -(-len(ids) // PAGE)
    got = lean.embed(ids)
    # the decoder's rows straight, over a pool of their own
    pool = NumpyKVPool(lean.weights.arch, pages, PAGE, "float32")
    decoder, _keep = lean._build_decoder(pool, dot="float32")
    rows = np.empty((n, lean.weights.arch.hidden_size), np.float32)
    cells = list(range(n))
    decoder.hidden(ids, cells, cells, [n], [list(range(pages))], PAGE, cells, rows.ctypes.data)
    mean = rows.mean(axis=0, dtype=np.float32)
    assert np.array_equal(got, mean / np.float32(np.linalg.norm(mean)))
    reference = build("float32").embed(ids).numpy()
    assert float(got @ reference) > 1 - 1e-4
