"""Owns the model and the KV tensors, and runs one step: plan in, logits of the sampled rows out.

KV layout per layer: ``[n_pages, page_size, kv_heads, head_dim]`` for K and for V (see
``model/ops/kv_cache.py``); a page id from the Rust pool indexes the first dimension directly.
"""

from __future__ import annotations

import logging
import time

import torch

from kvpark.config.cpus import usable_cpus
from kvpark.config.layers import DTYPE_NAMES, ModelConfig, PoolConfig
from kvpark.model.loader import LoadedModel, load_model
from kvpark.model.ops import OpSet, block_weights
from kvpark.model.ops.kv_cache import KVCache
from kvpark.runner.batch import build_step_tensors
from kvpark.runner.cpu_paths import (
    EXACT_CPU_THREADS,
    CpuPaths,
    cpu_features,
    exact_cpu_threads,
    resolve_cpu_paths,
)
from kvpark.runner.cpu_paths import choose as choose_cpu_paths
from kvpark.runner.cuda_graphs import DecodeGraphs, graphs_wanted
from kvpark.runner.embedding import embed_tokens
from kvpark.sched.plan import StepPlan
from kvpark.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvpark.runner.torch_runner")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_dtype(name: str) -> torch.dtype:
    """A canonical dtype name (config.layers.DTYPE_NAMES' values) as torch's dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``--dtype``; ``auto`` is bfloat16 on CUDA and float32 on the CPU (cpu_paths.py says why)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return torch_dtype(DTYPE_NAMES[name])


def resolve_weights(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether to keep a GGUF's block-quantised matrices as blocks (``--weights``); on the CPU
    ``auto`` is cpu_paths.choose's answer (blocks, except where the CPU lacks AVX2)."""
    fits = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        return fits and choose_cpu_paths(cpu_features()).blocks
    if name == "blocks" and not fits:
        raise ValueError(
            f"--weights blocks runs on the CPU in float32, not {str(dtype).removeprefix('torch.')}"
            f" on {device.type}"
        )
    if name not in ("blocks", "dense"):
        raise ValueError(f"unknown weights {name!r}; use auto, dense or blocks")
    return name == "blocks"


__all__ = ["EXACT_CPU_THREADS", "TorchRunner", "exact_cpu_threads", "resolve_cpu_paths"]


def select_ops(exact: bool, device: torch.device) -> OpSet:
    """CPU: the torch ops, or their row-invariant versions. CUDA: the Triton kernels, with cuBLAS
    matmuls in normal mode and the batch-invariant Triton matmul in exact mode."""
    if device.type == "cpu":
        return OpSet.exact() if exact else OpSet.default()
    if device.type != "cuda":
        if exact:
            raise ValueError(f"exact mode runs on cpu or cuda, not {device.type}")
        return OpSet.default()
    from kvpark.model.ops.triton_ops import cuda_ops, triton_ops

    return triton_ops() if exact else cuda_ops()


