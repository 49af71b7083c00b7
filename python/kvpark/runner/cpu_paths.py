"""Which arithmetic runs where on a CPU: a fixed rule on the CPU's flags, never a timing.

``--dtype auto``, ``--weights auto`` and ``--prompt-path auto`` resolve here, from the features
the Rust kernels see (``_core._cpu_features``: the CPU's flags under the cap in
``KVPARK_CPU_ISA``). The table and the step times behind it are in docs/cpu-kernels.md:

=====================  ==============  ================================  ==============  ==========
effective ISA          decode rows     prompt chunks                     exact mode      KV cells
=====================  ==============  ================================  ==============  ==========
avx512 (+ VNNI)        int8 x blocks   int8 x blocks                     int8 x blocks   float16
avx2                   int8 x blocks   int8 x blocks                     int8 x blocks   float16
plain (no AVX2)        int8 x blocks   int8 x blocks                     int8 x blocks   float16
=====================  ==============  ================================  ==============  ==========

The CPU has one execution stack, the Rust decoder (runner/lean_runner.py), so every ISA takes
the GGUF's blocks: without AVX2 the kernels' plain Rust path runs them (slower than a dense BLAS
at one row, but with no torch in the process and the same bits as every SIMD path). The table is
for block matrices; a model's dense ones (a Hugging Face checkpoint's, an F16 GGUF's) are
multiplied as the file stores them (f32, f16, bf16) by float32 activations, on the same stack,
whatever the block dot, in one fixed order that no row, tile or thread split changes (exact mode
holds there too; rust/cpu_ops/src/dense).

Block products round the activations to int8 per block of 32 (``--block-dot auto``: int8,
llama.cpp's own arithmetic, whose greedy tokens agree with llama.cpp's on the parity prompts:
tests/model/test_llamacpp_greedy.py), with VNNI's ``vpdpbusd`` where the CPU has it and
``vpmaddubsw`` on AVX2. It is the fastest product on both families (docs/cpu-kernels.md) and
needs no dense copy of the weights. Prompt chunks stay on the same blocks (``--prompt-path
auto``), so that every row has one arithmetic. ``--block-dot float32`` multiplies float32
activations by each block expanded to float32 instead. A dense prompt GEMM (``--prompt-path
float32`` or ``bfloat16``) is the torch runner's: asked for, it runs the model there.

Under the int8 dot a CPU with AVX-512 BF16 multiplies BF16 matrices (of whole chunks of 32
inputs) by activations rounded to bf16, two inputs a lane at a time as its ``vdpbf16ps`` does
(``CpuPaths.dense_dot``, ``/props`` ``cpu.bf16_dot``; rust/cpu_ops/src/dense/bf16_pairs.rs):
llama.cpp's arithmetic for such matrices, with twice the multiply-adds an instruction and no
widening of the weights (an SmolLM2-135M BF16 prompt's products ~1.5x faster). The rounding is
per row, so exact mode holds. Other CPUs keep float32 activations, as ``--block-dot float32``
does everywhere (the off switch).

``--kv-dtype auto`` follows the pool rule: a 16-bit pool is the default where it agrees with the
reference of the arithmetic in force at least as well as the float32 pool does
(tests/runner/test_cpu_path_greedy.py checks each case, and that auto follows it):

- float32 activations (``--block-dot float32``, dense weights): the reference is the float32
  pool itself; a 16-bit pool must keep its 32 greedy tokens on the parity prompts. bf16 and f16
  cells both do.
- int8 activations (the default): the reference is llama.cpp, whose arithmetic int8 mirrors and
  which itself keeps 16-bit (f16) cells, not the float32 pool (neither 16-bit pool keeps that
  one's greedy tokens: the 8-bit rounding turns the cells' last bits into other near-ties). A
  16-bit pool must agree with llama.cpp's recorded steps (tests/data/llamacpp_greedy.json) at
  least as well as the float32 pool: no fault of tests/model/test_llamacpp_greedy.py's rule
  (``step_fault``, tests/support/llamacpp.py) on the teacher-forced and the free-running steps,
  and no more teacher-forced near-tie flips than the float32 pool's. f16 cells do (3 flips
  against 5, largest logprob gap 0.29 nats against 0.44, free-running prefixes [15, 32, 11]
  against [7, 14, 25]): llama.cpp's own cell format. bf16 cells miss it by one teacher-forced
  step (0.52 nats off llama.cpp's log-probability where the rule allows 0.5).

So auto is float16 under int8 activations and bfloat16 under float32 ones (bf16's widening is a
shift, as fast as F16C's and faster without it, and it has float32's range). Either halves the
pool's memory and attention's reads; the cost is greedy tokens that differ from the float32
pool's at near-ties, and under int8 f16's range: a K or V value past 65504 becomes infinite (as in
llama.cpp, whose cells are f16 too; ``--kv-dtype bf16`` keeps float32's range). A float16 model
keeps float16 cells; f16, bf16 and f32 (or float32, bfloat16, float16) name a pool's cells
explicitly, ``f32`` for the float32 pool. The rule keys on the block dot, before the model is
read: a model without blocks (a Hugging Face checkpoint on the lean runner, float32 activations
throughout) takes float16 cells under the default int8 dot too.

Under an explicit dense prompt path a step takes the dense GEMM when its prompt chunks (items of
more than one row) hold at least ``PROMPT_MIN_ROWS`` rows in all (``step_rows.takes_prompt_path``).
Such a step runs all its rows dense, the decode rows beside it too (ops/prompt_linear.py says
why). Exact mode keeps prompt and decode rows on one arithmetic (a recompute replay must give
the bits the first pass gave).
"""

