"""The lean CPU runner (runner/lean_runner.py): the native decoder without torch, on the real
default model, against the native runner (the same decoder over the torch model): the same
logits and the same cells, bit for bit, through prompts, decode steps beside them, page copies
and a park's save and restore; each pool dtype; a process that never imports torch; and the
models it cannot take going to the torch runners."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from test_native_runner import PAGE, plan_for, prompts_of

import kvpark
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.runner.lean_runner import LeanCpuRunner, try_lean
from kvpark.runner.native_runner import NativeCpuRunner
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sched.plan import StepItem, StepPlan

CELLS = 1024


def config(**options: object) -> EngineConfig:
    model = ModelConfig(threads=1, **options)  # type: ignore[arg-type]
    return EngineConfig(model=model, pool=PoolConfig(kv_cells=CELLS, page_size=PAGE))


def pair(**options: object) -> tuple[LeanCpuRunner, NativeCpuRunner]:
    torch.set_num_threads(1)
    c = config(**options)
    lean = LeanCpuRunner.load(c)
    native = NativeCpuRunner(c.model, c.pool, required=True)
    return lean, native


@pytest.fixture(scope="module")
def runners() -> tuple[LeanCpuRunner, NativeCpuRunner]:
    return pair()


def cells_of(r: LeanCpuRunner | NativeCpuRunner, layer: int) -> tuple[bytes, bytes]:
    if isinstance(r, LeanCpuRunner):
        return r.pool.k[layer].tobytes(), r.pool.v[layer].tobytes()
    k, v = r.kv.k[layer], r.kv.v[layer]
    if k.dtype == torch.bfloat16:
        k, v = k.view(torch.int16), v.view(torch.int16)
    return k.numpy().tobytes(), v.numpy().tobytes()


def both(runners: tuple[LeanCpuRunner, NativeCpuRunner], plan: StepPlan) -> np.ndarray:
    lean, native = runners
    ours, theirs = lean.execute(plan), native.execute(plan)
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float32
    assert ours.tobytes() == theirs.numpy().tobytes()
    return ours


def test_the_same_bits_as_the_native_runner(runners: tuple[LeanCpuRunner, NativeCpuRunner]) -> None:
    lean, native = runners
    assert lean.vocab_size == native.vocab_size and lean.max_model_len == native.max_model_len
    assert lean.model_name == native.model_name and lean.bytes_per_cell() == native.bytes_per_cell()
    prompts = prompts_of(native)
    assert [
        lean.tokenizer.encode(
            lean.tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is the capital of France?"}]
            )
        )
    ] == prompts[:1]
    first = both(runners, plan_for([StepItem(s, 0, p, True) for s, p in enumerate(prompts)]))
    # decode rows beside a new prompt's chunk, the second sequence's first page copied first
    for step in range(3):
        rows = [
            StepItem(s, len(p) + step, [int(first[s].argmax())], True)
            for s, p in enumerate(prompts)
        ]
        chunk = StepItem(3, 5 * step, list(range(100 + 5 * step, 105 + 5 * step)), step == 2)
        plan = plan_for([*rows, chunk])
        copies = [(8, 60 + step)] if step else []
        both(runners, StepPlan(plan.items, plan.slot_mapping, plan.page_tables, copies))
    for layer in (0, len(lean.pool.k) - 1):
        assert cells_of(lean, layer) == cells_of(native, layer)
    assert lean.pool.k[0][61].any() and np.array_equal(lean.pool.k[0][61], lean.pool.k[0][8])
    empty = lean.execute(StepPlan([], [], []))
    assert empty.shape == (0, lean.vocab_size)


def test_a_parks_save_and_restore(runners: tuple[LeanCpuRunner, NativeCpuRunner]) -> None:
    """A sequence's cells saved to a host buffer and restored into other cells decode as the
    native runner's do after the same park."""
    lean, native = runners
    prompt = prompts_of(native)[1]
    logits = both(runners, plan_for([StepItem(5, 0, prompt, True)]))
    cells = [40 * PAGE + i for i in range(len(prompt))]  # sequence 5's cells (plan_for: page 40+)
    saved = []
    for r in runners:
        buf = r.host_buffer(len(cells) * r.bytes_per_cell())
        r.save_cells(cells, buf)
        saved.append(buf)
    assert (
        saved[0].tobytes()[: len(cells) * lean.bytes_per_cell()]
        == (saved[1].numpy().tobytes()[: len(cells) * lean.bytes_per_cell()])
    )
    fresh = [48 * PAGE + i for i in range(len(prompt))]  # sequence 6's pages (48+)
    for r, buf in zip(runners, saved, strict=True):
        r.restore_cells(buf, fresh)
    nxt = int(logits[0].argmax())
    after = both(runners, plan_for([StepItem(6, len(prompt), [nxt], True)]))
    before = both(runners, plan_for([StepItem(5, len(prompt), [nxt], True)]))
    assert after.tobytes() == before.tobytes()  # the restored cells are the saved ones


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_each_16_bit_pool(kv_dtype: str) -> None:
    lean, native = pair(kv_dtype=kv_dtype)
    assert lean.pool.dtype == kv_dtype and native.kv.k[0].dtype == getattr(torch, kv_dtype)
    prompts = prompts_of(native)[:2]
    both((lean, native), plan_for([StepItem(s, 0, p, True) for s, p in enumerate(prompts)]))
    assert cells_of(lean, 0) == cells_of(native, 0)


