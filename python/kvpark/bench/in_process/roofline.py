"""How far a CPU decode step is from its memory roofline: bytes a step reads / measured bandwidth.

    kvpark bench --scenario roofline --threads 2 --batch 1,8 --context 128

A decode step reads every weight once (the layers' block matrices and the head) plus, per row,
its sequence's K and V cells in every layer; at a few rows that is all it does, so the time to
stream those bytes at the machine's read bandwidth is a floor no kernel can beat. This measures
the bandwidth (the best of several sums over a 512 MiB float32 array, on one thread, and with
torch installed on ``--threads`` threads too), loads the lean runner (the CPU's one stack; default
model, block weights),
times decode steps at each batch size with every row at ``--context`` cells, and prints the
bytes, the floor, the measured step and their ratio as lines for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvpark import _core
from kvpark.bench.machine import cpu_name
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.sched.plan import StepItem, StepPlan

PAGE = 16


def read_bandwidth(threads: int, mib: int = 512, tries: int = 7) -> float:
    """Bytes per second a sum over a ``mib`` MiB array streams, best of ``tries``: numpy's on one
    thread, torch's (the one library here that sums on several) on more."""
    if threads == 1:
        data = np.ones(mib * 2**20 // 4, dtype=np.float32)
        return data.nbytes / min(_timed(data.sum) for _ in range(tries))
    import torch  # the gpu extra; a one-thread floor needs none

    torch.set_num_threads(threads)
    tensor = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    best = min(_timed(tensor.sum) for _ in range(tries))
    torch.set_num_threads(1)
    return tensor.numel() * 4 / best


def _timed(f: object) -> float:
    t = time.perf_counter()
    f()  # type: ignore[operator]
    return time.perf_counter() - t


def weight_bytes(runner: LeanCpuRunner) -> int:
    """Bytes of every matrix a decode step multiplies (layers and head)."""
    w = runner.weights
    layers = sum(m.nbytes for layer in w.layers for m in layer.matrices.values())
    return layers + w.head.nbytes


def kv_bytes_per_row(runner: LeanCpuRunner, context: int) -> int:
    return context * runner.bytes_per_cell()  # K and V of every layer, each cell read once


def decode_plan(batch: int, context: int) -> StepPlan:
    pages = -(-(context + 1) // PAGE)
    items, slots, tables = [], [], []
    for s in range(batch):
        table = list(range(s * pages, (s + 1) * pages))
        items.append(StepItem(s, context - 1, [100 + s], True))
        tables.append(table)
        slots.append(table[(context - 1) // PAGE] * PAGE + (context - 1) % PAGE)
    return StepPlan(items=items, slot_mapping=slots, page_tables=tables)


def step_ms(runner: LeanCpuRunner, plan: StepPlan, steps: int) -> float:
    runner.execute(plan)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    bandwidth = {n: read_bandwidth(n) for n in sorted({1, args.threads})}
    batches = [int(b) for b in args.batch.split(",")]
    config = ModelConfig(threads=args.threads, weights="blocks", runner="lean")
    pool = PoolConfig(kv_cells=max(batches) * (args.context + PAGE) // PAGE * PAGE * 2)
    runner = LeanCpuRunner.load(EngineConfig(model=config, pool=pool))
    weights = weight_bytes(runner)
    bw = bandwidth[args.threads]
    print(f"CPU: {cpu_name()}; flags {_core._cpu_features()[0]}")
    print(
        "read bandwidth: "
        + ", ".join(f"{n} threads {b / 1e9:.1f} GB/s" for n, b in bandwidth.items())
    )
    print(f"weights a step reads: {weights / 1e6:.1f} MB; KV per row at {args.context} cells: "
          f"{kv_bytes_per_row(runner, args.context) / 1e6:.2f} MB")  # fmt: skip
    print("| rows | bytes read | floor at measured bandwidth | measured step | floor / measured |")
    print("|---|---|---|---|---|")
    rows = []
    for batch in batches:
        read = weights + batch * kv_bytes_per_row(runner, args.context)
        floor = read / bw * 1e3
        measured = step_ms(runner, decode_plan(batch, args.context), args.steps)
        rows.append({"rows": batch, "bytes": read, "floor_ms": floor, "step_ms": measured})
        print(f"| {batch} | {read / 1e6:.1f} MB | {floor:.2f} ms | {measured:.2f} ms "
              f"({batch / measured * 1e3:.0f} tok/s) | {floor / measured:.0%} |")  # fmt: skip
    if args.json:
        meta: dict[str, object] = {"cpu": cpu_name(), "flags": _core._cpu_features()[0]}
        meta["bandwidth"] = bandwidth
        meta |= {"runner": "lean", "context": args.context, "rows": rows}
        args.json.write_text(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