from __future__ import annotations

from dataclasses import dataclass

import kvpark._core as _core
from kvpark.config.cpus import usable_cpus
from kvpark.config.layers import DTYPE_NAMES, ModelConfig

PROMPT_MIN_ROWS = 64
PROMPT_PATHS = ("auto", "same", "float32", "bfloat16")
BLOCK_DOTS = ("auto", "int8", "float32")
# Every spelling --kv-dtype (and ModelConfig.kv_dtype) takes, to its canonical name (torch's)
KV_DTYPE_NAMES = {
    "auto": "auto",
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
}


@dataclass(frozen=True)
class CpuPaths:
    """The resolved choice for one CPU runner."""

    isa: str  # the level the kernels run: plain, avx2 or avx512
    dtype: str  # activations and dense weights: float32 or bfloat16 (or float16)
    blocks: bool  # decode rows multiply GGUF blocks in Rust
    prompt_dtype: str | None  # prompt chunks in a dense GEMM of this dtype; None: as decode rows
    kv_dtype: str = "float16"  # the KV pool's cells
    prompt_min_rows: int = PROMPT_MIN_ROWS
    # how block products multiply: int8 activations (llama.cpp's arithmetic) or float32 ones
    block_dot: str = "int8"
    # dense matrices beside the blocks (or, blocks False, instead of them) that the lean runner
    # multiplies as the file stores them, f32, f16 or bf16, with float32 activations
    dense: bool = False
    # the activations of BF16 matrices: bf16 (rounded once, multiplied in pairs as AVX-512 BF16's
    # vdpbf16ps does) or float32, as every other dense matrix's (module docstring)
    dense_dot: str = "float32"

    @property
    def decoder_dot(self) -> str:
        """The Rust decoder's ``dot``: the block dot, with ``+bf16`` where BF16 matrices take
        bf16 activations."""
        if self.block_dot != "int8":
            return "float32"
        return "int8+bf16" if self.dense_dot == "bf16" else "int8"

    @property
    def weights(self) -> str:
        """What the matrices are: blocks, dense, or both (a GGUF with a dense head, say)."""
        if not self.blocks:
            return "dense"
        return "blocks and dense" if self.dense else "blocks"

    def describe(self) -> dict[str, object]:
        """What ``/props`` shows (``cpu``)."""
        return {
            "isa": self.isa,
            "dtype": self.dtype,
            "weights": self.weights,
            "prompt_path": f"dense {self.prompt_dtype}" if self.prompt_dtype else "same",
            "prompt_min_rows": self.prompt_min_rows if self.prompt_dtype else None,
            "kv_dtype": self.kv_dtype,
            "block_dot": self.block_dot if self.blocks else None,
            "bf16_dot": self.dense_dot,
        }

    def summary(self) -> str:
        """One line for the start-up log."""
        dot = f" ({self.block_dot} dot)" if self.blocks else ""
        decode = f"{self.dtype} x {self.weights}{dot}"
        prompt = (
            f"dense {self.prompt_dtype} for chunks of >= {self.prompt_min_rows} rows"
            if self.prompt_dtype
            else "as decode"
        )
        pairs = "; bf16 matrices by bf16 activations" if self.dense_dot == "bf16" else ""
        kv = f"KV {self.kv_dtype}{pairs}"
        return f"cpu paths ({self.isa}): decode {decode}; prompts {prompt}; {kv}"


