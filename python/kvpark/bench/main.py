"""``kvpark bench``: a bounded, seeded load generator for any OpenAI-compatible server, and the
one entry point of every published benchmark (docs/benchmarks.md, "How to reproduce").

    kvpark bench --url http://127.0.0.1:8000 --concurrency 1,4,8,16 --max-tokens 128
    kvpark bench --url http://127.0.0.1:8001 --label peer --url http://127.0.0.1:8000 --label kvpark
    kvpark bench --scenario pressure --url http://127.0.0.1:8000 --label default
    kvpark bench --scenario cpu-comparison --peer llama-server --out bench-results
    kvpark bench build-llama-server --jobs 2
    kvpark bench make-quant-files

With ``--url`` (or a scenario that has no suite, such as ``sweep``) it drives the given servers:
prints a table per server, writes ``<out>/<name>.json`` and ``<out>/<name>.png``; with several
``--url`` it runs them one after another and adds ratios against ``--baseline`` (default: the
first). Exits 0 when every request succeeded, 1 when some failed, 2 on bad flags. A suite's
scenario without ``--url`` hands the whole command line to the suite (``suites/``), which starts
its own servers; ``build-llama-server`` builds the llama.cpp peer and its quantize tool
(``llama_build.py``), ``make-quant-files`` the default model in each quant type
(``quant_files.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvpark.bench.client import Target
from kvpark.bench.compare import format_comparison, payload, run
from kvpark.bench.options import BenchOptions
from kvpark.bench.pressure import format_pressure_table
from kvpark.bench.pressure_goals import evaluate_goals, format_goals, write_pressure_plot
from kvpark.bench.report import RunResult, format_table, write_json, write_plot
from kvpark.bench.scenarios import SCENARIO_DEFAULTS, SCENARIOS
from kvpark.bench.suites import SERVER_SCENARIOS, SUITES

BUILD_PEER = "build-llama-server"
MAKE_QUANT_FILES = "make-quant-files"  # the per-type GGUFs of --scenario quant-types


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpark bench",
        description="Drive OpenAI-compatible servers with a seeded workload; write JSON + PNG.",
    )
    p.add_argument(
        "--url",
        action="append",
        help="server base URL; repeat to compare servers (default http://127.0.0.1:8000)",
    )
    p.add_argument("--label", action="append", help="name of each --url in tables and plots")
    p.add_argument(
        "--model",
        action="append",
        help="model name to send, once or once per --url (default: first of /v1/models)",
    )
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' to every server")
    p.add_argument(
        "--scenario",
        default="sweep",
        choices=sorted(set(SCENARIOS) | set(SUITES)),
        help="what to run; a published benchmark's name without --url starts its own servers "
        "(kvpark bench --scenario NAME --help for its flags)",
    )
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=None,
        help="comma-separated concurrent chats per level (default 1,4,8,16; pressure: 4,8)",
    )
    p.add_argument(
        "--requests-per-level",
        type=int,
        help="requests per level (default 2 × concurrency, within 4..64)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, help="approximate prompt length (default 64; pressure: 350)"
    )
    p.add_argument(
        "--max-tokens", type=int, help="fixed output length (default 128; pressure: 300)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", type=int, default=6, help="multiturn: turns per conversation")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=1, help="uncounted short requests first")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--arrival", choices=("closed", "poisson"), default="closed")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s for --arrival poisson")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (sent by default: outputs have the fixed length)",
    )
    p.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        help="JSON object merged into every request body",
    )
    p.add_argument("--baseline", help="label the ratios are taken against (default: the first)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for JSON+PNG")
    p.add_argument("--name", help="file name stem (default: scenario and labels)")
    return p


def targets_from(args: argparse.Namespace) -> list[Target]:
    urls: list[str] = args.url or ["http://127.0.0.1:8000"]
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--url must be an http(s) URL: {url!r}")
    labels: list[str] = args.label or [urlparse(url).netloc for url in urls]
    if len(labels) != len(urls):
        raise ValueError("give one --label per --url")
    if len(set(labels)) != len(labels):
        raise ValueError("labels must differ")
    models: list[str | None] = list(args.model or [None])
    if len(models) == 1:
        models = models * len(urls)
    if len(models) != len(urls):
        raise ValueError("give --model once, or once per --url")
    return [Target(u, lb, m, args.api_key) for u, lb, m in zip(urls, labels, models, strict=True)]


def options_from(args: argparse.Namespace) -> BenchOptions:
    defaults = SCENARIO_DEFAULTS.get(args.scenario, SCENARIO_DEFAULTS["sweep"])

    def given(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    return BenchOptions(
        concurrency=given("concurrency"),
        requests_per_level=args.requests_per_level,
        prompt_tokens=given("prompt_tokens"),
        max_tokens=given("max_tokens"),
        seed=args.seed,
        timeout_s=args.timeout,
        warmup=args.warmup,
        arrival=args.arrival,
        rate=args.rate,
        endpoint=args.endpoint,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        turns=args.turns,
    )


def write_outputs(out: Path, name: str, runs: list[RunResult], baseline: str | None) -> list[Path]:
    """``<out>/<name>.json`` (every run, the comparison) and ``<out>/<name>.png``."""
    title = f"kvpark bench {runs[0].scenario}: " + " vs ".join(run.label for run in runs)
    if runs[0].scenario == "pressure":
        doc = payload(runs, baseline, {"goals": evaluate_goals(runs)})
        plot = write_pressure_plot(out / f"{name}.png", runs, None, title)
    else:
        doc = payload(runs, baseline)
        plot = write_plot(out / f"{name}.png", runs, title)
    return [write_json(out / f"{name}.json", doc)] + ([plot] if plot is not None else [])


def suite_of(argv: list[str]) -> str | None:
    """The suite ``argv`` asks for: its scenario when that is a suite and no ``--url`` is given
    (``pressure`` and ``multiturn`` with ``--url`` stay load-generator scenarios)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--scenario")
    pre.add_argument("--url", action="append")
    known, _ = pre.parse_known_args(argv)
    if known.scenario not in SUITES:
        return None
    if known.url and known.scenario in SERVER_SCENARIOS:
        return None
    return str(known.scenario)


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == [BUILD_PEER]:
        from kvpark.bench import llama_build

        return llama_build.main(args_list[1:])
    if args_list[:1] == [MAKE_QUANT_FILES]:
        from kvpark.bench import quant_files

        return quant_files.main(args_list[1:])
    suite = suite_of(args_list)
    if suite is not None:
        return SUITES[suite](args_list)
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.scenario not in SCENARIOS:
        parser.error(f"--scenario {args.scenario} starts its own servers: drop --url")
    try:
        targets = targets_from(args)
        options = options_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.baseline is not None and args.baseline not in {t.label for t in targets}:
        parser.error(f"--baseline {args.baseline!r} names no --label")
    try:
        runs = run(targets, args.scenario, options)
    except Exception as exc:  # a server that is down or lists no model: say so, exit 1
        print(f"kvpark bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    doc = payload(runs, args.baseline)
    if "comparison" in doc:
        print(format_table(runs))
        print(format_comparison(doc["comparison"]))
    if args.scenario == "pressure":
        print(format_pressure_table(runs))
        print(format_goals(evaluate_goals(runs)))
    stem = args.name or "-".join([args.scenario, *(re.sub(r"\W+", "_", t.label) for t in targets)])
    for path in write_outputs(args.out, stem, runs, args.baseline):
        print(f"wrote {path}")
    failed = sum(run.errors for run in runs)
    if failed:
        print(f"kvpark bench: {failed} request(s) failed; see the JSON", file=sys.stderr)
    return 1 if failed else 0
