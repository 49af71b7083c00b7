"""The lean CPU runner (runner/lean_runner.py), the CPU's one stack: whole steps in the Rust
decoder over numpy weights and pool, on the real default model, against the torch runner (the
reference, over the same blocks).

With float32 activations (``--block-dot float32``) it must keep the torch runner's greedy tokens
on the parity prompts and be no further from it than the torch runner's own block path is from
its dense float32 path (two orders of the same float32 sums, measured in the same run). With
either block dot (``--block-dot int8``'s agreement with llama.cpp's greedy tokens is
tests/model/test_llamacpp_greedy.py's) it must give a row the same bits whatever shares its step
and however its prompt is chunked, keep page copies and a park's saved cells bit for bit, and
refuse bad steps without touching the pool.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.runner.lean_runner import LeanCpuRunner, try_lean
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sched.plan import StepItem, StepPlan

PAGE = 16
CELLS = 2048
QUESTIONS = [  # the parity prompts of tests/model/test_model_parity.py
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
]


def config(**options: object) -> EngineConfig:
    model = ModelConfig(**{"threads": 1, **options})  # type: ignore[arg-type]
    return EngineConfig(model=model, pool=PoolConfig(kv_cells=CELLS, page_size=PAGE))


def lean(**options: object) -> LeanCpuRunner:
    return LeanCpuRunner.load(config(**options))


def torch_runner(**options: object) -> TorchRunner:
    torch.set_num_threads(1)
    options.setdefault("weights", "blocks")
    options.setdefault("prompt_path", "same")  # the blocks' own arithmetic on every row
    c = config(**options)
    return TorchRunner(c.model, c.pool)


def plan_for(items: list[StepItem]) -> StepPlan:
    """Sequence ``s`` owns pages ``8 s .. 8 s + 7`` (128 cells)."""
    slots: list[int] = []
    tables = []
    for it in items:
        pages = [it.seq_id * 8 + p for p in range(8)]
        tables.append(pages)
        slots += [
            pages[p // PAGE] * PAGE + p % PAGE
            for p in range(it.start, it.start + len(it.token_ids))
        ]
    return StepPlan(items=items, slot_mapping=slots, page_tables=tables)


def prompts_of(r: LeanCpuRunner | TorchRunner) -> list[list[int]]:
    tok = r.tokenizer
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [tok.encode(tok.apply_chat_template(c)) for c in chats]


def prefill(r: LeanCpuRunner | TorchRunner, prompts: list[list[int]]) -> np.ndarray:
    logits = r.execute(plan_for([StepItem(s, 0, p, True) for s, p in enumerate(prompts)]))
    return logits.numpy() if isinstance(logits, torch.Tensor) else logits


@pytest.fixture(scope="module")
def runner() -> LeanCpuRunner:
    return lean()


@pytest.fixture(scope="module")
def prompts(runner: LeanCpuRunner) -> list[list[int]]:
    return prompts_of(runner)


def test_close_to_the_torch_runner_as_its_own_paths_are_to_each_other(
    prompts: list[list[int]],
) -> None:
    # float32 activations: with int8 ones (the default) a last-bit change of an input can move
    # a value to the next int8 step, so two correct int8 paths differ by int8's error (bounded
    # in rust/cpu_ops/tests/int8_bound.rs), not by float32's
    got = prefill(lean(block_dot="float32"), prompts)
    ref = prefill(torch_runner(block_dot="float32"), prompts)
    other = prefill(torch_runner(weights="dense"), prompts)
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    ours = float(np.abs(got - ref).max() / np.abs(ref).max())
    theirs = float(np.abs(other - ref).max() / np.abs(ref).max())
    assert 0 < ours <= max(theirs, 1e-6) * 4, (ours, theirs)


def test_the_torch_runners_greedy_tokens_on_the_parity_prompts() -> None:
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    out = {}
    for name in ("lean", "torch"):
        llm = kvpark.LLM(
            runner=name, weights="blocks", block_dot="float32", threads=1, kv_cells=1024
        )
        assert llm.engine.runner.runner_kind == name
        out[name] = [o.token_ids for o in llm.chat(chats, params)]
    assert all(len(t) == 32 for t in out["torch"])
    assert out["lean"] == out["torch"]


def test_a_rows_bits_do_not_depend_on_its_step(
    runner: LeanCpuRunner, prompts: list[list[int]]
) -> None:
    """Normal mode too: every step of the decoder is row-invariant (exact mode's tests run it
    end to end, tests/engine/test_exact_engine.py)."""
    p = prompts[0]
    alone = runner.execute(plan_for([StepItem(0, 0, p, True)]))
    # the same prompt in chunks of 5, beside other sequences' prompts and decode rows
    chunks = [p[i : i + 5] for i in range(0, len(p), 5)]
    start = 0
    for i, chunk in enumerate(chunks):
        others = [StepItem(1 + j, i, [100 + j], True) for j in range(3)]
        last = i == len(chunks) - 1
        logits = runner.execute(plan_for([*others, StepItem(0, start, chunk, last)]))
        start += len(chunk)
    assert np.array_equal(logits[-1], alone[0])
    # decode rows: alone, and as one of eight
    nxt = int(alone[0].argmax())
    one = runner.execute(plan_for([StepItem(0, len(p), [nxt], True)]))
    others = [StepItem(1 + j, 3 + j, [200 + j], True) for j in range(7)]
    many = runner.execute(plan_for([*others[:4], StepItem(0, len(p), [nxt], True), *others[4:]]))
    assert np.array_equal(many[4], one[0])  # its own cell rewritten with the same bits


def test_a_prompts_row_wise_work_split_over_two_threads_keeps_its_bits(
    prompts: list[list[int]],
) -> None:
    """A prompt of 120 rows passes rust/cpu_ops/src/row_split.rs's size, so its norms, rope,
    SwiGLU, residual adds and int8 quantising go to both kernel threads: the bits of one."""
    long = (prompts[0] * 8)[:120]
    logits = {}
    for threads in (2, 1):  # one thread last: the module's other tests run on it
        r = lean(threads=threads)
        logits[threads] = r.execute(plan_for([StepItem(0, 0, long, True)]))
        assert r.threads == threads
    assert np.isfinite(logits[1]).all()
    assert np.array_equal(logits[2], logits[1])


def test_page_copies_and_a_parks_save_and_restore_keep_the_cells(
    runner: LeanCpuRunner, prompts: list[list[int]]
) -> None:
    prompt = prompts[1]
    logits = runner.execute(plan_for([StepItem(5, 0, prompt, True)]))
    cells = [40 * PAGE + i for i in range(len(prompt))]  # sequence 5's cells (plan_for: page 40+)
    buf = runner.host_buffer(len(cells) * runner.bytes_per_cell())
    runner.save_cells(cells, buf)
    fresh = [48 * PAGE + i for i in range(len(prompt))]  # sequence 6's pages (48+)
    runner.restore_cells(buf, fresh)
    nxt = int(logits[0].argmax())
    after = runner.execute(plan_for([StepItem(6, len(prompt), [nxt], True)]))
    before = runner.execute(plan_for([StepItem(5, len(prompt), [nxt], True)]))
    assert after.tobytes() == before.tobytes()  # the restored cells are the saved ones
    runner.execute(StepPlan([], [], [], [(40, 61)]))  # a copy-on-write of sequence 5's page
    assert runner.pool.k[0][61].any() and np.array_equal(runner.pool.k[0][61], runner.pool.k[0][40])
    empty = runner.execute(StepPlan([], [], []))
    assert empty.shape == (0, runner.vocab_size)


def test_a_pool_of_each_dtype(prompts: list[list[int]]) -> None:
    got, first_keys = {}, {}
    for dtype in ("float32", "bfloat16", "float16"):
        r = lean(kv_dtype=dtype, block_dot="float32")
        assert r.pool.dtype == dtype
        got[dtype] = prefill(r, prompts)
        first_keys[dtype] = r.pool.k[0][:8].copy()  # sequence 0's first layer: the same input
    wide = first_keys["float32"]
    # the first layer's keys are computed in float32 from the same embedding whatever the pool:
    # a 16-bit pool holds them rounded to nearest, bit for bit
    as_bf16 = (torch.from_numpy(wide).to(torch.bfloat16).view(torch.int16).numpy()).view(np.uint16)
    assert np.array_equal(first_keys["bfloat16"], as_bf16)
    assert np.array_equal(first_keys["float16"], wide.astype(np.float16))
    for dtype in ("bfloat16", "float16"):  # 16-bit cells: other low bits, the same tokens
        assert np.array_equal(got[dtype].argmax(-1), got["float32"].argmax(-1))
        assert not np.array_equal(got[dtype], got["float32"])


def test_bad_steps_are_refused_and_change_nothing(runner: LeanCpuRunner) -> None:
    before = runner.pool.k[0].copy()
    with pytest.raises(ValueError, match="vocabulary"):
        runner.execute(plan_for([StepItem(0, 0, [runner.vocab_size], True)]))
    plan = plan_for([StepItem(0, 0, [1, 2], True)])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.execute(StepPlan(plan.items, [0, 10**9], plan.page_tables))
    with pytest.raises(ValueError, match="bad page copy"):
        runner.execute(StepPlan([], [], [], [(0, CELLS // PAGE)]))
    assert np.array_equal(runner.pool.k[0], before)


def test_what_it_cannot_run_goes_to_the_torch_runner() -> None:
    for options, why in (
        ({"weights": "dense"}, "dense"),
        ({"block_dot": "float32", "prompt_path": "float32"}, "dense float32 GEMM"),
    ):
        runner, reason = try_lean(config(**options))
        assert runner is None and reason is not None and why in reason
        with pytest.raises(ValueError, match="--runner lean cannot run this model"):
            kvpark.LLM(runner="lean", kv_cells=CELLS, threads=1, **options)  # type: ignore[arg-type]
    llm = kvpark.LLM(kv_cells=CELLS, threads=1, weights="dense")
    assert isinstance(llm.engine.runner, TorchRunner)  # auto: the torch runner takes it
