"""Frozen configuration, one dataclass per layer; each layer receives only its own.

``EngineConfig`` bundles the layers below the server. The command line (``cli/main.py``) fills these
from flags and ``KVPARK_<NAME>`` environment variables; the Python API takes the same names as
keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# Every spelling --dtype (and ModelConfig.dtype) takes, to its canonical name: the one table of
# dtype names (the runner maps a canonical name to torch's dtype of the same name)
DTYPE_NAMES = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
PreemptPolicy = Literal["fcfs", "cost"]
"""The preemption planner's victim choices, the one table of their names on the Python side (the
Rust planner parses the same ones): ``fcfs`` parks the newest running request and resumes the
oldest parked first; ``cost`` parks the one whose pages cover the shortfall with the fewest
cells."""
PREEMPT_POLICIES: tuple[PreemptPolicy, ...] = get_args(PreemptPolicy)
DEFAULT_PREEMPT_POLICY: PreemptPolicy = "fcfs"
DEFAULT_KV_CELLS = 16384
DEFAULT_PAGE_SIZE = 16
DEFAULT_PARALLEL = 16
DEFAULT_MAX_BATCH_TOKENS = 512


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # GGUF file or Hugging Face directory; None: the default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, f32 on CPU)
    device: str = "auto"  # auto | cpu | cuda
    # CPU threads for torch and block matmuls; 0: every CPU the process may run on (≤ 2 in exact)
    threads: int = 0
    # blocks: GGUF Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS matrices kept in
    # blocks and multiplied by block_linear (CPU, float32); dense: every weight dequantised; auto:
    # blocks on CPU in float32
    weights: str = "auto"
    # prompt chunks on the CPU: auto (a dense GEMM where it wins, cpu_paths.py) | same (as decode
    # rows) | float32 | bfloat16 (a dense GEMM in that dtype); exact mode: always as decode rows
    prompt_path: str = "auto"
    # block products on the CPU: auto (float32, cpu_paths.py) | int8 | float32
    block_dot: str = "auto"
    # the KV pool's cells on the CPU: auto (bfloat16, cpu_paths.py) | float32 | bfloat16 | float16,
    # or f32 | bf16 | f16 (cpu_paths.KV_DTYPE_NAMES)
    kv_dtype: str = "auto"
    exact: bool = False  # row-invariant ops: outputs bit-identical whatever runs beside
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (CUDA, Triton ops only)
    # auto | lean (the CPU decoder, no torch) | native (the decoder over the torch model) | torch,
    # or "module:factory" of a custom runner, called with the EngineConfig
    # (docs/custom-runners.md); None: auto
    runner: str | None = None
    # replaces the model's chat template: the template's text (--chat-template FILE reads it)
    chat_template: str | None = None
    # ranks the torch model is sharded over (heads, MLP and vocabulary; runner/tp_runner.py)
    tensor_parallel: int = 1


@dataclass(frozen=True)
class PoolConfig:
    kv_cells: int = DEFAULT_KV_CELLS
    page_size: int = DEFAULT_PAGE_SIZE
    # full pages stay cached after their last holder and a new prompt starts from the longest
    # cached prefix (--prefix-cache, docs/preemption.md)
    prefix_cache: bool = True
    # a model whose every layer slides gives back each sequence's pages behind the window, one
    # mixing sliding and global layers keeps the sliding ones' in a window space
    # (--window-release, docs/models.md)
    window_release: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    parallel: int = DEFAULT_PARALLEL  # slots: requests that may hold cells at once
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS  # rows per step, prompt chunks included
    max_model_len: int = 0  # 0: min(model context, kv_cells); the context under window release
    max_waiting: int = 1024  # requests queued beyond the slots before new ones get 503
    preempt_ram_mib: int = 2048  # -1: no limit; 0: every park recomputes
    preempt: bool = True
    preempt_policy: PreemptPolicy = DEFAULT_PREEMPT_POLICY
    preempt_async: bool = True


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0  # base seed for requests that give none

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from flat keyword options (``kv_cells=2048, dtype="float32"``), as ``kvpark.LLM``
        does.
        """
        parts: dict[str, dict[str, object]] = {"model": {}, "pool": {}, "scheduler": {}}
        layer_fields = {
            "model": ModelConfig.__dataclass_fields__,
            "pool": PoolConfig.__dataclass_fields__,
            "scheduler": SchedulerConfig.__dataclass_fields__,
        }
        seed = 0
        for key, value in options.items():
            if key == "seed":
                seed = int(value)  # type: ignore[call-overload]
                continue
            for layer, names in layer_fields.items():
                if key in names:
                    parts[layer][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(
            model=ModelConfig(**parts["model"]),  # type: ignore[arg-type]
            pool=PoolConfig(**parts["pool"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**parts["scheduler"]),  # type: ignore[arg-type]
            seed=seed,
        )


HTTP_STACKS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # any one of them lets a request in; none: no check
    cache_salt_by_key: bool = False  # fold the request's API key into its cache salt
    sse_ping_interval: float = 30.0
    log_format: str = "text"  # text | json
    log_health: bool = False  # access-log /health and /metrics too (they poll; noise by default)
    http_stack: str = "auto"  # auto | uvloop (uvloop + httptools) | asyncio (asyncio + h11)
    log_stats_interval: float = 10.0  # seconds between stats lines while requests run; 0: off
    max_body_bytes: int = 8 * 1024 * 1024
    served_model_name: str | None = None
    # seconds the engine thread may spend in one turn of its loop before the server declares it
    # wedged and exits; 0: never
    engine_timeout: float = 60.0
    shutdown_timeout: float = 30.0  # on SIGTERM / SIGINT: how long running requests may finish
    # a stream whose one write has waited this long (its client reads nothing) is aborted; 0: never
    stall_timeout: float = 30.0
    # events a stream holds for a client that is not reading; past it the stream is aborted; 0: any
    stream_buffer: int = 1024
    # a stream whose client disconnects is kept this long for GET /v1/streams/{id}; 0: off
    reattach_seconds: float = 0.0
    # /v1/responses kept in memory (store): at most this many (0: none), this many MiB, this long
    # after they finished (0: no time limit)
    response_store: int = 1024
    response_store_mib: int = 256
    response_store_ttl: float = 3600.0
    send_buffer: int = 65536  # SO_SNDBUF of every connection (0: the kernel's, growing to 4 MiB)
    web: bool = True  # the chat page at / and the pool view at /pool (--no-web: neither)
