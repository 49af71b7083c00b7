"""Exact mode's ops (docs/exact.md): close to the reference; a row's bits independent of its
neighbours.

Bits are compared inside one process ("alone" against "in a batch"), never against stored values:
golden bits differ between CPU models and BLAS versions.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvpark.model.ops import KVCache, block_weights, chunked_attention, exact_attention
from kvpark.model.ops import tiled_linear as tiled_linear_module
from kvpark.model.ops.cpu_attention import NativeDecode
from kvpark.model.ops.op_set import OpSet
from kvpark.model.ops.tiled_linear import TILE_CHOICES, tiled_linear
from support.attention import PAGE, STEPS, make_step, reference, tiny_arch

LINEAR_SHAPES = [(64, 96), (576, 960), (1536, 576)]  # (in, out); the last two are SmolLM2's
ROWS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100]
# Exact mode's attention: the op set's own (one Rust kernel entry per row on CPU pools,
# chunk tiles otherwise), and the torch chunk tiles on their own (CUDA without Triton).
ATTENTION = {
    "exact": (exact_attention.prepare, exact_attention.exact_attention),
    "chunked": (chunked_attention.prepare, chunked_attention.chunked_attention),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_tiled_linear_rows_do_not_depend_on_their_neighbours(
    shape: tuple[int, int], dtype: torch.dtype, threads: int
) -> None:
    """Also on two torch threads (exact mode's dense CPU path runs on up to two): there MKL splits
    a lone GEMM of some shapes between the threads and a batch of them by batch element, with
    other bits (seen on an Intel Xeon with AVX-512: a [8, 576] x [576, 960] tile alone differs
    from the same tile in a batch of two)."""
    torch.set_num_threads(threads)
    try:
        check_tiled_linear(shape, dtype)
    finally:
        torch.set_num_threads(1)


def check_tiled_linear(shape: tuple[int, int], dtype: torch.dtype) -> None:
    n_in, n_out = shape
    g = torch.Generator().manual_seed(n_in)
    weight = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(dtype)
    bias = torch.randn(n_out, generator=g).to(dtype)
    probe = torch.randn(1, n_in, generator=g).to(dtype)
    alone = tiled_linear(probe, weight, bias)
    assert torch.allclose(alone.float(), F.linear(probe, weight, bias).float(), atol=5e-2, rtol=0)
    for rows in ROWS:
        for at in {0, rows // 2, rows - 1}:  # first, middle and last slot of the batch
            x = torch.randn(rows, n_in, generator=g).to(dtype)
            x[at] = probe[0]
            out = tiled_linear(x, weight, bias)
            assert out.shape == (rows, n_out)
            assert torch.equal(out[at], alone[0]), f"row {at} of {rows} differs"
            want = F.linear(x.float(), weight.float(), bias.float())
            assert (out.float() - want).abs().max().item() < (
                1e-4 if dtype == torch.float32 else 0.1
            )


# The capped run: kvpark imported first, so KVPARK_CPU_ISA=avx2 caps MKL, oneDNN and ATen before
# torch loads (config/env.py); each row of a tile against the same row heading a tile of others.
UNDER_AVX2 = """
import kvpark, torch
from kvpark.model.ops.tiled_linear import row_tile, tiled_linear
for threads in (1, 2):
    torch.set_num_threads(threads)
    for n_in, n_out in ((64, 96), (576, 960), (1536, 576)):
        g = torch.Generator().manual_seed(n_in)
        weight = torch.randn(n_out, n_in, generator=g) / n_in**0.5
        for rows in (7, 8, 9, 12, 17):
            x = torch.randn(rows, n_in, generator=g)
            out = tiled_linear(x, weight)
            for at in range(rows):
                alone = tiled_linear(x[at : at + 1], weight)[0]
                assert torch.equal(out[at], alone), (threads, n_in, rows, at)
        print(threads, n_in, row_tile(weight.device, weight.dtype, n_in, n_out, threads))
"""


def test_tiled_linear_rows_are_invariant_under_the_avx2_cap() -> None:
    """MKL's AVX2 kernels (an AVX2-only Intel CPU, or the cap on any x86 CPU) compute an 8-row
    tile in strips of six rows: its last two rows got other bits before the tile was probed."""
    env = {**os.environ, "KVPARK_CPU_ISA": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", UNDER_AVX2], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tiles = [int(line.split()[2]) for line in done.stdout.splitlines()]
    assert len(tiles) == 6 and all(t in TILE_CHOICES or t == 1 for t in tiles)


def test_the_probe_refuses_a_tile_whose_rows_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product that gives a tile's last row other bits (as MKL's AVX2 strips do) moves the
    probe to the next choice; one that does so for every tile leaves one row a product."""
    real = tiled_linear_module._product
    limited: set[int] = set()

    def skewed(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
        out = real(x, weight, tile)
        if tile in limited:
            out[tile - 1 :: tile] = out[tile - 1 :: tile] * (1 + 2**-20)
        return out

    monkeypatch.setattr(tiled_linear_module, "_product", skewed)
    tiled_linear_module.row_tile.cache_clear()
    try:
        limited.add(8)
        assert tiled_linear_module.row_tile(torch.device("cpu"), torch.float32, 64, 96, 1) == 12
        tiled_linear_module.row_tile.cache_clear()
        limited.update(TILE_CHOICES)
        assert tiled_linear_module.row_tile(torch.device("cpu"), torch.float32, 64, 96, 1) == 1
    finally:
        tiled_linear_module.row_tile.cache_clear()


def _pool(dtype: torch.dtype, n_kv: int, d: int, n_pages: int = 400) -> KVCache:
    arch = tiny_arch(n_kv * 3, n_kv, d)
    return KVCache.allocate(arch, n_pages, PAGE, dtype, torch.device("cpu"))


@pytest.mark.parametrize("impl", list(ATTENTION))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", list(STEPS))
def test_exact_attention_matches_reference(step: str, dtype: torch.dtype, impl: str) -> None:
    prepare, attend = ATTENTION[impl]
    arch = tiny_arch(6, 2)
    meta, cells = make_step(STEPS[step], n_pages=40, seed=len(step))
    kv = KVCache.allocate(arch, 40, PAGE, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for layer in (kv.k[0], kv.v[0]):
        layer.copy_(torch.randn(layer.shape, generator=g).to(dtype))
    q = torch.randn(meta.n_rows, 6, arch.head_dim, generator=g).to(dtype)
    plan = prepare(meta, arch, dtype)
    native = impl == "exact"  # the Rust kernel on every CPU pool
    assert isinstance(plan, NativeDecode) == native
    got = attend(q, kv.k[0], kv.v[0], plan)
    k_flat = kv.k[0].view(-1, 2, arch.head_dim)
    want = reference(q, k_flat, kv.v[0].view(-1, 2, arch.head_dim), meta, cells)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max().item() < tol


class Sequences:
    """Per-sequence q, k and v at every position: a sequence's numbers are the same in any step."""

    def __init__(self, n_heads: int, n_kv: int, d: int, dtype: torch.dtype, impl: str) -> None:
        self.n_heads, self.n_kv, self.d, self.dtype = n_heads, n_kv, d, dtype
        self.prepare, self.attention = ATTENTION[impl]
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def data(self, key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if key not in self.cache:
            g = torch.Generator().manual_seed(1000 + key)
            shape = (300, self.n_kv, self.d)
            q = torch.randn(300, self.n_heads, self.d, generator=g).to(self.dtype)
            k = torch.randn(shape, generator=g).to(self.dtype)
            v = torch.randn(shape, generator=g).to(self.dtype)
            self.cache[key] = (q, k, v)
        return self.cache[key]

    def attend(self, seqs: list[tuple[int, int, int]], seed: int) -> dict[int, torch.Tensor]:
        """seqs: (key, rows, context). Returns each key's output rows [rows, heads, D]."""
        meta, cells = make_step([(n, c) for _, n, c in seqs], n_pages=400, seed=seed)
        kv = _pool(self.dtype, self.n_kv, self.d)
        k_flat = kv.k[0].view(-1, self.n_kv, self.d)
        v_flat = kv.v[0].view(-1, self.n_kv, self.d)
        noise = torch.Generator().manual_seed(seed)
        k_flat.copy_(torch.randn(k_flat.shape, generator=noise))  # other cells hold garbage
        v_flat.copy_(torch.randn(v_flat.shape, generator=noise))
        q_rows = []
        for (key, n, ctx), seq_cells in zip(seqs, cells, strict=True):
            q, k, v = self.data(key)
            idx = torch.tensor(seq_cells)
            k_flat[idx], v_flat[idx] = k[:ctx], v[:ctx]
            q_rows.append(q[ctx - n : ctx])
        arch = tiny_arch(self.n_heads, self.n_kv, self.d)
        plan = self.prepare(meta, arch, self.dtype)
        out = self.attention(torch.cat(q_rows), kv.k[0], kv.v[0], plan)
        return {
            key: out[meta.query_start[b] : meta.query_start[b + 1]]
            for b, (key, _, _) in enumerate(seqs)
        }


@pytest.mark.parametrize("impl", list(ATTENTION))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
def test_exact_attention_rows_are_invariant(
    dtype: torch.dtype, heads: tuple[int, int], impl: str
) -> None:
    s = Sequences(heads[0], heads[1], 16, dtype, impl)
    n = 150  # crosses key chunks (64) and query tiles (16)
    whole = s.attend([(0, n, n)], seed=1)[0]
    rng = random.Random(3)
    # beside neighbours (prompts and decodes, placed before and after), in any order
    for trial in range(4):
        others = [(k, rng.choice([1, 1, 5, 40]), rng.randint(40, 200)) for k in range(1, 5)]
        others = [(k, min(r, c), c) for k, r, c in others]
        seqs = [*others[:trial], (0, n, n), *others[trial:]]
        assert torch.equal(s.attend(seqs, seed=10 + trial)[0], whole), f"trial {trial}"
    # the prompt cut into chunks at odd places
    for cut in (1, 15, 16, 17, 63, 64, 65, 100):
        first = s.attend([(0, cut, cut)], seed=20)[0]
        rest = s.attend([(9, 1, 30), (0, n - cut, n)], seed=21)[0]
        assert torch.equal(torch.cat((first, rest)), whole), f"cut at {cut}"
    # every row as a decode step of its own
    for pos in (0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 149):
        decode = s.attend([(5, 1, 77), (0, 1, pos + 1), (6, 3, 3)], seed=30 + pos)[0]
        assert torch.equal(decode[0], whole[pos]), f"decode row {pos}"


def test_native_exact_attention_does_not_depend_on_the_kernel_threads() -> None:
    s = Sequences(6, 2, 16, torch.float32, "exact")
    step = [(1, 40, 90), (0, 1, 150), (2, 7, 7)]
    block_weights.set_threads(1)
    one = s.attend(step, seed=4)
    block_weights.set_threads(3)
    try:
        three = s.attend(step, seed=4)
    finally:
        block_weights.set_threads(1)
    assert all(torch.equal(one[k], three[k]) for k in one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norms_of_strided_views_do_not_depend_on_their_neighbours(
    dtype: torch.dtype,
) -> None:
    """Qwen3's and Gemma 3's q and k norms take views cut from the QKV rows: a lone row's view
    is contiguous and went to the Rust kernel, several rows' is strided and went to torch's
    rms_norm, with other bits (on every CPU: two implementations), which made a Gemma 3 answer
    depend on its neighbours in exact mode."""
    torch.set_num_threads(1)
    exact = OpSet.exact()
    gen = torch.Generator().manual_seed(0)
    qkv = (torch.randn(24, 8 * 64, generator=gen) * 3).to(dtype)
    weight = torch.randn(64, generator=gen).to(dtype)
    for lo, hi in ((0, 4 * 64), (4 * 64, 6 * 64)):  # the q heads, then the k heads

        def first_row(n: int, lo: int = lo, hi: int = hi) -> torch.Tensor:
            view = qkv[:n, lo:hi].view(n, (hi - lo) // 64, 64)
            return exact.rms_norm(view, weight, 1e-6)[0]

        alone = first_row(1)
        for n in ROWS:
            if n <= qkv.shape[0]:
                assert torch.equal(first_row(n), alone), (lo, n)
