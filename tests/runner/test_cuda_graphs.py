"""cuda_graphs.py: the static-buffer decode step a CUDA graph captures.

On CPU the same forward runs eagerly over the static buffers (``capture=False``) with the Triton
op set under the interpreter: a padded bucket must give every real row the eager step's logits bit
for bit (the op set is row-invariant), write the real rows' cells exactly as the eager step does,
and send the padding rows only to the scratch page, with stale buffer contents from earlier, wider
steps changing nothing. The tests marked ``gpu`` capture and replay real graphs.
"""

from __future__ import annotations

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.model.llama import LlamaModel
from kvpark.model.ops import KVCache, OpSet
from kvpark.model.ops.triton_ops import cuda_ops, triton_ops
from kvpark.runner.batch import build_padded_decode, build_step_tensors
from kvpark.runner.cuda_graphs import DecodeGraphs, graphs_wanted
from kvpark.sched.plan import StepItem, StepPlan
from support.tiny_model import DEVICE, tiny_model

PAGE, POOL_PAGES = 4, 16
SCRATCH = POOL_PAGES  # one page past the pool's


def kv_pool(model: LlamaModel, device: torch.device | str) -> KVCache:
    kv = KVCache.allocate(model.arch, POOL_PAGES + 1, PAGE, torch.float32, torch.device(device))
    g = torch.Generator().manual_seed(5)
    for cache in (*kv.k, *kv.v):
        cache.copy_(torch.randn(cache.shape, generator=g))
    return kv


def clone(kv: KVCache) -> KVCache:
    return KVCache(k=[c.clone() for c in kv.k], v=[c.clone() for c in kv.v])


def decode_plan(tables: list[list[int]], contexts: list[int], tokens: list[int]) -> StepPlan:
    """One decode row per sequence, at position context - 1 of its pages."""
    items, slots = [], []
    for b, (table, ctx) in enumerate(zip(tables, contexts, strict=True)):
        items.append(StepItem(seq_id=b + 1, start=ctx - 1, token_ids=[tokens[b]], sample=True))
        slots.append(table[(ctx - 1) // PAGE] * PAGE + (ctx - 1) % PAGE)
    return StepPlan(items, slots, tables)


def eager(model: LlamaModel, ops: OpSet, kv: KVCache, plan: StepPlan) -> torch.Tensor:
    step = build_step_tensors(plan, PAGE, kv.k[0].device)
    out: torch.Tensor = model(step.token_ids, step.positions, step.meta, kv, step.logit_rows, ops)
    return out


STEPS = [  # (page tables, contexts): wide first, so later steps meet stale columns and rows
    ([[3, 7, 1], [0, 12, 5, 8], [9]], [10, 14, 2]),
    ([[4]], [3]),
    ([[3, 7], [0, 12], [9, 2], [6, 11], [13]], [5, 8, 7, 6, 1]),
]


def test_a_padded_static_step_matches_the_eager_step_bit_for_bit() -> None:
    model = tiny_model()
    ops = triton_ops()
    kv_eager = kv_pool(model, DEVICE)
    kv_static = clone(kv_eager)
    graphs = DecodeGraphs(model, kv_static, ops, max_cells=64, buckets=(1, 2, 4, 8), capture=False)
    assert graphs.scratch_page == SCRATCH
    scratch_before = [c[SCRATCH].clone() for c in kv_static.k]
    for n, (tables, contexts) in enumerate(STEPS):
        plan = decode_plan(tables, contexts, [(7 * n + 11 * b) % 128 for b in range(len(tables))])
        assert graphs.bucket_for(plan) == {3: 4, 1: 1, 5: 8}[len(tables)]
        got = graphs.run(plan)
        want = eager(model, ops, kv_eager, plan)
        assert got is not None and got.shape == want.shape
        assert torch.equal(got, want)
        for a, b in zip((*kv_static.k, *kv_static.v), (*kv_eager.k, *kv_eager.v), strict=True):
            assert torch.equal(a[:POOL_PAGES], b[:POOL_PAGES])  # the pool's pages: as eager
    # padding rows wrote (only) the scratch page
    assert any(
        not torch.equal(a[SCRATCH], b) for a, b in zip(kv_static.k, scratch_before, strict=True)
    )


def test_steps_a_graph_cannot_serve_run_eagerly() -> None:
    model = tiny_model()
    graphs = DecodeGraphs(model, kv_pool(model, DEVICE), triton_ops(), 16, (1, 2), capture=False)
    assert graphs.max_pages == 4
    prompt = StepPlan([StepItem(1, 0, [5, 6], sample=True)], [0, 1], [[0]])
    assert graphs.bucket_for(prompt) is None and graphs.run(prompt) is None
    unsampled = StepPlan([StepItem(1, 3, [5], sample=False)], [3], [[0]])
    assert graphs.bucket_for(unsampled) is None
    three = decode_plan([[0], [1], [2]], [1, 1, 1], [1, 2, 3])
    assert graphs.bucket_for(three) is None  # above the largest bucket
    wide = decode_plan([[0, 1, 2, 3, 4]], [18], [1])
    assert graphs.bucket_for(wide) is None  # wider than the static page tables
    assert graphs.bucket_for(StepPlan([], [], [])) is None


def test_released_pages_point_at_the_scratch_page_in_a_padded_step() -> None:
    """A page a sequence gave back behind a sliding window (-1 in the plan) never reaches a
    kernel as an index outside the pool."""
    plan = StepPlan([StepItem(1, 9, [5], True)], [2 * PAGE + 1], [[-1, -1, 2]])
    step = build_padded_decode(plan, 2, SCRATCH, PAGE)
    assert step.page_tables[0].tolist() == [SCRATCH, SCRATCH, 2]
    assert step.page_tables[1].tolist() == [SCRATCH] * 3  # the padding row


def test_graphs_are_wanted_only_for_the_triton_ops_on_cuda() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_wanted(True, cuda, cuda_ops()) and graphs_wanted(True, cuda, triton_ops())
    assert not graphs_wanted(False, cuda, cuda_ops())
    assert not graphs_wanted(True, cpu, triton_ops())
    assert not graphs_wanted(True, cuda, OpSet.default())


# ---- on a GPU only ----


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [True, False])
def test_gpu_replayed_steps_match_eager_ones(exact: bool) -> None:
    model = tiny_model()  # on CUDA where there is one (support.tiny_model.DEVICE)
    ops = triton_ops() if exact else cuda_ops()
    kv_eager = kv_pool(model, DEVICE)
    kv_graph = clone(kv_eager)
    graphs = DecodeGraphs(model, kv_graph, ops, max_cells=64, buckets=(1, 2, 4, 8))
    for n, (tables, contexts) in enumerate([*STEPS, *STEPS]):  # the second pass replays
        plan = decode_plan(tables, contexts, [(5 * n + 3 * b) % 128 for b in range(len(tables))])
        got = graphs.run(plan)
        want = eager(model, ops, kv_eager, plan)
        assert got is not None
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert sorted(graphs._graphs) == [1, 4, 8]


@pytest.mark.gpu
def test_gpu_exact_mode_tokens_are_the_same_with_and_without_graphs() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    prompts = ["Write a story about a dragon.", "Count from one to ten.", "Name three colours."]
    runs = []
    for graphs in (True, False):
        llm = kvpark.LLM(device="cuda", exact=True, kv_cells=2048, cuda_graphs=graphs)
        runner = llm.engine.runner
        assert (getattr(runner, "graphs", None) is not None) is graphs
        runs.append([(o.token_ids, o.choices[0].logprobs) for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
