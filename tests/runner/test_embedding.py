"""The built-in runners' ``embed`` (runner/embedding.py) on the real default model: it neither
reads nor writes the pool's cells, so a running request's K/V stays bit for bit and the vector
does not depend on what the pool holds; and it is the mean of the final-norm hidden states,
normalised (the pooling the docs promise), on the dense prompt path and on the block path alike,
with float32 activations against the blocks even where decode rows take int8 ones (the default).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpark.config.layers import ModelConfig, PoolConfig
from kvpark.model.ops import KVCache
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.runner.native_runner import NativeCpuRunner

PAGE = 16
PROMPT = "Explain in two sentences why the sky is blue. " * 8  # > 64 rows: prompt-sized GEMMs


def build(block_dot: str) -> NativeCpuRunner:
    config = ModelConfig(threads=1, block_dot=block_dot)
    return NativeCpuRunner(config, PoolConfig(kv_cells=512, page_size=PAGE))


@pytest.fixture(scope="module", params=["float32", "auto"])
def runner(request: pytest.FixtureRequest) -> NativeCpuRunner:
    """``float32``: float32 activations, whose prompts take a dense GEMM (float32 on AVX2,
    which embed uses too; bfloat16 where the CPU has it natively, which embed leaves to the
    prompts); ``auto``: int8 activations for decode rows, prompts on the block products."""
    torch.set_num_threads(1)
    return build(str(request.param))


def test_embed_leaves_the_pool_alone_and_ignores_what_it_holds(runner: NativeCpuRunner) -> None:
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
    runner: NativeCpuRunner,
) -> None:
    ids = runner.tokenizer.encode("The capital of France is Paris.", add_special_tokens=True)
    n, model = len(ids), runner.loaded.model
    kv = KVCache.allocate(runner.loaded.arch, 1, PAGE * 2, torch.float32, torch.device("cpu"))
    cells = torch.arange(n)
    meta = AttentionMetadata(cells, [0, n], [n], cells[None], n)
    paths = runner.cpu_paths
    assert paths is not None
    # the dense prompt GEMM where it is float32 (AVX2), not a bfloat16 one (native bf16 CPUs)
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