def choose(
    features: dict[str, bool | str],
    *,
    dtype: str = "auto",
    weights: str = "auto",
    prompt_path: str = "auto",
    kv_dtype: str = "auto",
    block_dot: str = "auto",
    exact: bool = False,
) -> CpuPaths:
    """The rule of the module docstring. ``features``: the effective flags (``isa`` and the
    booleans). ``blocks`` is whether a GGUF's block matrices stay blocks; a model's dense matrices
    (a Hugging Face checkpoint's, other types') are dense whatever it says (the lean runner shows
    what its model holds: ``CpuPaths.dense``). Raises ValueError for a combination that cannot
    run."""
    isa = str(features.get("isa", "plain"))
    if dtype == "auto":
        # bf16 decode fails the greedy rule (its tokens part from float32's within 32 on the
        # parity prompts, on every CPU tried): float32 activations everywhere
        dtype = "float32"
    if weights == "auto":
        # the one CPU stack multiplies blocks on every ISA (plain Rust without AVX2)
        blocks = dtype == "float32"
    elif weights == "blocks":
        if dtype != "float32":
            raise ValueError(f"--weights blocks runs on the CPU in float32, not {dtype}")
        blocks = True
    elif weights == "dense":
        blocks = False
    else:
        raise ValueError(f"unknown weights {weights!r}; use auto, dense or blocks")
    if block_dot not in BLOCK_DOTS:
        raise ValueError(f"unknown block dot {block_dot!r}; use {', '.join(BLOCK_DOTS)}")
    if block_dot == "auto":
        block_dot = AUTO_BLOCK_DOT
    if prompt_path not in PROMPT_PATHS:
        raise ValueError(f"unknown prompt path {prompt_path!r}; use {', '.join(PROMPT_PATHS)}")
    if exact and prompt_path not in ("auto", "same"):
        raise ValueError(
            f"--prompt-path {prompt_path} with --exact: exact mode keeps prompt and decode rows "
            "on one arithmetic"
        )
    prompt: str | None
    if not blocks or exact or prompt_path == "same":
        # dense weights already are the dense path; exact mode keeps one arithmetic
        prompt = None
    elif prompt_path == "auto":
        # prompts on the blocks too: one arithmetic for every row (a float32 prompt under int8
        # decode rows parts from llama.cpp's logprobs by up to 0.7 nats,
        # tests/model/test_llamacpp_greedy.py), and the Rust decoder runs the whole step
        prompt = None
    else:
        prompt = prompt_path
    if kv_dtype not in KV_DTYPE_NAMES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; use {', '.join(KV_DTYPE_NAMES)}")
    kv_dtype = KV_DTYPE_NAMES[kv_dtype]
    if kv_dtype == "auto":
        if dtype == "float16":
            kv_dtype = "float16"  # a float16 model keeps float16 cells
        elif blocks and block_dot == "int8":
            # the pool rule (module docstring): under int8 activations f16 cells agree with
            # llama.cpp, the reference of that arithmetic, at least as well as the float32 pool
            # does (bf16 cells miss by one step)
            kv_dtype = "float16"
        else:
            # under float32 activations bf16 keeps the float32 pool's greedy tokens, and has
            # float32's range (f16 overflows past 65504)
            kv_dtype = "bfloat16"
    # BF16 matrices by bf16 activations where the CPU multiplies them natively (vdpbf16ps), as
    # llama.cpp does: under the int8 dot (reduced-precision activations), not the float32 one
    bf16_native = isa == "avx512" and bool(features.get("avx512_bf16"))
    return CpuPaths(
        isa=isa,
        dtype=dtype,
        blocks=blocks,
        prompt_dtype=prompt,
        kv_dtype=kv_dtype,
        block_dot=block_dot,
        dense_dot="bf16" if block_dot == "int8" and bf16_native else "float32",
    )


# int8 activations wherever there are blocks: llama.cpp's arithmetic (its greedy tokens agree with
# llama.cpp's, tests/model/test_llamacpp_greedy.py), the fastest product on AVX2 and on VNNI, and
# no dense copy of the weights for prompts. They part from the float32 product's greedy tokens at
# the first token of the first parity prompt, a 0.09-nat near-tie that llama.cpp takes the same
# way as int8 does; `--block-dot float32` is the exact-weights product.
AUTO_BLOCK_DOT = "int8"


def cpu_features() -> dict[str, bool | str]:
    """The CPU flags the Rust kernels run under (the CPU's, capped by ``KVPARK_CPU_ISA``)."""
    return _core._cpu_features()[1]


def resolve_cpu_paths(config: ModelConfig) -> CpuPaths:
    """``choose`` for a model config on this CPU (``--dtype auto`` is float32 on the CPU)."""
    if config.dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {config.dtype!r}; use auto, float32, bfloat16 or float16")
    dtype = DTYPE_NAMES[config.dtype]
    return choose(
        cpu_features(),
        dtype="float32" if dtype == "auto" else dtype,
        weights=config.weights,
        prompt_path=config.prompt_path,
        kv_dtype=config.kv_dtype,
        block_dot=config.block_dot,
        exact=config.exact,
    )


EXACT_CPU_THREADS = 2


def exact_cpu_threads(requested: int) -> int:
    """Threads for exact mode on CPU. Elementwise transcendental ops (exp, silu) compute the scalar
    tail of a vectorised loop with another formula, and with more than two threads a thread's range
    can end mid-vector at a place that depends on the step's size (see chunked_attention.py)."""
    if requested > EXACT_CPU_THREADS:
        raise ValueError(
            f"exact mode on CPU runs with at most {EXACT_CPU_THREADS} threads (asked for "
            f"{requested}): with more, a row's bits could depend on the size of its step"
        )
    return requested or min(EXACT_CPU_THREADS, usable_cpus())