class TorchRunner:
    """The built-in ``kvpark.Runner``: kvpark's paged Llama-family model in torch, with the Triton
    kernels on CUDA and the row-invariant ops in exact mode."""

    def __init__(self, model_config: ModelConfig, pool_config: PoolConfig) -> None:
        self.device = resolve_device(model_config.device)
        self.ops = select_ops(model_config.exact, self.device)
        self.cpu_paths: CpuPaths | None = None
        if self.device.type == "cpu":
            self.cpu_paths = resolve_cpu_paths(model_config)
            self.dtype = torch_dtype(self.cpu_paths.dtype)
            blocks = self.cpu_paths.blocks
            log.info("%s", self.cpu_paths.summary())
        else:
            if model_config.prompt_path not in ("auto", "same"):
                raise ValueError(f"--prompt-path {model_config.prompt_path} is for the CPU")
            if model_config.kv_dtype != "auto":
                raise ValueError(f"--kv-dtype {model_config.kv_dtype} is for the CPU")
            if model_config.block_dot != "auto":
                raise ValueError(f"--block-dot {model_config.block_dot} is for the CPU")
            self.dtype = resolve_dtype(model_config.dtype, self.device)
            blocks = resolve_weights(model_config.weights, self.device, self.dtype)
        self.kv_dtype = (
            self.dtype if self.cpu_paths is None else torch_dtype(self.cpu_paths.kv_dtype)
        )
        threads = model_config.threads
        if model_config.exact and self.device.type == "cpu":
            threads = exact_cpu_threads(threads)
        self.threads = threads or usable_cpus()
        if blocks:
            # the block matmuls take the threads; torch's ops (attention, norms) run on the
            # calling thread: an OpenMP team of its own would fight the matmul helpers, which
            # spin between products, for the same cores (docs/benchmarks.md)
            block_weights.set_threads(self.threads)
            torch.set_num_threads(1)
        elif threads > 0:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        self.loaded: LoadedModel = load_model(
            model_config.model, self.dtype, self.device, blocks=blocks
        )
        log.info(
            "model %s loaded in %.1f s (%s on %s, %s weights)",
            self.loaded.name,
            time.perf_counter() - started,
            self.dtype,
            self.device,
            "block" if blocks else "dense",
        )
        if self.cpu_paths is not None and self.cpu_paths.blocks:
            self.loaded.model.set_block_dot(int8=self.cpu_paths.block_dot == "int8")
        self.prompt_min_rows: int | None = None
        if self.cpu_paths is not None and self.cpu_paths.prompt_dtype is not None:
            self.prompt_min_rows = self.cpu_paths.prompt_min_rows
            self.loaded.model.add_dense_copies(torch_dtype(self.cpu_paths.prompt_dtype))
        with_chunks = self.prompt_min_rows is not None
        self.ops_for_prompts = self.ops.for_prompt_chunks() if with_chunks else self.ops
        self.page_size = pool_config.page_size
        use_graphs = graphs_wanted(model_config.cuda_graphs, self.device, self.ops)
        self.kv = KVCache.allocate(
            self.loaded.arch,
            # with CUDA graphs, one scratch page past the pool's for padding rows (cuda_graphs.py)
            pool_config.kv_cells // self.page_size + int(use_graphs),
            self.page_size,
            self.kv_dtype,
            self.device,
        )
        max_cells = min(pool_config.kv_cells, self.loaded.arch.max_position)
        self.graphs = (
            DecodeGraphs(self.loaded.model, self.kv, self.ops, max_cells) if use_graphs else None
        )
        log.info("ops: %s%s", self.ops.name, " (row-invariant)" if self.ops.row_invariant else "")

    @property
    def runner_kind(self) -> str:
        """What ``/props.cpu.runner`` shows: this runner runs every step through torch."""
        return "torch"

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    # ----------------------------------------------------------------- what the engine reads
    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def vocab_size(self) -> int:
        return self.loaded.arch.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.loaded.arch.max_position

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends over (the pool lets the pages behind it go)."""
        return self.loaded.arch.pool_window

    @property
    def kv_window_split(self) -> int | None:
        """The window of a model mixing sliding and global layers (Gemma 2 and 3), whose sliding
        layers can then keep their K/V in a window space of their own (use_window_space); None
        under CUDA graphs, whose captured steps read one space."""
        arch = self.loaded.arch
        mixed = any(arch.sliding_layers) and not all(arch.sliding_layers)
        return arch.sliding_window if mixed and self.graphs is None else None

    def use_window_space(self, n_cells: int) -> None:
        """Keep the sliding layers' K/V in ``n_cells`` cells of their own (the plan's window slot
        mapping and page tables address them, sched/window_space.py); called by the engine
        before the first step."""
        pages, dtype, device = self.kv.n_pages, self.kv.k[0].dtype, self.kv.k[0].device
        del self.kv  # the old tensors go before the new ones are taken (a GPU's memory)
        self.kv = KVCache.allocate(
            self.loaded.arch, pages, self.page_size, dtype, device, n_cells // self.page_size
        )

    @property
    def row_invariant(self) -> bool:
        return self.ops.row_invariant

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the plan's rows; returns logits [sampled rows, vocab] in float32."""
        if plan.page_copies:
            self.kv.copy_pages(plan.page_copies)
        if self.graphs is not None and (graphed := self.graphs.run(plan)) is not None:
            return graphed
        step = build_step_tensors(plan, self.page_size, self.device, self.prompt_min_rows)
        if not step.prompt_chunk:
            logits: torch.Tensor = self.loaded.model(
                step.token_ids, step.positions, step.meta, self.kv, step.logit_rows, self.ops
            )
            return logits
        # prompt chunks: a dense GEMM on torch's threads for this step (between steps torch
        # keeps one thread, so that it never fights the block kernels' helpers)
        ops = self.ops_for_prompts
        torch.set_num_threads(self.threads)
        try:
            logits = self.loaded.model(
                step.token_ids, step.positions, step.meta, self.kv, step.logit_rows, ops
            )
        finally:
            torch.set_num_threads(1)
        return logits

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """``/v1/embeddings``: the prompt's final-norm hidden states, mean-pooled and normalised,
        float32 ``[hidden]`` (runner/embedding.py), over a temporary K/V cache of its own in the
        activations' dtype (float32 on the CPU: no reason to round an embedding's keys to the
        pool's bfloat16). The prompt-chunk arithmetic when it is the activations' dtype (the dense
        float32 copies hold the blocks' values exactly, and a GEMM is the fast way through many
        rows); otherwise the decode rows', with float32 activations against the blocks even under
        ``--block-dot int8``: an embedding is a vector a client compares, not a next token, and
        int8 activations would move it by ~3e-3 against the exact weights' ~2e-6."""
        paths = self.cpu_paths
        model, size = self.loaded.model, self.page_size
        if paths is None:  # CUDA: the step's own kernels
            return embed_tokens(model, self.ops, token_ids, size, self.dtype, self.device)
        ops = self.ops_for_prompts if paths.prompt_dtype == paths.dtype else self.ops
        int8 = paths.blocks and paths.block_dot == "int8"
        torch.set_num_threads(self.threads)  # as a prompt chunk (execute): all the threads
        if int8:
            model.set_block_dot(int8=False)  # on the engine thread, between steps
        try:
            return embed_tokens(model, ops, token_ids, size, self.dtype, self.device)
        finally:
            if int8:
                model.set_block_dot(int8=True)
            if paths.blocks:
                torch.set_num_threads(1)  # between steps torch keeps one (execute says why)

    # ----------------------------------------------------------------- parking (CellCopier)
    @property
    def kv_cache(self) -> KVCache:
        """The pool's K/V tensors: parking copies them asynchronously on CUDA (DeviceKVCopier)."""
        return self.kv

    def bytes_per_cell(self) -> int:
        return self.kv.bytes_per_cell()

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        """A host tensor of at least ``n_bytes`` in the KV dtype (pinned for a GPU pool)."""
        elem = self.kv.k[0].element_size()
        pin = self.device.type == "cuda"
        return torch.empty(-(-n_bytes // elem), dtype=self.kv.k[0].dtype, pin_memory=pin)

    def save_cells(self, cells: list[int], out: torch.Tensor) -> None:
        """Copy the K and V of ``cells`` (every layer) into ``out`` (the KV cache's layout)."""
        self.kv.save_cells(cells, out)

    def restore_cells(self, src: torch.Tensor, cells: list[int], first: int = 0) -> None:
        """Write a saved state back into ``cells`` (any pages: a resume gets fresh ones); with
        ``first``, only cells ``first..`` of it (a swap resume's cached prefix stays as it is)."""
        self.kv.restore_cells(src, cells, first)
