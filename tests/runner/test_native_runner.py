"""The native CPU runner (runner/native_runner.py): whole decode steps in Rust, against the torch
runner it is built on, on the real default model.

With float32 activations (``--block-dot float32``) it must keep the torch runner's greedy tokens
on the parity prompts and be no further from it than
the torch runner's own block path is from its dense float32 path (two orders of the same float32
sums, measured in the same run). With either block dot (``--block-dot int8``'s agreement with
llama.cpp's greedy tokens is tests/model/test_llamacpp_greedy.py's) it must give a row the same
bits whatever shares its step and however its prompt is chunked, give the plain path's bits on
every instruction set this CPU runs, and hand the steps it cannot run to torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvpark
from kvpark import SamplingParams, _core
from kvpark.config.layers import ModelConfig, PoolConfig
from kvpark.runner.native_runner import NativeCpuRunner
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sched.plan import StepItem, StepPlan

PAGE = 16
QUESTIONS = [  # the parity prompts of tests/model/test_model_parity.py
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
]


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


def runner(cls: type[TorchRunner], required: bool = False, **options: object) -> TorchRunner:
    torch.set_num_threads(1)
    options.setdefault("weights", "blocks")
    # the decoder's own arithmetic on every row: the parity prompts prefilled together hold 64
    # rows and more, which the default prompt path would send to the dense GEMM
    options.setdefault("prompt_path", "same")
    config = ModelConfig(threads=1, **options)  # type: ignore[arg-type]
    pool = PoolConfig(kv_cells=2048, page_size=PAGE)
    return (
        NativeCpuRunner(config, pool, required=required)
        if cls is NativeCpuRunner
        else cls(config, pool)
    )


@pytest.fixture(scope="module")
def native() -> NativeCpuRunner:
    r = runner(NativeCpuRunner)
    assert isinstance(r, NativeCpuRunner) and r.decoder is not None
    return r


@pytest.fixture(scope="module")
def prompts(native: NativeCpuRunner) -> list[list[int]]:
    return prompts_of(native)


def prefill(r: TorchRunner, prompts: list[list[int]]) -> torch.Tensor:
    return r.execute(plan_for([StepItem(s, 0, p, True) for s, p in enumerate(prompts)]))


def test_close_to_the_torch_runner_as_its_own_paths_are_to_each_other(
    prompts: list[list[int]],
) -> None:
    # float32 activations: with int8 ones (the default) a last-bit change of an input can move
    # a value to the next int8 step, so two correct int8 paths differ by int8's error (bounded
    # in rust/cpu_ops/tests/int8_bound.rs), not by float32's
    native32 = runner(NativeCpuRunner, block_dot="float32")
    blocks = runner(TorchRunner, block_dot="float32")
    dense = runner(TorchRunner, weights="dense")
    got, ref, other = prefill(native32, prompts), prefill(blocks, prompts), prefill(dense, prompts)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    ours = ((got - ref).abs().max() / ref.abs().max()).item()
    theirs = ((other - ref).abs().max() / ref.abs().max()).item()
    assert 0 < ours <= max(theirs, 1e-6) * 4, (ours, theirs)


def test_the_torch_runners_greedy_tokens_on_the_parity_prompts() -> None:
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    out = {}
    for name in ("native", "torch"):
        llm = kvpark.LLM(
            runner=name, weights="blocks", block_dot="float32", threads=1, kv_cells=1024
        )
        assert llm.engine.runner.runner_kind == name
        out[name] = [o.token_ids for o in llm.chat(chats, params)]
    assert all(len(t) == 32 for t in out["torch"])
    assert out["native"] == out["torch"]


def test_a_rows_bits_do_not_depend_on_its_step(
    native: NativeCpuRunner, prompts: list[list[int]]
) -> None:
    """Normal mode too: every native step is row-invariant (exact mode's tests run it end to
    end, tests/engine/test_exact_engine.py)."""
    p = prompts[0]
    alone = native.execute(plan_for([StepItem(0, 0, p, True)]))
    # the same prompt in chunks of 5, beside other sequences' prompts and decode rows
    chunks = [p[i : i + 5] for i in range(0, len(p), 5)]
    start = 0
    for i, chunk in enumerate(chunks):
        others = [StepItem(1 + j, i, [100 + j], True) for j in range(3)]
        last = i == len(chunks) - 1
        logits = native.execute(plan_for([*others, StepItem(0, start, chunk, last)]))
        start += len(chunk)
    assert torch.equal(logits[-1], alone[0])
    # decode rows: alone, and as one of eight
    nxt = int(alone[0].argmax())
    one = native.execute(plan_for([StepItem(0, len(p), [nxt], True)]))
    others = [StepItem(1 + j, 3 + j, [200 + j], True) for j in range(7)]
    many = native.execute(plan_for([*others[:4], StepItem(0, len(p), [nxt], True), *others[4:]]))
    assert torch.equal(many[4], one[0])  # its own cell rewritten with the same bits


def test_a_pool_of_each_dtype(prompts: list[list[int]]) -> None:
    got = {}
    for dtype in ("float32", "bfloat16", "float16"):
        r = runner(NativeCpuRunner, kv_dtype=dtype, block_dot="float32")
        assert r.kv.k[0].dtype == getattr(torch, dtype)
        got[dtype] = prefill(r, prompts)
    for dtype in ("bfloat16", "float16"):  # 16-bit cells: other low bits, the same tokens
        assert torch.equal(got[dtype].argmax(-1), got["float32"].argmax(-1))
        assert not torch.equal(got[dtype], got["float32"])


def test_steps_it_cannot_run_go_to_torch() -> None:
    dense = runner(NativeCpuRunner, weights="dense")
    assert dense.decoder is None and dense.runner_kind == "torch"
    with pytest.raises(ValueError, match="--runner native"):
        runner(NativeCpuRunner, required=True, weights="dense")


def test_bad_steps_are_refused_and_change_nothing(native: NativeCpuRunner) -> None:
    before = native.kv.k[0].clone()
    vocab = native.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        native.execute(plan_for([StepItem(0, 0, [vocab], True)]))
    plan = plan_for([StepItem(0, 0, [1, 2], True)])
    with pytest.raises(ValueError, match="outside the pool"):
        native.execute(StepPlan(plan.items, [0, 10**9], plan.page_tables))
    assert torch.equal(native.kv.k[0], before)


STEP = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_native_runner import prefill, prompts_of, runner
from kvpark.runner.native_runner import NativeCpuRunner
r = runner(NativeCpuRunner)
assert r.decoder is not None
# each prompt's last 5 tokens: 15 rows, a full tile of the kernels' 8 rows (ROW_TILE) and a partial
# one, reach every kernel of a step; the whole prompts took the plain path (~0.4 s a row) a minute
torch.save(prefill(r, [p[-5:] for p in prompts_of(r)]), sys.argv[1])
"""


def prompts_of(r: TorchRunner) -> list[list[int]]:
    tok = r.tokenizer
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [tok.encode(tok.apply_chat_template(c)) for c in chats]


def test_every_path_this_cpu_runs_gives_the_plain_bits(tmp_path: Path) -> None:
    levels = ["plain", "avx2", "avx512"]
    runnable = levels[: levels.index(str(_core._cpu_features()[0]["isa"])) + 1]
    here = str(Path(__file__).parent)
    results = {}
    for cap in runnable:
        out = tmp_path / f"{cap}.pt"
        env = {**os.environ, "KVPARK_CPU_ISA": cap}
        done = subprocess.run(
            [sys.executable, "-c", STEP, str(out), here], env=env, capture_output=True, timeout=300
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        results[cap] = torch.load(out)
    for cap, got in results.items():
        assert torch.equal(got, results["plain"]), cap
