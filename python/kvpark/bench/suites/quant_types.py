"""``kvpark bench --scenario quant-types``: kvpark against llama.cpp's llama-server on each quant
type of the default model, every figure of a type from one run (docs/benchmarks.md, *Per quant
type*).

For each type's file (``kvpark bench make-quant-files`` makes them, from the Q4_1 weights) it starts
llama-server, then kvpark, one at a time on 127.0.0.1 with the same file, threads, slots and KV
capacity (``measured.py``, as ``cpu-comparison`` does), and against each: the seeded decode sweep
at 1 and 8 chats (aggregate tok/s, each request's decode tok/s), then the prefill measure, a
one-token answer to each of ``--prefill-repeats`` prompts of ~``--prefill-tokens`` random words on
``/v1/completions`` (no chat template, so no two prompts share a prefix that a prefix cache could
supply; the median of prompt tokens / TTFT), while the server's process tree's peak resident memory
is sampled over both. ``--rounds N`` measures both servers N times per type, alternating which
goes first, and takes each rate's median (the largest peak): the shared VM's speed drifts by up to
2x within minutes, so one round decides no ratio near its target. Writes ``<out>/<name>.json``
(every run, each round's figures, ratio and verdict, the CPU, the llama.cpp build, the files'
record, the commands) and ``<out>/<name>.md`` (the docs table); server logs go to
``<out>/logs/<type>-<server>-<round>.log``. ``--peer none`` measures kvpark alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from kvpark.bench.client import RequestBody, RequestResult, Target, run_level
from kvpark.bench.compare import compare, payload, resolve_model, run
from kvpark.bench.machine import kvpark_source, load_average, machine
from kvpark.bench.options import BenchOptions
from kvpark.bench.peers import DEFAULT_PEER_PYTHON, llama_server_version
from kvpark.bench.quant_files import RECORD, TYPES, default_dir, parse_types, quant_path
from kvpark.bench.quant_table import (
    BASELINE,
    OURS,
    Figures,
    TypeRow,
    figures,
    format_verdicts,
    judge,
    markdown_rows,
    median_figures,
    prefill_summary,
)
from kvpark.bench.report import write_json
from kvpark.bench.suites.arguments import (
    add_peer_flags,
    checked_options,
    llama_server_binary,
    model_of,
    parse_peers,
    suite_parser,
)
from kvpark.bench.suites.measured import available, commands, measured_server
from kvpark.bench.workload import RequestSpec, word_text

SCENARIO = "quant-types"


def build_parser() -> argparse.ArgumentParser:
    p = suite_parser(SCENARIO, "kvpark against llama-server on each quant type.", SCENARIO)
    add_peer_flags(p, BASELINE)
    files_help = "the <TYPE>.gguf files (default: make-quant-files' folder for --model)"
    p.add_argument("--files", type=Path, default=None, metavar="DIR", help=files_help)
    p.add_argument("--types", default="all", help=f"comma-separated, of {', '.join(TYPES)}")
    p.add_argument("--parallel", type=int, default=8, help="slots (llama-server -np)")
    p.add_argument("--kv-cells", type=int, default=4096, help="KV capacity (llama-server -c)")
    p.add_argument("--kvpark-arg", action="append", default=[], help="extra kvpark serve flag")
    p.add_argument("--llama-server-arg", action="append", default=[], help="extra flag")
    p.add_argument("--llama-server-poll", type=int, default=0, help="its --poll (default 50)")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--concurrency", default="1,8", help="decode levels; targets at the top one")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64, help="the decode sweep's prompts")
    p.add_argument("--requests-per-level", type=int, default=None)
    # 448 words (~450 tokens) fit llama-server's per-slot context of 4096 / 8 = 512 cells
    p.add_argument("--prefill-tokens", type=int, default=448, help="prefill prompt, in words")
    p.add_argument("--prefill-repeats", type=int, default=5, help="prefill prompts (median)")
    p.add_argument("--rounds", type=int, default=1, help="both servers this many times per type, "
                   "alternating which goes first; each rate the median of its rounds")  # fmt: skip
    return p


def prefill_specs(seed: int, words: int, repeats: int) -> list[RequestSpec]:
    """The prefill prompts: random words only, one token out each."""
    return [RequestSpec(i, word_text(seed, i, words, "prefill"), 1, 0.0) for i in range(repeats)]


def prefill(target: Target, specs: list[RequestSpec], timeout_s: float) -> list[RequestResult]:
    """The prefill prompts one at a time (each alone on the CPU) on ``/v1/completions``."""

    async def go() -> list[RequestResult]:
        resolved = await resolve_model(target)
        assert resolved.model is not None
        body = RequestBody(model=resolved.model, endpoint="completions")
        _, results = await run_level(resolved, body, specs, 1, timeout_s)
        return results

    return asyncio.run(go())


def round_order(labels: list[str], r: int) -> list[str]:
    """The servers of round ``r``: as given in even rounds, reversed in odd ones, so that a drift
    of the machine's speed over a type's rounds weighs on both alike."""
    return labels if r % 2 == 0 else labels[::-1]


def measure_type(
    qtype: str, path: Path, names: list[str], options: BenchOptions, args: argparse.Namespace
) -> dict[str, Any]:
    """Every server on one file, one at a time, ``--rounds`` times: runs, prefill summaries,
    peaks, each round's figures, the row (each rate's median over the rounds)."""
    planned = commands(args, names, str(path))
    url = f"http://127.0.0.1:{args.port}"
    specs = prefill_specs(args.seed, args.prefill_tokens, args.prefill_repeats)
    top = max(options.concurrency)
    runs: list[Any] = []
    rounds: list[dict[str, Any]] = []
    per_label: dict[str, list[Figures]] = {label: [] for label in planned}
    props: dict[str, Any] = {}
    for r in range(args.rounds):
        this_round: dict[str, Any] = {}
        for label in round_order(list(planned), r):
            cmd, ready = planned[label]
            print(f"== {qtype} {label} (round {r + 1} of {args.rounds}): {' '.join(cmd)}",
                  flush=True)  # fmt: skip
            log = args.out / "logs" / f"{qtype}-{label}-{r + 1}.log"
            with measured_server(cmd, url, ready, log) as measured:
                (result,) = run([Target(url, label)], "sweep", options)
                summary = prefill_summary(prefill(Target(url, label), specs, 600.0))
            assert measured.peak is not None
            result.extra["peak_memory"] = measured.peak.to_json()
            result.extra["round"] = r + 1
            props[label] = measured.props
            found = figures(result, summary, measured.peak_mib, top)
            per_label[label].append(found)
            this_round[label] = {"figures": found.__dict__, "prefill": summary,
                                 "load_average_1m": measured.load}  # fmt: skip
            runs.append(result)
        rounds.append(this_round)
    mine = {label: median_figures(found) for label, found in per_label.items()}
    cpu = props.get(OURS, {}).get("cpu")
    row = TypeRow(
        qtype=qtype,
        file_mib=path.stat().st_size / 2**20,
        runner=cpu.get("runner") if isinstance(cpu, dict) else None,
        ours=mine[OURS],
        base=mine.get(BASELINE),
        verdicts=judge(mine[OURS], mine.get(BASELINE), top),
    )
    first = [run for run in runs if run.extra["round"] == 1]
    return {
        "row": row,
        "file": str(path),
        "runs": [run.to_json() for run in runs],
        "rounds": rounds,
        "comparison": compare(first, BASELINE) if BASELINE in mine else None,
        "props": props,
        "commands": {label: cmd for label, (cmd, _) in planned.items()},
    }


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The peers asked for (llama-server or none), or exit 2 through ``p.error``."""
    try:
        peers = parse_peers(args.peer or BASELINE)
    except ValueError as exc:
        p.error(str(exc))
    if set(peers) - {BASELINE}:
        p.error(f"--scenario {SCENARIO} measures against {BASELINE} only (or --peer none)")
    slot = args.kv_cells // max(1, args.parallel)  # llama-server's context per slot
    if not 1 <= args.prefill_tokens <= 0.9 * slot:  # words are ~1 token each; keep a margin
        p.error(f"--prefill-tokens must be within 1..{int(0.9 * slot)}: llama-server gives each "
                f"of its {args.parallel} slots {slot} cells (--kv-cells / --parallel)")  # fmt: skip
    if not 1 <= args.prefill_repeats <= 64:
        p.error("--prefill-repeats must be within 1..64")
    if not 1 <= args.rounds <= 9:
        p.error("--rounds must be within 1..9")
    return peers


