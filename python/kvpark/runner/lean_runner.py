"""The CPU's one execution stack (``--runner lean``; what ``auto`` picks on a CPU where it can).

Every step runs in the Rust decoder (``_core._CpuDecoder``, rust/cpu_ops/src/decoder) over numpy:
the weights read from the model file by model/numpy_weights.py, the pool in numpy
(numpy_pool.py), the sampler in numpy (sampling/sampler.py). torch is never imported: its
import alone leaves ~360 MiB resident (operator tables, Python modules, the CUDA build's
libraries), more than the default model and its KV pool together, and a CPU install carries no
torch at all (the ``gpu`` extra brings it).

It runs what the decoder runs, every step of it, on every ISA (plain Rust without AVX2): a GGUF
file or a Hugging Face directory whose matrices the decoder multiplies (model/numpy_weights.py's
``decoder_unfit``: blocks, or dense F32/F16/BF16 kept in the file's own dtype, so a bf16
checkpoint is held in 16 bits and never copied to float32; ``Unfit`` names the first matrix it
cannot take). Dense products take float32 activations whatever ``--block-dot`` says. Anything
else goes to the torch runner, and ``why_not_lean`` or ``Unfit`` names the reason.

``/v1/embeddings`` (``embed``) runs the same decoder over a temporary pool of its own, with
float32 activations against the blocks: the pool's cells are never touched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import numpy.typing as npt

import kvpark._core as _core
from kvpark.config.cpus import usable_cpus
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.numpy_weights import NumpyWeights, Unfit, fit_for_decoder, read_model
from kvpark.model.rope_angles import rope_tables
from kvpark.model.sources import default_model_path, return_freed_heap
from kvpark.model.weight_arrays import Stacked
from kvpark.model.weight_names import expert_attr
from kvpark.runner.cpu_decoder import (
    DecoderInputs,
    DecoderLayer,
    Fused,
    Matrix,
    build_decoder,
    decoder_matrix,
    one_matrix,
    run_hidden,
    run_step,
    single,
)
from kvpark.runner.cpu_paths import CpuPaths, exact_cpu_threads, resolve_cpu_paths
from kvpark.runner.devices import device_kind
from kvpark.runner.huge_pages import move_weights
from kvpark.runner.numpy_pool import NumpyKVPool
from kvpark.runner.packed_blocks import pack_weights, packed_blocks, packed_kinds
from kvpark.runner.step_rows import sampled_rows
from kvpark.sched.plan import StepItem, StepPlan
from kvpark.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvpark.runner.lean_runner")


def why_not_lean(config: ModelConfig) -> str | None:
    """Why the lean runner cannot run ``config`` (checked before any weight is read), or None."""
    if device_kind(config.device) != "cpu":
        return "the model runs on a GPU"
    paths = resolve_cpu_paths(config)
    if paths.dtype != "float32":
        return f"its activations are float32, not {paths.dtype} (--dtype)"
    if not paths.blocks:
        return "its weights are dense (--weights dense: every matrix dequantised to float32)"
    if paths.prompt_dtype is not None:
        return f"prompt chunks take a dense {paths.prompt_dtype} GEMM (--prompt-path)"
    return None


class LeanCpuRunner:
    """``kvpark.Runner`` on the CPU with no torch: every step in the Rust decoder."""

    def __init__(
        self,
        model_config: ModelConfig,
        pool_config: PoolConfig,
        weights: NumpyWeights,
        tokenizer: Tokenizer,
        name: str,
    ) -> None:
        self.model_config = model_config
        # the q4 (and q6) matrices in the layout the kernels read in place (packed_blocks.py)
        pack_weights(weights, packed_kinds())
        kinds = {isinstance(p, Blocks) for p in weights.matrix_parts()}
        # what /props shows: the weights this model holds (a safetensors model has no blocks)
        self.cpu_paths: CpuPaths = replace(
            resolve_cpu_paths(model_config), blocks=True in kinds, dense=False in kinds
        )
        log.info("%s", self.cpu_paths.summary())
        threads = model_config.threads
        if model_config.exact:
            threads = exact_cpu_threads(threads)
        self.threads = threads or usable_cpus()
        _core._cpu_set_threads(self.threads)
        self.weights = weights
        self.name = name
        self._tokenizer = tokenizer
        self.page_size = pool_config.page_size
        self.pool = NumpyKVPool(
            weights.arch,
            pool_config.kv_cells // self.page_size,
            self.page_size,
            self.cpu_paths.kv_dtype,
        )
        # after the pool, whose untouched pages would otherwise reuse the heap the move frees
        self._arena = move_weights(weights)  # onto huge pages (huge_pages.py)
        self.embed_matrix, self.head_matrix, self.matrices = decoder_matrices(weights)
        self.decoder, self._inputs = self._build_decoder(self.pool, self.cpu_paths.decoder_dot)
        log.info("runner: lean (the Rust decoder, no torch)")

    @classmethod
    def load(cls, config: EngineConfig) -> LeanCpuRunner:
        """Read the model (a GGUF file or a Hugging Face directory) and build the runner; Unfit
        at the first matrix the decoder cannot multiply."""
        started = time.perf_counter()
        path = config.model.model or default_model_path()
        # dense_dtype None: each dense tensor in the dtype the file stores it in (no float32
        # copy of a bf16 or f16 checkpoint); strict: a file the decoder refuses is read no further
        # each block matrix packed as it is read: the file's form of one matrix at a time in
        # memory (a q6 one takes 10 bits a weight in it, 6.5 packed: the peak is the packed model)
        kinds = packed_kinds()
        weights, tokenizer, name = read_model(
            path,
            blocks=True,
            dense_dtype=None,
            strict=True,
            keep=lambda m: packed_blocks(m, kinds),
        )
        runner = cls(config.model, config.pool, fit_for_decoder(weights), tokenizer, name)
        return_freed_heap()
        log.info(
            "model %s loaded in %.1f s (numpy, %.0f MiB of weights)",
            runner.name,
            time.perf_counter() - started,
            weights.nbytes / 2**20,
        )
        return runner

    def _build_decoder(
        self, pool: NumpyKVPool, dot: str
    ) -> tuple[_core._CpuDecoder, DecoderInputs]:
        """A decoder over the weights and ``pool``'s cells (``dot``: ``CpuPaths.decoder_dot``),
        and the inputs that keep alive every array whose address it holds: keep both together."""
        w, arch = self.weights, self.weights.arch
        layers = [
            DecoderLayer(
                attn_norm=layer.vectors["attn_norm"],
                qkv=matrices["qkv_w"],
                o=single(matrices["o_w"]),
                mlp_norm=layer.vectors["mlp_norm"],
                gate_up=matrices.get("gate_up_w"),
                down=single(matrices["down_w"]) if "down_w" in matrices else None,
                k_cells=k,
                v_cells=v,
                qkv_bias=layer.vectors.get("qkv_b"),
                o_bias=layer.vectors.get("o_b"),
                q_norm=layer.vectors.get("q_norm"),
                k_norm=layer.vectors.get("k_norm"),
                post_attn_norm=layer.vectors.get("post_attn_norm"),
                post_mlp_norm=layer.vectors.get("post_mlp_norm"),
                router=single(matrices["router_w"]) if "router_w" in matrices else None,
                experts=[
                    (
                        matrices[expert_attr(e, "gate_up_w")],
                        single(matrices[expert_attr(e, "down_w")]),
                    )
                    for e in range(arch.n_experts if "router_w" in matrices else 0)
                ],
            )
            for layer, matrices, k, v in zip(w.layers, self.matrices, pool.k, pool.v, strict=True)
        ]
        rope = rope_tables(arch, w.rope_freqs)
        inputs = DecoderInputs()
        decoder = build_decoder(
            arch,
            layers,
            self.embed_matrix,
            w.norm,
            self.head_matrix,
            rope,
            pool.dtype,
            dot,
            inputs,
        )
        return decoder, inputs

    # ----------------------------------------------------------------- what the engine reads
    @property
    def runner_kind(self) -> str:
        """What ``/props.cpu.runner`` shows."""
        return "lean"

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.name

    @property
    def vocab_size(self) -> int:
        return self.weights.arch.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.weights.arch.max_position

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends over (the pool lets the pages behind it go)."""
        return self.weights.arch.pool_window

    @property
    def kv_window_split(self) -> int | None:
        """The window of a model mixing sliding and global layers (Gemma 2 and 3): its sliding
        layers can keep their K/V in a window space of their own (use_window_space)."""
        arch = self.weights.arch
        mixed = any(arch.sliding_layers) and not all(arch.sliding_layers)
        return arch.sliding_window if mixed else None

    def use_window_space(self, n_cells: int) -> None:
        """Keep the sliding layers' K/V in ``n_cells`` cells of their own (the plan's window
        slot mapping and page tables address them, sched/window_space.py); called by the engine
        before the first step. The pool's arrays are calloc'd: the ones dropped here were never
        touched."""
        pool = self.pool
        self.pool = NumpyKVPool(
            self.weights.arch, pool.n_pages, self.page_size, pool.dtype, n_cells // self.page_size
        )
        self.decoder, self._inputs = self._build_decoder(self.pool, self.cpu_paths.decoder_dot)

    @property
    def row_invariant(self) -> bool:
        """Every op of the decoder is row-invariant; claimed in exact mode, where it is asked
        for (``/props.exact`` reports this), as the torch runners do."""
        return self.model_config.exact

    def execute(self, plan: StepPlan) -> npt.NDArray[np.float32]:
        if plan.page_copies:
            self.pool.copy_pages(plan.page_copies)
        logits = np.empty((sampled_rows(plan), self.vocab_size), dtype=np.float32)
        if not plan.empty:
            run_step(self.decoder, plan, self.page_size, logits)
        return logits

    # ----------------------------------------------------------------- parking
    def bytes_per_cell(self) -> int:
        return self.pool.bytes_per_cell()

    def host_buffer(self, n_bytes: int) -> npt.NDArray[np.generic]:
        return self.pool.host_buffer(n_bytes)

    def save_cells(self, cells: list[int], out: npt.NDArray[np.generic]) -> None:
        self.pool.save_cells(cells, out)

    def restore_cells(self, src: npt.NDArray[np.generic], cells: list[int], first: int = 0) -> None:
        self.pool.restore_cells(src, cells, first)

    # ----------------------------------------------------------------- /v1/embeddings
    def embed(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        """The prompt's final-norm hidden states, mean-pooled and L2-normalised: float32
        ``[hidden]``. The decoder runs over a float32 pool of its own (dropped on return), so no
        cell of the engine's pool is read or written, with float32 activations against the
        blocks even under ``--block-dot int8``: an embedding is a vector a client compares, not a
        next token, and int8 activations would move it by ~3e-3 against the exact weights'.
        The engine calls it between steps, on its own thread."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("an embedding needs at least one token")
        pages = -(-n // self.page_size)
        pool = NumpyKVPool(self.weights.arch, pages, self.page_size, "float32")
        decoder, _inputs = self._build_decoder(pool, dot="float32")  # _inputs: alive with it
        hidden = np.empty((n, self.weights.arch.hidden_size), dtype=np.float32)
        # the pool is this prompt's alone: its cells are its positions
        plan = StepPlan(
            [StepItem(0, 0, list(token_ids), True)], list(range(n)), [list(range(pages))]
        )
        run_hidden(decoder, plan, self.page_size, hidden)
        # float32 whatever the pool's type: the mean of n rows is one more sum to keep accurate
        pooled = hidden.mean(axis=0, dtype=np.float32)
        norm = float(np.linalg.norm(pooled))
        return np.asarray(pooled / np.float32(max(norm, 1e-12)), dtype=np.float32)


def decoder_matrices(w: NumpyWeights) -> tuple[Matrix, Matrix, list[dict[str, Fused]]]:
    """The embedding, the head and each layer's matrices as the decoder takes them
    (cpu_decoder.decoder_matrix), once for the runner's life; a tied head is the embedding's."""
    if isinstance(w.embed, Stacked) or isinstance(w.head, Stacked):
        raise ValueError("the embedding and the head are one tensor each, never fused")
    embed = one_matrix(w.embed)
    head = embed if w.head is w.embed else one_matrix(w.head)
    layers = [{a: decoder_matrix(m) for a, m in layer.matrices.items()} for layer in w.layers]
    return embed, head, layers


def try_lean(config: EngineConfig) -> tuple[LeanCpuRunner | None, str | None]:
    """The lean runner for ``config``, or None and the reason it cannot run it."""
    why = why_not_lean(config.model)
    if why is not None:
        return None, why
    try:
        return LeanCpuRunner.load(config), None
    except Unfit as e:
        return None, str(e)
