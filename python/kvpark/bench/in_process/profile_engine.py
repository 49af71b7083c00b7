"""Where a kvpark decode step spends its time, on an in-process engine (no HTTP).

    kvpark bench --scenario profile --batch 1,8,16 --threads 2 [--exact]

For each batch size it starts that many requests (seeded prompts of ~64 tokens), runs them through
their prefill, then times ``--steps`` decode steps: the whole ``engine.step()``, the part inside
``runner.execute`` (tensor building plus the model forward), and the rest (scheduling, sampling,
detokenizing, events: Python per step). A second pass under ``torch.profiler`` splits the time of
the steps into torch ops by category (self CPU time on the calling thread): matmuls, attention
(SDPA), KV gathers/copies, other ops; what no op accounts for is Python and dispatch overhead.
The Rust CPU kernels (block-weight matmuls, decode attention; docs/cpu-kernels.md) are not torch
ops: the profiled pass wraps them in ``record_function`` so they count as matmuls and attention.

The profiler pass needs the torch runner (``--runner torch``, the ``kvpark[gpu]`` extra); on the
lean runner (the CPU default) a forward is one call into the Rust decoder, which the profiler
cannot split, so only the first split is printed (``--scenario roofline`` weighs that call
against the bytes it reads).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvpark import LLM, SamplingParams
from kvpark.bench.workload import WorkloadConfig, build_requests
from kvpark.engine.outputs import TokenEvent
from kvpark.model.ops import cpu_attention, op_set

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int",
          "kvpark::block_linear")  # fmt: skip
ATTENTION = ("scaled_dot_product", "aten::_flash_attention", "aten::softmax", "aten::_softmax",
             "kvpark::decode_attention")  # fmt: skip
GATHER = ("aten::index", "aten::gather", "aten::copy_", "aten::index_put", "aten::cat",
          "aten::scatter", "aten::masked")  # fmt: skip


def category(op: str) -> str:
    if op.startswith(MATMUL):
        return "matmul"
    if any(key in op for key in ATTENTION):
        return "attention"
    if op.startswith(GATHER):
        return "gather/copy"
    return "other ops"


def start_batch(llm: LLM, batch: int, prompt_tokens: int, max_tokens: int, tag: str) -> None:
    config = WorkloadConfig(requests=batch, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                            tag=tag)  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    waiting = set()
    for spec in build_requests(config):
        ids = llm.tokenizer.encode(spec.prompt)
        llm.engine.add_request(f"{tag}-{spec.index}", ids, params)
        waiting.add(f"{tag}-{spec.index}")
    # prefill until every request has its first token; bounded by the prompt chunks it can take
    for _ in range(64):
        for request_id, events in llm.engine.step().items():
            if any(isinstance(event, TokenEvent) for event in events):
                waiting.discard(request_id)
        if not waiting:
            break


def timed_steps(llm: LLM, steps: int) -> dict[str, float]:
    """Median step, forward and rest times (ms) over ``steps`` decode steps."""
    runner = llm.engine.runner
    inner = runner.execute
    spent: list[float] = []

    def execute(plan: Any) -> Any:
        t = time.perf_counter()
        out = inner(plan)
        spent.append(time.perf_counter() - t)
        return out

    runner.execute = execute  # type: ignore[method-assign]
    totals = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            llm.engine.step()
            totals.append(time.perf_counter() - t)
    finally:
        del runner.execute
    step_ms = statistics.median(totals) * 1e3
    forward_ms = statistics.median(spent) * 1e3
    return {"step_ms": step_ms, "execute_ms": forward_ms, "rest_ms": step_ms - forward_ms}


def labelled(name: str, fn: Any) -> Any:
    def call(*args: Any) -> Any:
        with record_function(name):
            return fn(*args)

    return call


def profiled_steps(llm: LLM, steps: int, top: int = 0) -> dict[str, float]:
    """Milliseconds per step by op category, plus what no op accounts for."""
    # op_set and attention look these names up at each call, so patching them labels every
    # decode call (prompt chunks, which prompt_linear multiplies, are not in these steps)
    block_linear, decode = vars(op_set)["block_linear"], cpu_attention.decode
    vars(op_set)["block_linear"] = labelled("kvpark::block_linear", block_linear)
    cpu_attention.decode = labelled("kvpark::decode_attention", decode)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                llm.engine.step()
            wall = time.perf_counter() - t
    finally:
        vars(op_set)["block_linear"], cpu_attention.decode = block_linear, decode
    by_cat: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        by_cat[category(event.key)] += event.self_cpu_time_total / 1e3  # µs -> ms
    per_step = {name: ms / steps for name, ms in by_cat.items()}
    per_step["python+dispatch"] = wall * 1e3 / steps - sum(per_step.values())
    per_step["profiled_step_ms"] = wall * 1e3 / steps
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return per_step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", default="1,8,16")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="auto", help="auto, dense or blocks")
    p.add_argument("--kv-dtype", default="auto", help="the KV pool's cells: auto, f32, bf16, f16")
    p.add_argument("--exact", action="store_true", help="exact mode's row-invariant ops")
    p.add_argument("--block-dot", default="auto", help="auto, int8 or float32 (--block-dot)")
    p.add_argument("--top", type=int, default=0, help="also print each batch's top N ops")
    p.add_argument("--runner", default="auto", help="auto, lean or torch (the profiler pass)")
    args = p.parse_args()
    llm = LLM(
        runner=None if args.runner == "auto" else args.runner,
        model=args.model,
        threads=args.threads,
        dtype=args.dtype,
        weights=args.weights,
        kv_dtype=args.kv_dtype,
        exact=args.exact,
        block_dot=args.block_dot,
    )
    # loading's objects (torch's among them, imported here for the profiler pass) out of the
    # collector's reach, as `kvpark serve` freezes its own once the engine is ready
    # (server/process_memory.py): collections walking them had been 2-4 % of a lean eight-chat
    # step's samples here, and noise between runs, where the server has none of it
    gc.collect()
    gc.freeze()
    kind = getattr(llm.engine.runner, "runner_kind", "custom")  # the built-in runners name it
    print(
        f"runner {kind}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{gc.get_freeze_count()} objects frozen",
        flush=True,
    )
    for batch in (int(b) for b in args.batch.split(",")):
        max_tokens = 2 * args.steps + 4
        start_batch(llm, batch, args.prompt_tokens, max_tokens, f"b{batch}")
        timing = timed_steps(llm, args.steps)
        cats = profiled_steps(llm, args.steps, args.top) if kind == "torch" else {}
        while llm.engine.has_work:  # bounded: every request has at most max_tokens left
            llm.engine.step()
        tok_s = batch / timing["step_ms"] * 1e3
        print(
            f"batch {batch:>3}: step {timing['step_ms']:.1f} ms ({tok_s:.0f} tok/s), execute "
            f"{timing['execute_ms']:.1f} ms, rest of step {timing['rest_ms']:.1f} ms",
            flush=True,
        )
        if not cats:
            continue
        step = cats.pop("profiled_step_ms")
        shares = ", ".join(f"{k} {v:.1f} ms ({v / step:.0%})" for k, v in sorted(cats.items()))
        print(f"           under the profiler {step:.1f} ms/step: {shares}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