def test_bad_steps_are_refused_and_change_nothing(
    runners: tuple[LeanCpuRunner, NativeCpuRunner],
) -> None:
    lean, _ = runners
    before = lean.pool.k[0].copy()
    with pytest.raises(ValueError, match="vocabulary"):
        lean.execute(plan_for([StepItem(0, 0, [lean.vocab_size], True)]))
    plan = plan_for([StepItem(0, 0, [1, 2], True)])
    with pytest.raises(ValueError, match="outside the pool"):
        lean.execute(StepPlan(plan.items, [0, 10**9], plan.page_tables))
    with pytest.raises(ValueError, match="bad page copy"):
        lean.execute(StepPlan([], [], [], [(0, CELLS // PAGE)]))
    assert np.array_equal(lean.pool.k[0], before)


def test_what_it_cannot_run_goes_to_the_torch_runners() -> None:
    for options, why in (
        ({"weights": "dense"}, "dense"),
        ({"block_dot": "float32", "prompt_path": "float32"}, "dense float32 GEMM"),
    ):
        runner, reason = try_lean(config(**options))
        assert runner is None and reason is not None and why in reason
        with pytest.raises(ValueError, match="--runner lean cannot run this model"):
            kvpark.LLM(runner="lean", kv_cells=CELLS, threads=1, **options)  # type: ignore[arg-type]
    llm = kvpark.LLM(kv_cells=CELLS, threads=1, weights="dense")
    assert isinstance(llm.engine.runner, TorchRunner)  # auto: the native runner, its torch path


NO_TORCH = """
import sys
import kvpark
llm = kvpark.LLM(kv_cells=512, threads=1)
out = llm.generate("The capital of France is", kvpark.SamplingParams(temperature=0.7, seed=3,
                   max_tokens=8, logprobs=2))[0]
assert out.error is None and len(out.choices[0].token_ids) == 8, out
print(type(llm.engine.runner).__name__, "torch" in sys.modules)
ids = llm.engine.tokenizer.encode("Paris")
vector = llm.engine.runner.embed(ids)
print(len(vector.tolist()), "torch" in sys.modules)
"""


def test_the_default_cpu_process_never_imports_torch() -> None:
    """Sampling, logprobs and all: torch loads only for an embedding (its model, on demand)."""
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert lines[0] == "LeanCpuRunner False"
    assert lines[1] == "576 True"  # the hidden size; the torch model loaded for it