def main(argv: list[str]) -> int:
    started, load_at_start = time.monotonic(), load_average()
    p = build_parser()
    args = p.parse_args(argv)
    peers = check(p, args)
    try:
        types = parse_types(args.types)
    except ValueError as exc:
        p.error(str(exc))
    args.llama_server = llama_server_binary(args) if peers else args.llama_server
    args.peer_python = DEFAULT_PEER_PYTHON  # never started: commands() reads it for that peer
    found = available(args.llama_server or Path(), args.peer_python, [*peers, OURS], asked=True)
    if isinstance(found, int):
        return found
    args.model = model_of(args)
    folder = (args.files or default_dir(Path(args.model).resolve())).expanduser().resolve()
    missing = [t for t in types if not quant_path(folder, t).is_file()]
    if missing:
        print(f"no {', '.join(missing)} under {folder}: run `kvpark bench make-quant-files "
              f"--types {','.join(missing)}` (or give --files DIR)")  # fmt: skip
        return 2
    options = checked_options(p, lambda: BenchOptions(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        requests_per_level=args.requests_per_level, prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens, seed=args.seed, timeout_s=600.0,
    ))  # fmt: skip
    measured = {t: measure_type(t, quant_path(folder, t), found, options, args) for t in types}
    rows = [m.pop("row") for m in measured.values()]
    top = max(options.concurrency)
    markdown = markdown_rows(rows, top, args.prefill_tokens)
    record = folder / RECORD
    meta: dict[str, Any] = {
        "machine": machine(),
        "shared_machine": "other engineers' jobs may run on these cores; see load_average_*",
        "load_average_start": load_at_start,
        "source_model": args.model,
        "files": str(folder),
        "files_record": json.loads(record.read_text()) if record.is_file() else None,
        "files_note": "requantised from the Q4_1 file's weights: speed and memory are the "
        "format's, the weights carry Q4_1's error",
        "kvpark": kvpark_source(),
        "kv_cells": args.kv_cells, "parallel": args.parallel, "threads": args.threads,
        "prefill": {"words": args.prefill_tokens, "repeats": args.prefill_repeats,
                    "endpoint": "/v1/completions", "max_tokens": 1},
        "rounds": args.rounds,
        "options": options.to_json(),
    }  # fmt: skip
    if peers:
        meta["llama_server"] = llama_server_version(str(args.llama_server))
    meta["markdown"] = markdown
    meta["seconds"] = round(time.monotonic() - started, 1)
    doc = payload([], None, {"meta": meta, "rows": [r.to_json() for r in rows], "types": measured})
    del doc["runs"]  # each type's runs are under types.<TYPE>.runs
    write_json(args.out / f"{args.name}.json", doc)
    (args.out / f"{args.name}.md").write_text("\n".join(markdown) + "\n")
    print(format_verdicts(rows))
    print("\n".join(markdown))
    print(f"wrote {args.out / args.name}.json and .md")
    return 0
