"""``kvpark serve | generate | bench`` (also ``python -m kvpark``).

Every flag of ``serve`` (and the engine flags of ``generate``) can also come from ``KVPARK_<NAME>``
(``--kv-cells`` -> ``KVPARK_KV_CELLS``); the command line wins. A bad flag or variable exits with
status 2 and says what is wrong, before anything is loaded. The flags themselves are in
``flags.py`` (the engine's), ``server_flags.py`` and ``model_flags.py`` (their values:
``values.py``). ``kvpark serve MODEL`` is ``kvpark serve --model MODEL``; ``kvpark --version``
prints the installed version.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpark.cli.flags import add_engine_flags, engine_config
from kvpark.cli.model_flags import add_chat_template_flag, add_model_positional
from kvpark.cli.server_flags import add_server_flags, server_config
from kvpark.cli.values import HelpFormatter, apply_env, int_at_least
from kvpark.config import env
from kvpark.config.layers import EngineConfig
from kvpark.runner.tp_checks import torchrun_world


def package_version() -> str:
    """The installed distribution's version; the package's own when it runs from a source tree."""
    try:
        return importlib.metadata.version("kvpark")
    except importlib.metadata.PackageNotFoundError:
        import kvpark

        return getattr(kvpark, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpark",
        description="kvpark: an LLM server that parks requests instead of dropping them.",
    )
    parser.add_argument("--version", action="version", version=f"kvpark {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,bench}")
    sub.required = True
    serve = sub.add_parser(
        "serve",
        help="the OpenAI-compatible HTTP server",
        description="Serve a model over HTTP; every flag also as KVPARK_<NAME>.",
        epilog="Each flag --some-flag can also be set as KVPARK_SOME_FLAG (switches: 1/0);\n"
        "the command line wins. Endpoints, metrics and errors: docs/server.md.",
        formatter_class=HelpFormatter,
    )
    add_model_positional(serve)
    add_engine_flags(serve)
    add_server_flags(serve)
    add_chat_template_flag(serve)
    gen = sub.add_parser(
        "generate",
        help="offline generation from the command line",
        description="Generate for prompts given as arguments or in a file.",
        formatter_class=HelpFormatter,
    )
    gen.add_argument("prompts", nargs="*", help="prompts (or use --file)")
    gen.add_argument(
        "--file", help="one prompt per line ('-': stdin); .jsonl: objects with 'prompt'"
    )
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument(
        "--max-tokens", type=int_at_least(1), default=64, help="tokens to generate per choice"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: off)")
    gen.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens under min-p x the likeliest"
    )
    gen.add_argument("--request-seed", type=int, default=None, help="seed of every request")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--n", type=int_at_least(1), default=1, help="choices per prompt")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_flags(gen)
    sub.add_parser("bench", help="the load generator (kvpark bench --help)", add_help=False)
    engine_only = argparse.ArgumentParser(add_help=False)
    add_engine_flags(engine_only)
    apply_env(serve, os.environ)
    apply_env(gen, os.environ, {a.dest for a in engine_only._actions})
    serve.set_defaults(parser=serve)
    gen.set_defaults(parser=gen)
    return parser


def read_prompts(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    prompts = list(args.prompts)
    if args.file is not None:
        try:
            text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        except OSError as exc:
            p.error(f"--file {args.file}: {exc.strerror}")
        lines = [line for line in text.splitlines() if line.strip()]
        if args.file.endswith(".jsonl"):
            try:
                prompts += [str(json.loads(line)["prompt"]) for line in lines]
            except (ValueError, KeyError, TypeError) as exc:
                p.error(f"--file {args.file}: each line must be an object with 'prompt' ({exc})")
        else:
            prompts += lines
    if not prompts:
        p.error("no prompts: give them as arguments or with --file")
    return prompts


def run_generate(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    from kvpark import LLM, SamplingParams
    from kvpark.sampling.params import InvalidParameterError

    config = engine_config(args, p)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.request_seed,
        stop=tuple(args.stop),
        n=args.n,
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate(1 << 30)  # token ids are checked by the engine
    except InvalidParameterError as exc:
        p.error(f"--{exc.param.replace('_', '-')}: {exc}")
    prompts = read_prompts(args, p)
    make_llm: Callable[..., LLM] = LLM
    llm = make_llm(**_flat_options(config))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": q}] for q in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    failed = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        texts = [c.text for c in out.choices]
        failed += out.error is not None
        if args.json:
            print(
                json.dumps(
                    {"prompt": prompt, "texts": texts, "error": out.error}, ensure_ascii=False
                )
            )
        elif out.error is not None:
            print(f"error: {out.error}", file=sys.stderr)
        else:
            print("\n---\n".join(texts))
    return 1 if failed else 0


def _flat_options(config: EngineConfig) -> dict[str, object]:
    options: dict[str, object] = {"seed": config.seed}
    for layer in (config.model, config.pool, config.scheduler):
        options.update(vars(layer))
    return options


def check_torchrun_rank(
    args: argparse.Namespace, p: argparse.ArgumentParser, rank: int, world: int
) -> None:
    """Every rank under torchrun: ``--tensor-parallel`` is the world's size, and the flags pass
    rank 0's checks (exit 2 on every rank, none left waiting for the others to join)."""
    if getattr(args, "tensor_parallel", 1) != world:
        p.error(f"rank {rank} of {world} processes under torchrun needs --tensor-parallel {world}")
    engine_config(args, p)


def run_tp_worker(args: argparse.Namespace) -> int:
    """A rank other than 0 under torchrun: the worker loop (runner/tp_worker.py); the model and
    every setting come from rank 0."""
    os.environ["KVPARK_TP_DEVICE"] = args.device  # the backend must be rank 0's
    from kvpark.runner.tp_worker import main as worker_main

    return worker_main()


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["bench"]:
        from kvpark import bench

        return int(bench.main(args_list[1:]))
    parser = build_parser()
    args = parser.parse_args(args_list)
    sub: argparse.ArgumentParser = args.parser
    launched = torchrun_world()
    if launched is not None:  # torchrun: rank 0 serves, the others work
        check_torchrun_rank(args, sub, *launched)
        if launched[0] != 0:
            return run_tp_worker(args)
    if args.command == "serve":
        from kvpark.server.run import http_stack, serve

        served = server_config(args, sub)
        try:
            http_stack(served.http_stack)  # a missing package is a usage error, before loading
            env.Knobs.from_env()  # so is a knob's bad value
        except ValueError as exc:
            sub.error(str(exc))
        return serve(engine_config(args, sub), served)
    return run_generate(args, sub)
