"""transfers.py and Parking's copies in flight; the tests marked ``gpu`` run the CUDA copy stream.

On CPU: the buffer layout of the CUDA path (gather / scatter / cell_view) is byte for byte the
layout of the runner's synchronous ``save_cells`` / ``restore_cells``, ``make_transfers`` picks
the synchronous copies without CUDA, and Parking never frees a buffer under a copy in flight.
"""

from __future__ import annotations

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.model.ops.kv_cache import KVCache
from kvpark.preempt.buffers import Parking
from kvpark.preempt.copies import make_transfers
from kvpark.preempt.cuda_copies import CudaTransfers
from kvpark.preempt.sync_copies import SyncTransfers
from kvpark.runner.torch_runner import TorchRunner
from kvpark.sampling.sampler import SampleRow, make_generator, sample_rows
from support.preempt import PolledTransfers

PAGES, PAGE, HEADS, DIM, LAYERS = 6, 4, 2, 8, 3


def runner_on(device: str, dtype: torch.dtype = torch.float32) -> TorchRunner:
    """A TorchRunner holding only a random KV pool: what the copies read and write."""
    shape = (PAGES, PAGE, HEADS, DIM)
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(LAYERS)]
    v = [torch.randn(shape, generator=gen).to(device, dtype) for _ in range(LAYERS)]
    runner = TorchRunner.__new__(TorchRunner)  # no model: the parking members need only these
    runner.kv = KVCache(k=k, v=v)
    runner.device = torch.device(device)
    return runner


def interleaved(kv: KVCache) -> list[torch.Tensor]:
    """K and V of every layer in the saved-cell layout's row order: K0, V0, K1, V1, ..."""
    return [t for pair in zip(kv.k, kv.v, strict=True) for t in pair]


def cells_of(kv: KVCache, cells: list[int]) -> list[torch.Tensor]:
    return [c.view(-1, HEADS, DIM)[cells].clone() for c in (*kv.k, *kv.v)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_copy_streams_layout_is_the_runners(dtype: torch.dtype) -> None:
    runner = runner_on("cpu", dtype)
    cells = [13, 2, 7, 8, 21]  # scattered, out of order
    want = runner.host_buffer(len(cells) * runner.bytes_per_cell() + 64)
    assert want.dtype == dtype  # 16-bit cells are parked as they are, never widened
    runner.save_cells(cells, want)
    saved = runner.kv.cell_view(want, len(cells))
    assert all(
        torch.equal(saved[i], c)
        for i, c in enumerate(c.view(-1, HEADS, DIM)[cells] for c in interleaved(runner.kv))
    )
    got = torch.zeros_like(want)
    runner.kv.cell_view(got, len(cells)).copy_(runner.kv.gather_cells(torch.tensor(cells)))
    used = len(cells) * runner.bytes_per_cell() // want.element_size()
    assert torch.equal(got[:used], want[:used]) and got[:used].abs().sum() > 0
    # and back: scatter writes exactly what restore_cells writes
    fresh = [0, 1, 4, 5, 6]
    before = cells_of(runner.kv, cells)
    runner.kv.scatter_cells(torch.tensor(fresh), runner.kv.cell_view(got, len(cells)))
    assert all(torch.equal(a, b) for a, b in zip(cells_of(runner.kv, fresh), before, strict=True))


def test_make_transfers_copies_synchronously_without_cuda() -> None:
    runner = runner_on("cpu")
    assert isinstance(make_transfers(runner, want_async=True), SyncTransfers)
    assert isinstance(make_transfers(object(), want_async=True), SyncTransfers)  # type: ignore[arg-type]
    transfers = make_transfers(runner, want_async=False)
    assert not transfers.asynchronous and not transfers.overlaps(torch.empty(4))


def test_parking_polls_its_copies_and_never_frees_a_buffer_under_one() -> None:
    runner = runner_on("cpu")
    fake = PolledTransfers(runner, pool=_NoPool(), polls=3)
    parking = Parking(runner, n_slots=2, transfers=fake)
    assert parking.asynchronous
    cells = [3, 9, 10]
    assert parking.swap_out(1, cells, capacity=0) is not None
    assert parking.in_flight(1) and not parking.in_flight(0)
    assert [parking.landed(1), parking.landed(1)] == [False, False]
    assert parking.landed(1) and not parking.in_flight(1)  # the third poll
    parking.swap_in(1, [0, 1, 2])
    [copy] = fake.in_flight()
    assert parking.release(1) > 0  # waits for the copy back first
    assert copy.landed and parking.held_bytes == 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(cells_of(runner.kv, [0, 1, 2]), cells_of(runner.kv, cells), strict=True)
    )


class _NoPool:
    def cells_used(self) -> int:
        return 0


# ---- on a GPU only ----


@pytest.mark.gpu
def test_gpu_copy_stream_round_trip_is_a_byte_copy() -> None:
    runner = runner_on("cuda", torch.bfloat16)
    transfers = make_transfers(runner, want_async=True)
    assert isinstance(transfers, CudaTransfers)
    cells = list(range(20, 2, -1))
    n_bytes = len(cells) * runner.bytes_per_cell()
    sync_buf, async_buf = runner.host_buffer(n_bytes), transfers.host_buffer(n_bytes)
    assert async_buf.is_pinned() and transfers.overlaps(async_buf)
    runner.save_cells(cells, sync_buf)
    saved = transfers.save(cells, async_buf)
    saved.wait()
    assert saved.done() and torch.equal(async_buf, sync_buf)
    before = cells_of(runner.kv, cells)
    fresh = list(range(PAGES * PAGE - len(cells), PAGES * PAGE))
    restored = transfers.restore(async_buf, fresh)
    restored.wait()
    assert restored.done()
    assert all(torch.equal(a, b) for a, b in zip(cells_of(runner.kv, fresh), before, strict=True))
    pageable = torch.empty_like(sync_buf, device="cpu")  # falls back to a synchronous copy
    assert not transfers.overlaps(pageable) and transfers.save(cells, pageable).done()
    assert torch.equal(pageable, sync_buf)


@pytest.mark.gpu
def test_gpu_async_parks_leave_tokens_and_logprobs_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    prompt = "Write a long story about a dragon who learns to bake bread."
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", "0")
    plain = kvpark.LLM(device="cuda", kv_cells=1024, preempt=False).generate(prompt, params)[0]
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", "8")
    llm = kvpark.LLM(device="cuda", kv_cells=1024)
    assert llm.engine.preemption is not None and llm.engine.preemption.asynchronous
    parked = llm.generate(prompt, params)[0]
    assert parked.finished is not None and parked.finished.parks >= 4
    assert parked.token_ids == plain.token_ids
    assert parked.choices[0].logprobs == plain.choices[0].logprobs
    assert llm.engine.scheduler.pool.cells_used() == 0 and llm.engine.stats.preempt_ram_bytes == 0


@pytest.mark.gpu
def test_gpu_sampling_draws_the_same_tokens_as_on_cpu() -> None:
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(temperature=0.8, top_k=50, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=1.2, min_p=0.05, frequency_penalty=0.3, seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, n=2, seed=5),
    ]

    def draw(device: str) -> list[list[int]]:
        rows = [
            SampleRow(p, [make_generator(p.seed or 0, j) for j in range(p.n)], [1, 2, 2, 7])
            for p in params
        ]
        return [[t for t, _ in row] for row in sample_rows(logits.to(device), rows)]

    assert draw("cuda") == draw("cpu")
