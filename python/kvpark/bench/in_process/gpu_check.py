"""The GPU check (issue 5): the GPU tests, then decode, prefill, park and exact-mode figures on a
Llama-1B-shaped model with random bf16 weights built on the spot (no download, no network).

    kvpark bench --scenario gpu-check --out bench-results/gpu-check.json   # one GPU, < 8 min
    kvpark bench --scenario gpu-check --smoke --out /tmp/gpu-check.json    # tiny, CPU, seconds

(``python bench/gpu_check.py`` in a checkout is the same.) The GPU tests run from the source
checkout's ``tests/``; outside one they are reported as not run.

Measured (CUDA events on a GPU; perf_counter in the smoke run, which checks only that the script
works): the decode step (``TorchRunner.execute``, CUDA graphs on) at batch 1, 16 and 64 against
the HBM roofline, (weight bytes + K/V bytes read per step) / the bandwidth of a large device copy;
prefill tokens/s; park and resume ms per MiB, sync and async; what a park adds to the gap between
the others' tokens; exact mode against normal mode at batch 16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvpark.bench.machine import REPO
from kvpark.model.arch import ModelArch
from kvpark.model.llama import LlamaModel
from kvpark.model.ops.kv_cache import KVCache
from kvpark.preempt.copies import make_transfers
from kvpark.runner.cuda_graphs import DecodeGraphs, graphs_wanted
from kvpark.runner.torch_runner import TorchRunner, select_ops
from kvpark.sched.plan import StepItem, StepPlan

LLAMA_1B = ModelArch("llama", 16, 2048, 32, 8, 64, 8192, 128256, 500000.0, 1e-5, 8192, True)
TINY = ModelArch("llama", 2, 64, 4, 2, 16, 128, 256, 10000.0, 1e-5, 512, True)
ROOFLINE_GOAL = 1.3  # decode at batch 64 within 1.3x of the roofline
MIB = 2**20


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    arch: ModelArch
    ctx: int  # cells of each decoding sequence
    batches: tuple[int, ...]
    prefill: tuple[int, int]  # sequences x rows of one prefill step
    park_cells: int
    iters: int
    copy_bytes: int  # the device copy that measures bandwidth
    page_size: int = 16

    @property
    def kv_cells(self) -> int:
        return max(self.batches) * self.ctx + self.park_cells + self.prefill[0] * self.prefill[1]


GPU = Setup(
    torch.device("cuda"), torch.bfloat16, LLAMA_1B, 1024, (1, 16, 64), (4, 512), 4096, 50, 2**30
)
SMOKE = Setup(torch.device("cpu"), torch.float32, TINY, 32, (1, 2, 4), (2, 32), 64, 3, 16 * MIB)


class Clock:
    """Device time: CUDA events on a GPU, perf_counter on CPU (the step syncs there anyway)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def seconds(self, fn: Any, iters: int) -> float:
        """Mean seconds per call of ``fn``, after one warm-up call."""
        fn()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1000 / iters
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - began) / iters

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def build_model(setup: Setup) -> LlamaModel:
    model = LlamaModel(setup.arch, setup.dtype, setup.device)
    gen = torch.Generator(device=setup.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model


def make_runner(setup: Setup, model: LlamaModel, kv: KVCache, exact: bool) -> TorchRunner:
    """The built-in runner around a model built here (TorchRunner.__init__ loads from a file)."""
    runner = TorchRunner.__new__(TorchRunner)
    runner.device, runner.dtype, runner.page_size = setup.device, setup.dtype, setup.page_size
    runner.ops = select_ops(exact, setup.device)
    runner.loaded = SimpleNamespace(model=model)  # type: ignore[assignment]
    runner.kv = kv
    # no dense prompt path (a CPU choice, cpu_paths.py): every step runs through runner.ops
    runner.cpu_paths, runner.prompt_min_rows, runner.ops_for_prompts = None, None, runner.ops
    runner.threads = 1
    graphs = graphs_wanted(True, setup.device, runner.ops)
    runner.graphs = DecodeGraphs(model, kv, runner.ops, setup.kv_cells) if graphs else None
    return runner


def step_plan(setup: Setup, n_seqs: int, ctx: int, rows: int, first_page: int = 0) -> StepPlan:
    """``n_seqs`` sequences of ``ctx`` cells on consecutive pages, each computing its last
    ``rows`` rows (1: a decode step; ``ctx``: a whole prompt)."""
    ps = setup.page_size
    pages = -(-ctx // ps)
    items, slots, tables = [], [], []
    for b in range(n_seqs):
        table = list(range(first_page + b * pages, first_page + (b + 1) * pages))
        tokens = [(31 * p + 7 * b + 3) % setup.arch.vocab_size for p in range(ctx - rows, ctx)]
        items.append(StepItem(b + 1, ctx - rows, tokens, sample=True))
        slots += [table[p // ps] * ps + p % ps for p in range(ctx - rows, ctx)]
        tables.append(table)
    return StepPlan(items, slots, tables)


def bandwidth(setup: Setup, clock: Clock) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once)."""
    src = torch.empty(setup.copy_bytes, dtype=torch.uint8, device=setup.device)
    dst = torch.empty_like(src)
    return 2 * setup.copy_bytes / clock.seconds(lambda: dst.copy_(src), 10)


def park_costs(setup: Setup, runner: TorchRunner, clock: Clock) -> dict[str, Any]:
    first = setup.kv_cells - setup.park_cells
    cells = list(range(first, setup.kv_cells))
    n_bytes = len(cells) * runner.bytes_per_cell()
    buf = runner.host_buffer(n_bytes)
    mib = n_bytes / MIB

    def timed(fn: Any) -> float:
        samples = []
        for _ in range(5):
            clock.sync()
            began = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)

    out: dict[str, Any] = {"state_mib": mib, "pinned": bool(buf.is_pinned())}
    out["sync_park_ms_per_mib"] = timed(lambda: runner.save_cells(cells, buf)) * 1000 / mib
    out["sync_resume_ms_per_mib"] = timed(lambda: runner.restore_cells(buf, cells)) * 1000 / mib
    transfers = make_transfers(runner, want_async=True)
    if transfers.asynchronous:
        issue = timed(lambda: transfers.save(cells, buf))  # returns before the copy lands
        out["async_park_issue_ms"] = issue * 1000
        out["async_park_ms_per_mib"] = timed(lambda: transfers.save(cells, buf).wait()) * 1000 / mib
        back = timed(lambda: transfers.restore(buf, cells).wait())
        out["async_resume_ms_per_mib"] = back * 1000 / mib
    return out


def park_gap(setup: Setup, runner: TorchRunner, asynchronous: bool) -> dict[str, float]:
    """Wall time of each step of 16 decoding requests (sampling syncs, as the engine's does)
    while a request of ``park_cells`` cells is parked at step 5; the added gap is the slowest
    step during the copy less the median step without one."""
    plan = step_plan(setup, min(16, max(setup.batches)), setup.ctx, 1)
    cells = list(range(setup.kv_cells - setup.park_cells, setup.kv_cells))
    buf = runner.host_buffer(len(cells) * runner.bytes_per_cell())
    transfers = make_transfers(runner, want_async=True) if asynchronous else None
    times: list[float] = []
    during: list[float] = []
    copy = None
    for step in range(20):
        began = time.perf_counter()
        if step == 5:
            if transfers is not None:
                copy = transfers.save(cells, buf)
            else:
                runner.save_cells(cells, buf)
        runner.execute(plan).argmax(-1).tolist()
        took = time.perf_counter() - began
        in_copy = step == 5 or (copy is not None and not copy.done())
        (during if in_copy else times).append(took)
    if copy is not None:
        copy.wait()
    step_s = statistics.median(times[2:])
    return {"step_ms": step_s * 1000, "added_ms": (max(during) - step_s) * 1000}


def run_gpu_tests(timeout_s: float) -> dict[str, Any]:
    root = REPO
    if not (root / "tests").is_dir():
        return {"rc": None, "summary": f"not run: {root} is not a source checkout"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=root)
    except subprocess.TimeoutExpired:
        return {"rc": None, "summary": f"timed out after {timeout_s:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    print("\n".join(lines[-15:]), flush=True)
    return {"rc": done.returncode, "summary": lines[-1] if lines else ""}


def measure(setup: Setup) -> dict[str, Any]:
    torch.manual_seed(0)
    clock = Clock(setup.device)
    model = build_model(setup)
    pages = setup.kv_cells // setup.page_size + 1  # and the CUDA graphs' scratch page
    kv = KVCache.allocate(setup.arch, pages, setup.page_size, setup.dtype, setup.device)
    normal, exact = make_runner(setup, model, kv, False), make_runner(setup, model, kv, True)
    bw = bandwidth(setup, clock)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res: dict[str, Any] = {"bandwidth_gbs": bw / 1e9, "weight_gib": weight_bytes / 2**30}
    decode = {}
    for batch in setup.batches:
        plan = step_plan(setup, batch, setup.ctx, 1)
        step = clock.seconds(lambda plan=plan: normal.execute(plan), setup.iters)
        roof = (weight_bytes + batch * setup.ctx * normal.bytes_per_cell()) / bw
        decode[batch] = {"step_ms": step * 1000, "roofline_ms": roof * 1000, "ratio": step / roof}
    res["decode"] = decode
    n_seqs, rows = setup.prefill  # on the pages after the decoding sequences'
    first = max(setup.batches) * -(-setup.ctx // setup.page_size)
    plan = step_plan(setup, n_seqs, rows, rows, first)
    res["prefill_tok_s"] = plan.n_rows / clock.seconds(lambda: normal.execute(plan), 3)
    res["park"] = park_costs(setup, normal, clock)
    res["gap_sync"] = park_gap(setup, normal, asynchronous=False)
    res["gap_async"] = park_gap(setup, normal, asynchronous=True)
    mid = step_plan(setup, min(16, max(setup.batches)), setup.ctx, 1)
    t_normal = clock.seconds(lambda: normal.execute(mid), setup.iters)
    t_exact = clock.seconds(lambda: exact.execute(mid), setup.iters)
    ex = {"batch": len(mid.items), "normal_ms": t_normal * 1000, "exact_ms": t_exact * 1000}
    res["exact"] = {**ex, "ratio": t_exact / t_normal}
    return res


def goals(res: dict[str, Any]) -> dict[str, bool]:
    top, gap = max(res["decode"]), res["gap_async"]
    roof = f"decode at batch {top} within {ROOFLINE_GOAL}x of the roofline"
    step = "an async park adds less than one decode step to the others' gap"
    return {
        roof: res["decode"][top]["ratio"] <= ROOFLINE_GOAL,
        step: gap["added_ms"] < gap["step_ms"],
    }


def report(res: dict[str, Any]) -> None:
    rows = [("HBM copy bandwidth", f"{res['bandwidth_gbs']:.0f} GB/s")]
    rows.append(("weights", f"{res['weight_gib']:.2f} GiB"))
    for b, d in res["decode"].items():
        rows.append((f"decode, batch {b}", f"{d['step_ms']:.3f} ms/step"))
        rows.append(("  roofline", f"{d['roofline_ms']:.3f} ms ({d['ratio']:.2f}x)"))
    rows.append(("prefill", f"{res['prefill_tok_s']:.0f} tok/s"))
    park = res["park"]
    rows.append(("park state", f"{park['state_mib']:.1f} MiB, pinned {park['pinned']}"))
    for key, value in park.items():
        if key.endswith(("_per_mib", "_ms")):
            rows.append((f"  {key}", f"{value:.4f}"))
    for kind in ("sync", "async"):
        gap = res[f"gap_{kind}"]
        text = f"+{gap['added_ms']:.3f} ms on a {gap['step_ms']:.3f} ms step"
        rows.append((f"gap while parking ({kind})", text))
    ex = res["exact"]
    text = f"{ex['exact_ms']:.3f} vs {ex['normal_ms']:.3f} ms ({ex['ratio']:.2f}x)"
    rows.append((f"exact vs normal, batch {ex['batch']}", text))
    rows += [(f"GOAL {name}", "MET" if met else "NOT MET") for name, met in res["goals"].items()]
    width = max(len(label) for label, _ in rows)
    print("\n".join(f"{label:<{width}}  {value}" for label, value in rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path("bench-results/gpu-check.json"))
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script")
    p.add_argument("--no-tests", action="store_true", help="skip pytest -m gpu")
    p.add_argument("--tests-timeout", type=float, default=300.0, metavar="SECONDS")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device here: run with --smoke to check the script on CPU")
    setup = SMOKE if args.smoke else GPU
    began = time.perf_counter()
    res: dict[str, Any] = {"smoke": args.smoke, "torch": torch.__version__}
    res["device"] = torch.cuda.get_device_name() if setup.device.type == "cuda" else "cpu"
    if not args.smoke and not args.no_tests:
        res["gpu_tests"] = run_gpu_tests(args.tests_timeout)
    res.update(measure(setup))
    res["goals"] = goals(res)
    res["seconds"] = time.perf_counter() - began
    report(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str))
    print(f"wrote {args.out} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
