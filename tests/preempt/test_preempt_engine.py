"""Preemption in the engine on the real default model: parks change nothing a client sees.

The server-level scenarios (notices, /slots, /metrics) are in tests/server/test_preempt_*.py;
these drive ``kvpark.LLM`` directly so each case can pick its own pool and knobs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.engine.outputs import NoticeEvent, TokenEvent
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.runner.torch_runner import TorchRunner
from support.preempt import assert_clean

PROMPT = "Write a long story about a dragon who learns to bake bread."
POLICIES = ["fcfs", "cost"]


def make(
    monkeypatch: pytest.MonkeyPatch,
    every: int = 0,
    fail_save: bool = False,
    planner: str = "on",
    **options: object,
) -> kvpark.LLM:
    torch.set_num_threads(1)
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "1" if fail_save else "0")
    monkeypatch.setenv("KVPARK_PREEMPT_PLANNER", planner)
    options.setdefault("dtype", "float32")
    options.setdefault("kv_cells", 1024)
    options.setdefault("parallel", 4)
    return kvpark.LLM(**options)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def logprobs(out: kvpark.RequestOutput) -> list[float]:
    assert out.choices[0].logprobs is not None
    return [lp.logprob for lp in out.choices[0].logprobs]


@pytest.mark.parametrize(
    ("kv_dtype", "pool", "runner_name"),
    [
        ("f32", "float32", "lean"),
        ("bf16", "bfloat16", "lean"),
        ("f16", "float16", "lean"),
        ("bf16", "bfloat16", "torch"),  # the torch pool's copies (KVCache)
    ],
)
def test_forced_swap_parks_leave_tokens_and_logits_exactly(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: str, pool: str, runner_name: str
) -> None:
    options = {"kv_dtype": kv_dtype, "runner": runner_name}
    plain = make(monkeypatch, preempt=False, **options).generate(PROMPT, greedy(40))[0]
    llm = make(monkeypatch, every=8, **options)
    runner = llm.engine.runner
    kind = LeanCpuRunner if runner_name == "lean" else TorchRunner
    assert isinstance(runner, kind) and cell_type(runner) == pool
    parks: list[str] = []
    save_cells = runner.save_cells

    def save_as_it_is(cells: list[int], out: Any) -> None:
        save_cells(cells, out)
        parks.append(str(out.dtype).removeprefix("torch."))
        assert saved_cells(runner, cells, out) == cells_now(runner, cells)

    monkeypatch.setattr(runner, "save_cells", save_as_it_is)
    parked = llm.generate(PROMPT, greedy(40))[0]
    assert parked.finished is not None and parked.finished.parks >= 4
    assert parked.finished.recomputes == 0
    stored = {"float32": "float32", "bfloat16": "uint16" if runner_name == "lean" else "bfloat16"}
    stored["float16"] = "float16"
    assert len(parks) == parked.finished.parks and set(parks) == {stored[pool]}  # cells as they are
    assert parked.token_ids == plain.token_ids
    assert logprobs(parked) == logprobs(plain)  # a swap is a byte copy: bit-identical
    assert llm.engine.stats.preemptions_total["swap"] >= 4
    assert llm.engine.stats.resumes_total == llm.engine.stats.preemptions_total["swap"]
    assert_clean(llm)


def cell_type(runner: object) -> str:
    if isinstance(runner, LeanCpuRunner):
        return runner.pool.dtype
    assert isinstance(runner, TorchRunner)
    return str(runner.kv.k[0].dtype).removeprefix("torch.")


def saved_cells(runner: object, cells: list[int], out: Any) -> bytes:
    """The bytes a park saved for ``cells``, in the saved-cell layout."""
    per_cell = runner.bytes_per_cell()  # type: ignore[attr-defined]
    if isinstance(out, torch.Tensor):
        out = (out.view(torch.int16) if out.dtype == torch.bfloat16 else out).numpy()
    return bytes(out.view(np.uint8)[: per_cell * len(cells)])


def cells_now(runner: object, cells: list[int]) -> bytes:
    """The same cells' K and V in the pool, laid out as a park saves them."""
    if isinstance(runner, LeanCpuRunner):
        heads, dim = runner.pool.cell_shape
        parts = [
            c.reshape(-1, heads, dim)[cells]
            for kv in zip(runner.pool.k, runner.pool.v, strict=True)
            for c in kv
        ]
        return b"".join(p.tobytes() for p in parts)
    assert isinstance(runner, TorchRunner)
    gathered = runner.kv.gather_cells(torch.tensor(cells))
    if gathered.dtype == torch.bfloat16:
        gathered = gathered.view(torch.int16)
    return gathered.numpy().tobytes()


