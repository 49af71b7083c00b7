"""4-bit matrices packed for the CPU decoder (runner/packed_blocks.py, ``Blocks`` kind "q4p"):
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
from kvpark.model.gguf_blocks import PACK, Blocks, pack_position
from kvpark.runner.packed_blocks import packed_kinds
from kvpark.sched.plan import StepItem, StepPlan


def q4(rows: int, blocks: int, seed: int) -> Blocks:
    rng = np.random.default_rng(seed)
    qs = rng.integers(0, 256, (rows, blocks * 16), dtype=np.uint8)
    scale = rng.standard_normal((rows, blocks)).astype(np.float32)
    offset = rng.standard_normal((rows, blocks)).astype(np.float32)
    return Blocks("q4", qs, scale, offset)


def q6(rows: int, blocks: int, seed: int) -> Blocks:
    rng = np.random.default_rng(seed)
    qs = rng.integers(-32, 32, (rows, blocks * 32), dtype=np.int8)
    scale = rng.standard_normal((rows, 2 * blocks)).astype(np.float32)
    return Blocks("q6", qs, scale, None)


@pytest.mark.parametrize("kind", ["q4", "q6"])
@pytest.mark.parametrize("blocks", [1, 8, 13, 64])
def test_packing_round_trips_and_moves_every_block(kind: str, blocks: int) -> None:
    m = (q4 if kind == "q4" else q6)(48, blocks, blocks)
    p = m.packed()
    assert p.kind == kind + "p" and p.shape == m.shape and p.nbytes == m.nbytes
    if blocks > 1:  # another order: not the same bytes in place
        assert not np.array_equal(p.qs, m.qs)
    back = p.unpacked()
    assert back.kind == kind and (back.offset is None) == (kind == "q6")
    for a, b in ((back.qs, m.qs), (back.scale, m.scale)):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # type: ignore[arg-type]
    if m.offset is not None:
        assert back.offset is not None and np.array_equal(back.offset, m.offset)
    assert np.array_equal(p.dequantize(), m.dequantize())
    index = np.array([47, 0, 16, 3])
    assert np.array_equal(p.rows(index).dequantize(), m.rows(index).dequantize())
    # row 17's block 0 sits in group 1, at position 0, column 1 of each quad vector
    quads = 4 if kind == "q4" else 8
    at = (blocks * quads * PACK + 1) * 4
    assert np.array_equal(p.qs.reshape(-1)[at : at + 4], m.qs[17, :4])


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
    q8 = Blocks("q8", np.zeros((16, 64), np.int8), np.ones((16, 2), np.float32), None)
    with pytest.raises(ValueError, match="q8"):
        q8.packed()
    with pytest.raises(ValueError, match="q4p"):
        q4(16, 2, 0).packed().packed()


def test_packing_follows_the_switch_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    isa = _core._cpu_features()[1]
    want = {"q4", "q6"} if isa["isa"] != "plain" else set()
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
    # the ISA cap is read once a process: AVX2 packs both, the portable kernel nothing
    code = "from kvpark.runner.packed_blocks import packed_kinds; print(sorted(packed_kinds()))"
    for cap, kinds in (("avx2", "['q4', 'q6']"), ("plain", "[]")):
        env = {**os.environ, "KVPARK_CPU_ISA": cap}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.stdout.strip() == kinds, run.stderr


@pytest.mark.parametrize("block_dot", ["int8", "float32"])
def test_the_default_models_logits_are_the_unpacked_ones_bits(
    monkeypatch: pytest.MonkeyPatch, block_dot: str
) -> None:
    logits = {}
    for pack in (True, False):
        kinds = frozenset({"q4", "q6"} if pack else ())
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
