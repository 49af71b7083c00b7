"""4-bit, q6 and q5 matrices packed for the CPU decoder (runner/packed_blocks.py, ``Blocks`` kinds
"q4p", "q6p", "q5p" and "q5b", all but q4 compact):
the Rust packer's layout read back by ``unpacked`` (blocks lane by lane, a row length that
leaves the lanes uneven), fusing and dequantising a packed matrix, what is refused, when the
lean runner packs, and its logits bit for bit those of the unpacked weights on the real
default model (packed on every CPU: where the wide kernel does not run the decoder unpacks a
group at a time, so the comparison holds everywhere)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kvpark._core as _core
import kvpark.runner.lean_runner as lean_runner
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.model.block_packing import PACK, pack_position
from kvpark.model.gguf_blocks import Blocks
from kvpark.runner.packed_blocks import packed, packed_kinds
from kvpark.sched.plan import StepItem, StepPlan


def q4(rows: int, blocks: int, seed: int) -> Blocks:
    rng = np.random.default_rng(seed)
    qs = rng.integers(0, 256, (rows, blocks * 16), dtype=np.uint8)
    scale = rng.standard_normal((rows, blocks)).astype(np.float32)
    offset = rng.standard_normal((rows, blocks)).astype(np.float32)
    return Blocks("q4", qs, scale, offset)


def q6(rows: int, blocks: int, seed: int) -> Blocks:
    """A "q6" matrix as the loader makes one from Q6_K: quants in -32..32, each row's scales per
    256 weights an f16 ``d`` (either sign) times int8s, the extremes -128 and 127 among them."""
    rng = np.random.default_rng(seed)
    qs = rng.integers(-32, 32, (rows, blocks * 32), dtype=np.int8)
    supers = -(-blocks // 8)
    d = rng.standard_normal((rows, supers, 1)).astype(np.float16).astype(np.float32)
    sc = rng.integers(-128, 128, (rows, supers, 16)).astype(np.float32)
    sc[:, :, :2] = [-128, 127]
    scale = (d * sc).reshape(rows, -1)[:, : 2 * blocks]  # exact products
    return Blocks("q6", qs, np.ascontiguousarray(scale), None)


def q5k(rows: int, blocks: int, seed: int) -> Blocks:
    """A "q8" matrix as the loader makes one from Q5_K: quants 0..32, each row's scales per 256
    weights an f16 ``d`` times 6-bit ints, its offsets ``-(dmin * m)`` likewise."""
    rng = np.random.default_rng(seed)
    qs = rng.integers(0, 32, (rows, blocks * 32), dtype=np.int8)
    supers = -(-blocks // 8)
    d, dmin = (np.abs(rng.standard_normal((2, rows, supers, 1))) / 64).astype(np.float16)
    sc, m = rng.integers(0, 64, (2, rows, supers, 8)).astype(np.float32)
    scale = (d.astype(np.float32) * sc).reshape(rows, -1)[:, :blocks]  # exact products
    offset = -(dmin.astype(np.float32) * m).reshape(rows, -1)[:, :blocks]
    return Blocks("q8", qs, np.ascontiguousarray(scale), np.ascontiguousarray(offset))


def q5(rows: int, blocks: int, seed: int, offsets: bool) -> Blocks:
    """A "q8" matrix as the loader makes one from Q5_1 (``offsets``: quants 0..32, an f16 scale
    and min a block) or Q5_0 (quants -16..16, an f16 scale a block)."""
    rng = np.random.default_rng(seed)
    low = 0 if offsets else -16
    qs = rng.integers(low, low + 32, (rows, blocks * 32), dtype=np.int8)
    qs[0, :2] = [low, low + 31]  # both ends of the window
    scale, offset = rng.standard_normal((2, rows, blocks)).astype(np.float16).astype(np.float32)
    return Blocks("q8", qs, scale, offset if offsets else None)


def q5_0(rows: int, blocks: int, seed: int) -> Blocks:
    return q5(rows, blocks, seed, offsets=False)


def q5_1(rows: int, blocks: int, seed: int) -> Blocks:
    return q5(rows, blocks, seed, offsets=True)


# each maker: the packed kind, bytes a row's block and run of 8 blocks take packed, and the
# values a block beside them (q4, q5b: its scale and offset as the row layout's)
MAKERS = {
    "q4": (q4, "q4p", 24, 0),
    "q6": (q6, "q6p", 26, 4),
    "q5k": (q5k, "q5p", 22, 8),
    "q5_0": (q5_0, "q5b", 24, 0),
    "q5_1": (q5_1, "q5b", 28, 0),
}


@pytest.mark.parametrize("maker", list(MAKERS))
@pytest.mark.parametrize("blocks", [1, 8, 13, 64])
def test_packing_round_trips_and_moves_every_block(maker: str, blocks: int) -> None:
    make, packed_kind, block_bytes, run_bytes = MAKERS[maker]
    if maker == "q5_1" and blocks == 1:
        # one block a row: its scale and offset are one f32 times an int8 each, trivially, so
        # the more compact form takes it
        packed_kind, block_bytes, run_bytes = MAKERS["q5k"][1:]
    m = make(48, blocks, blocks)
    kind = m.kind
    p = m.packed()
    assert p.kind == packed_kind and p.shape == m.shape
    # q4 as it was; q6 and q5 compact (the row layout: 40 bytes a block)
    assert p.nbytes == 48 * (block_bytes * blocks + run_bytes * -(-blocks // 8))
    if blocks > 1:  # another order: not the same bytes in place
        assert not np.array_equal(p.qs, m.qs)
    back = p.unpacked()
    assert back.kind == kind and (back.offset is None) == (m.offset is None)
    for a, b in ((back.qs, m.qs), (back.scale, m.scale)):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # type: ignore[arg-type]
    if m.offset is not None:
        assert back.offset is not None and np.array_equal(back.offset, m.offset)
    assert np.array_equal(p.dequantize(), m.dequantize())
    index = np.array([47, 0, 16, 3])
    assert np.array_equal(p.rows(index).dequantize(), m.rows(index).dequantize())
    # row 17's block 0 sits in group 1, at position 0, column 1 of each quad vector (q6: the
    # low four bits of its quants plus 32, in the first vector)
    flat = p.qs.reshape(-1)
    if kind == "q4":
        at = (blocks * 4 * PACK + 1) * 4
        assert np.array_equal(flat[at : at + 4], m.qs[17, :4])
    else:
        quant_bytes = 20 if packed_kind == "q5b" else block_bytes
        at = blocks * quant_bytes * PACK + 4
        bias = {"q6": 32, "q5_0": 16}.get(maker, 0)  # what the stored quant adds
        want = (m.qs[17, :4].astype(np.int16) + bias) & 15
        assert np.array_equal(flat[at : at + 4] & 15, want)


def test_q6_that_no_k_quant_gave_stays_in_the_row_layout() -> None:
    m = q6(16, 4, 3)
    odd = Blocks("q6", m.qs, m.scale + np.float32(1e-3), None)  # not d times int8s
    with pytest.raises(ValueError, match="int8"):
        odd.packed()
    assert packed(odd, frozenset({"q6"})) is odd
    assert packed(m, frozenset({"q6"})).kind == "q6p"


def test_q8_blocks_pack_by_what_their_file_held() -> None:
    m = q5k(16, 9, 5)
    assert packed(m, frozenset({"q8"})).kind == "q5p"  # Q5_K's: int8s times a d per 256
    # Q5_1's: an f16 scale and min a block, no d per 256 weights: five bits, values a block
    rng = np.random.default_rng(2)
    f16 = rng.standard_normal(m.scale.shape).astype(np.float16).astype(np.float32)
    assert packed(Blocks("q8", m.qs, f16, m.offset), frozenset({"q8"})).kind == "q5b"
    assert packed(q5_0(16, 9, 6), frozenset({"q8"})).kind == "q5b"
    # Q8_0's (the full range), and quants outside the five bits a kind's window allows, stay
    full = rng.integers(-128, 128, m.qs.shape, dtype=np.int8)
    for odd in (Blocks("q8", full, f16, None), Blocks("q8", m.qs, f16, None)):
        with pytest.raises(ValueError, match="only"):
            odd.packed()
        assert packed(odd, frozenset({"q8"})) is odd
    assert packed(q5_0(16, 9, 6), frozenset({"q4", "q6"})).kind == "q8"  # not asked for


def test_q5_0_and_q5_1_packed_parts_fuse_in_the_row_layout() -> None:
    """A fused matrix of a Q5_0 part and a Q5_1 one, each packed "q5b" as read: their quants
    are stored less -16 and less 0, so they fuse unpacked (Q8_0 beside Q5_1 would too)."""
    a, b = q5_0(16, 9, 7), q5_1(32, 9, 8)
    fused = Blocks.cat([a.packed(), b.packed()])
    assert fused.kind == "q8" and fused.offset is not None
    want = np.concatenate([a.dequantize(), b.dequantize()])
    assert np.array_equal(fused.dequantize(), want)
    same = Blocks.cat([a.packed(), q5_0(16, 9, 9).packed()])  # both Q5_0's: stays packed
    assert same.kind == "q5b" and same.offset is None


def test_positions_go_lane_by_lane() -> None:
    at = pack_position(19)  # lanes 0-2 hold three blocks, the others two
    assert list(np.argsort(at)) == [
        0,
        8,
        16,
        1,
        9,
        17,
        2,
        10,
        18,
        3,
        11,
        4,
        12,
        5,
        13,
        6,
        14,
        7,
        15,
    ]


def test_packed_parts_fuse_as_the_packed_whole() -> None:
    a, b = q4(32, 5, 1), q4(16, 5, 2)
    fused = Blocks.cat([a.packed(), b.packed()])
    assert np.array_equal(fused.unpacked().qs, Blocks.cat([a, b]).qs)


def test_what_cannot_be_packed_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        q4(24, 2, 0).packed()
    q8 = Blocks("q8", np.full((16, 64), 16, np.int8), np.ones((16, 2), np.float32), None)
    with pytest.raises(ValueError, match=r"q8 quants in -16\.\.16 only"):
        q8.packed()  # no offsets, so Q5_0's window; 16 lies outside it
    with pytest.raises(ValueError, match="q4p"):
        q4(16, 2, 0).packed().packed()


def test_packing_follows_the_switch_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    isa = _core._cpu_features()[1]
    want = {"q4", "q6", "q8"} if isa["isa"] != "plain" else set()
    assert packed_kinds() == want
    monkeypatch.setenv("KVPARK_CPU_PACK", "off")
    assert packed_kinds() == frozenset()
    monkeypatch.setenv("KVPARK_CPU_PACK", "maybe")
    with pytest.raises(ValueError, match="not a boolean"):
        packed_kinds()
    monkeypatch.setenv("KVPARK_CPU_PACK", "on")
    monkeypatch.setenv("KVPARK_CPU_SIDE_BY_SIDE", "off")
    assert packed_kinds() == frozenset()  # the kernels that read it are off
    monkeypatch.delenv("KVPARK_CPU_SIDE_BY_SIDE")
    monkeypatch.setenv("KVPARK_CPU_WIDE", "off")
    assert packed_kinds() == (frozenset({"q4"}) if want else frozenset())
    monkeypatch.delenv("KVPARK_CPU_WIDE")
    # the ISA cap is read once a process: AVX2 packs all three, the portable kernel nothing
    code = "from kvpark.runner.packed_blocks import packed_kinds; print(sorted(packed_kinds()))"
    for cap, kinds in (("avx2", "['q4', 'q6', 'q8']"), ("plain", "[]")):
        env = {**os.environ, "KVPARK_CPU_ISA": cap}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.stdout.strip() == kinds, run.stderr


@pytest.mark.parametrize("block_dot", ["int8", "float32"])
def test_the_default_models_logits_are_the_unpacked_ones_bits(
    monkeypatch: pytest.MonkeyPatch, block_dot: str
) -> None:
    logits = {}
    for pack in (True, False):
        kinds = frozenset({"q4", "q6", "q8"} if pack else ())
        monkeypatch.setattr(lean_runner, "packed_kinds", lambda kinds=kinds: kinds)
        model = ModelConfig(threads=2, block_dot=block_dot)
        r = lean_runner.LeanCpuRunner.load(
            EngineConfig(model=model, pool=PoolConfig(kv_cells=64, page_size=16))
        )
        kinds = {m.kind for m in r.weights.layers[0].matrices.values()}  # type: ignore[union-attr]
        assert kinds == ({"q4p"} if pack else {"q4"})
        assert r.weights.embed.kind == "q8"  # type: ignore[union-attr]  # Q8_0: as it is
        tokens = r.tokenizer.encode("The ocean is deep and the sky is")
        # a chunk of rows, then one row: the wide kernel's tiles and its one-row case
        first = StepPlan([StepItem(0, 0, tokens, True)], list(range(len(tokens))), [[0]])
        after = StepPlan([StepItem(0, len(tokens), [11], True)], [len(tokens)], [[0]])
        logits[pack] = np.stack([r.execute(first)[0], r.execute(after)[0]])
    assert np.isfinite(logits[True]).all()
    assert logits[True].tobytes() == logits[False].tobytes()


def test_the_lean_runner_packs_each_matrix_as_it_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak memory of a load is the packed model plus one matrix in the file's form: each
    block matrix is packed before the next tensor is read (a q6 one takes 10 bits a weight
    unpacked, 6.5 packed)."""
    import kvpark.model.gguf_tensors as gguf_tensors

    log: list[str] = []
    read, pack = gguf_tensors.read_tensor, lean_runner.packed_blocks

    def reading(*args: object, **kw: object) -> object:
        value = read(*args, **kw)  # type: ignore[arg-type]
        log.append("read blocks" if isinstance(value, Blocks) else "read")
        return value

    def packing(m: Blocks, kinds: frozenset[str]) -> Blocks:
        log.append("kept")
        return pack(m, kinds)

    monkeypatch.setattr(gguf_tensors, "read_tensor", reading)
    monkeypatch.setattr(lean_runner, "packed_blocks", packing)
    r = lean_runner.LeanCpuRunner.load(
        EngineConfig(model=ModelConfig(threads=2), pool=PoolConfig(kv_cells=64, page_size=16))
    )
    blocks = [i for i, what in enumerate(log) if what == "read blocks"]
    assert len(blocks) > 100  # the default model's 211 block matrices
    assert all(log[i + 1] == "kept" for i in blocks)
    if packed_kinds():
        kinds = {m.kind for m in r.weights.layers[0].matrices.values()}  # type: ignore[union-attr]
        assert kinds == {"q4p"}