def test_forced_recompute_parks_keep_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = make(monkeypatch, preempt=False).generate(PROMPT, greedy(32))[0]
    llm = make(monkeypatch, every=8, preempt_ram_mib=0)
    parked = llm.generate(PROMPT, greedy(32))[0]
    assert parked.finished is not None
    assert parked.finished.parks == parked.finished.recomputes >= 3
    assert parked.token_ids == plain.token_ids
    stats = llm.engine.stats
    assert stats.preemptions_total == {"swap": 0, "recompute": parked.finished.parks}
    assert stats.recomputed_tokens_total > 0
    # the replay is not billed as prompt
    assert parked.finished.prompt_tokens == len(parked.prompt_token_ids)
    assert stats.prompt_tokens_total == len(parked.prompt_token_ids)
    assert_clean(llm)


def test_failed_host_allocation_falls_back_to_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make(monkeypatch, every=8, fail_save=True)
    out = llm.generate(PROMPT, greedy(24))[0]
    assert out.finished is not None and out.finished.parks >= 2
    assert out.finished.recomputes == out.finished.parks
    assert llm.engine.stats.preemptions_total["swap"] == 0
    assert_clean(llm)


def test_seeded_sampling_survives_recompute_parks(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    plain = make(monkeypatch, preempt=False).generate(PROMPT, params)[0]
    parked = make(monkeypatch, every=6, preempt_ram_mib=0).generate(PROMPT, params)[0]
    assert parked.finished is not None and parked.finished.recomputes >= 3
    assert parked.token_ids == plain.token_ids  # the replay draws nothing from the generator


def test_a_recompute_resume_starts_its_rotation_clock_when_the_replay_catches_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A replay can take longer than the 2 s rotation protection: counted from the resume, a
    # resident would be rotatable again right after its replay, and recompute parks would thrash.
    llm = make(monkeypatch, every=6, preempt_ram_mib=0, max_batch_tokens=8)
    engine = llm.engine
    engine.add_request("r", llm.tokenizer.encode(PROMPT), greedy(20))
    req = engine._requests["r"]
    caught_up = replay_steps = 0
    while engine.has_work:
        was_replaying = req.park.replaying
        events = engine.step().get("r", [])
        resumed = any(isinstance(e, NoticeEvent) and e.kind == "recomputed" for e in events)
        got_token = any(isinstance(e, TokenEvent) for e in events)
        if req.park.replaying:  # resumed, still replaying: no token yet
            assert not got_token
            replay_steps += 1
        elif got_token and (was_replaying or resumed):  # this step's token ends the replay
            caught_up += 1
            assert req.park.resumed_at == req.last_token_time
    assert caught_up >= 2 and replay_steps >= 2


@pytest.mark.parametrize("policy", POLICIES)
def test_two_generations_that_do_not_fit_together_both_finish(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    # 256 cells; each request needs ~14 + 160 cells: alone it fits, together they do not
    llm = make(monkeypatch, kv_cells=256, preempt_policy=policy, max_batch_tokens=64)
    both = llm.generate([PROMPT, "Count from one to a hundred."], greedy(160))
    assert [o.error for o in both] == [None, None]
    assert [len(o.token_ids) for o in both] == [160, 160]
    assert sum(o.finished.parks for o in both if o.finished) >= 1
    assert_clean(llm)


def test_without_preemption_an_overflow_fails_only_who_cannot_continue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = make(monkeypatch, kv_cells=256, preempt=False, max_batch_tokens=64)
    both = llm.generate([PROMPT, "Count from one to a hundred."], greedy(160))
    errors = [o.error for o in both]
    assert any(e is not None and "Context size" in e for e in errors)
    assert llm.engine.scheduler.pool.cells_used() == 0
    after = llm.generate(PROMPT, greedy(8))[0]  # the engine lives on
    assert after.error is None and len(after.token_ids) == 8


def test_cancel_while_parked_frees_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make(monkeypatch, every=4)
    engine = llm.engine
    engine.add_request("victim", llm.tokenizer.encode(PROMPT), greedy(64))
    for _ in range(40):
        engine.step()
        req = next(iter(engine.scheduler.parked), None)
        if req is not None and req.park.mode == "swap":
            break
    assert engine.scheduler.parked, "the request never parked"
    assert engine.stats.preempt_ram_bytes > 0
    assert engine.abort("victim")
    engine.step()
    assert_clean(llm)
