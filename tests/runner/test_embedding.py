"""The built-in runners' ``embed`` (runner/embedding.py) on the real default model: it neither
reads nor writes the pool's cells, so a running request's K/V stays bit for bit and the vector
does not depend on what the pool holds; and it is the mean of the final-norm hidden states,
normalised (the pooling the docs promise), on the dense prompt path and on the block path alike.
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


def build(prompt_path: str) -> NativeCpuRunner:
    config = ModelConfig(threads=1, prompt_path=prompt_path)
    return NativeCpuRunner(config, PoolConfig(kv_cells=512, page_size=PAGE))


@pytest.fixture(scope="module", params=["auto", "same"])
def runner(request: pytest.FixtureRequest) -> NativeCpuRunner:
    """``auto``: the float32 dense prompt GEMM on AVX2; ``same``: the block products."""
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
    ops = runner.ops_for_prompts if runner.prompt_min_rows is not None else runner.ops
    hidden = model.final_hidden(torch.tensor(ids), cells, meta, kv, ops)
    assert torch.equal(runner.embed(ids), F.normalize(hidden.mean(dim=0), dim=0))
