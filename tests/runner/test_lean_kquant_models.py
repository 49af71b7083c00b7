"""The lean runner over a Q4_K_M-like GGUF: Q4_K attention and gate/up, Q6_K down and head (the
types llama.cpp's Q4_K_M gives most of a model), a Q8_0 embedding and F32 norms, all in the Rust
decoder's blocks (Q6_K as its own kind, int8 with a scale per 16), no torch.

Its logits are checked against a float64 forward of the dequantised weights within the derived
bound of tests/support/lean_reference.py (float32 activations against the blocks, whose expanded
weights are the dequantised ones exactly), its greedy tokens against the float64 forward's where
the margin exceeds the bound, and exact mode's rows against themselves beside other rows and in
chunks, under both block dots. The int8 dot's bound is the kernels' (rust/cpu_ops/tests).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import kvpark.runner.lean_runner as lean_runner
from kvpark.model import gguf_tensors
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.gguf_file import GgufFile
from kvpark.model.iq4_blocks import iq4_blocks
from kvpark.model.numpy_weights import load_numpy_weights
from kvpark.model.weight_arrays import Stacked
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.tokenizer.tokenizer import Tokenizer
from support import tiny_gguf
from support.kquants import quantised_kquant
from support.lean_reference import alone_and_beside_others, check_logits, config, greedy
from support.tiny_gguf import write_tiny

Q4_K_M = dict(attn=Q.Q4_K, mlp=Q.Q4_K, down=Q.Q6_K, head=Q.Q6_K, embed=Q.Q8_0)
KINDS = {"qkv_w": "q4", "o_w": "q4", "gate_up_w": "q4", "down_w": "q6"}


def kind_of(m: object) -> str | None:
    """A matrix's block kind as the file gave it: "q4p" / "q6p" / "q5p" / "q5b" (packed by the
    runner where the CPU has AVX2 or AVX-512 VNNI, runner/packed_blocks.py) as "q4" / "q6" /
    "q8"."""
    kind = getattr(m, "kind", None)
    return {"q4p": "q4", "q6p": "q6", "q5p": "q8", "q5b": "q8"}.get(kind, kind) if kind else kind


# the default model's Q4_K_M as llama-quantize writes it: rows of 576 take Q5_0 (no K-quant
# fits them), the 1536-wide down Q6_K or Q4_K; Q5_1 for gate/up as its Q5_K_M has them
SMALL_ROWS_K_M = dict(attn=Q.Q5_0, mlp=Q.Q5_1, down=Q.Q6_K, head=Q.Q5_0, embed=Q.Q8_0)
# a Q6_K embedding tied to the head: rows looked up from the q6 blocks, the head multiplies them
Q6_K_TIED = dict(attn=Q.Q5_K, mlp=Q.Q6_K, embed=Q.Q6_K)


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GgufFile(default_gguf_path).metadata)


@pytest.fixture(autouse=True)
def model_like_k_quants(monkeypatch: pytest.MonkeyPatch) -> None:
    """The K-quant matrices of these files quantised from a model's magnitudes, not random
    bytes (whose weights reach ~40: every gate saturates silu, every softmax is one-hot)."""
    monkeypatch.setattr(tiny_gguf, "random_kquant", quantised_kquant)


@pytest.fixture
def q4_k_m(tmp_path: Path) -> Path:
    path = tmp_path / "q4_k_m.gguf"
    write_tiny(path, "llama", **Q4_K_M)  # type: ignore[arg-type]
    return path


def runner(path: Path, tokenizer: Tokenizer, **options: object) -> LeanCpuRunner:
    """The lean runner over the file's weights (the tiny GGUFs carry no tokenizer)."""
    c = config(str(path), kv_dtype="float32", **options)
    return LeanCpuRunner(c.model, c.pool, load_numpy_weights(GgufFile(str(path))), tokenizer, "t")


def test_a_q4_k_m_file_runs_lean_as_its_float64_forward(q4_k_m: Path, tokenizer: Tokenizer) -> None:
    r = runner(q4_k_m, tokenizer, block_dot="float32")
    assert r.cpu_paths.weights == "blocks"
    for layer in r.weights.layers:
        assert {attr: kind_of(m) for attr, m in layer.matrices.items()} == KINDS
    head, embed = r.weights.head, r.weights.embed
    assert isinstance(head, Blocks) and kind_of(head) == "q6" and head.offset is None
    assert isinstance(embed, Blocks) and embed.kind == "q8"
    row = head.unpacked() if head.kind == "q6p" else head
    assert row.scale.shape == (head.shape[0], head.shape[1] // 16)  # a scale per 16 weights
    check_logits(r)


@pytest.mark.parametrize("block_dot", ["int8", "float32"])
def test_a_q4_k_m_files_packed_matrices_give_the_unpacked_ones_bits(
    q4_k_m: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, block_dot: str
) -> None:
    """Its Q4_K and Q6_K matrices packed at load (runner/packed_blocks.py: forced here, so the
    CPUs whose kernels do not read the packed layout run the unpacking path) or left as the
    file has them: the same greedy tokens and logits, bit for bit, over a chunk and single rows.
    """
    out = {}
    for pack in (True, False):
        kinds = frozenset({"q4", "q6"} if pack else ())
        monkeypatch.setattr(lean_runner, "packed_kinds", lambda kinds=kinds: kinds)
        r = runner(q4_k_m, tokenizer, block_dot=block_dot)
        kinds = {m.kind for m in r.weights.layers[0].matrices.values()}  # type: ignore[union-attr]
        assert kinds == ({"q4p", "q6p"} if pack else {"q4", "q6"})
        assert r.weights.head.kind == ("q6p" if pack else "q6")  # type: ignore[union-attr]
        out[pack] = greedy(r)
    assert out[True][0] == out[False][0]
    assert out[True][1].tobytes() == out[False][1].tobytes()


@pytest.mark.parametrize("block_dot", ["int8", "float32"])
def test_q5_k_and_a_tied_q6_k_embedding_packed_give_the_unpacked_bits(
    tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, block_dot: str
) -> None:
    """Q5_K attention (q8 blocks packed compact, "q5p"), Q6_K gate/up and a tied Q6_K embedding
    (its rows looked up in the packed blocks) packed or not: the same tokens and logits."""
    path = tmp_path / "q6_k.gguf"
    write_tiny(path, "llama", **Q6_K_TIED)  # type: ignore[arg-type]
    out = {}
    for pack in (True, False):
        kinds = frozenset({"q4", "q6", "q8"} if pack else ())
        monkeypatch.setattr(lean_runner, "packed_kinds", lambda kinds=kinds: kinds)
        r = runner(path, tokenizer, block_dot=block_dot)
        layer = r.weights.layers[0].matrices
        assert layer["gate_up_w"].kind == ("q6p" if pack else "q6")  # type: ignore[union-attr]
        assert r.weights.embed.kind == ("q6p" if pack else "q6")  # type: ignore[union-attr]
        fused = layer["qkv_w"]  # Q5_K's Q, K and V
        assert fused.kind == ("q5p" if pack else "q8")  # type: ignore[union-attr]
        out[pack] = greedy(r)
    assert out[True][0] == out[False][0]
    assert out[True][1].tobytes() == out[False][1].tobytes()


def test_q5_0_and_q5_1_matrices_run_lean_as_their_float64_forward(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "small_rows_k_m.gguf"
    write_tiny(path, "llama", **SMALL_ROWS_K_M)  # type: ignore[arg-type]
    for dot in ("float32", "int8"):
        r = runner(path, tokenizer, block_dot=dot)
        layer = r.weights.layers[0].matrices
        assert {attr: kind_of(m) for attr, m in layer.items()} == {
            "qkv_w": "q8", "o_w": "q8", "gate_up_w": "q8", "down_w": "q6",
        }  # fmt: skip
        assert layer["qkv_w"].offset is None and layer["gate_up_w"].offset is not None  # type: ignore[union-attr]
        if dot == "float32":
            check_logits(r)
    alone, beside = alone_and_beside_others(runner(path, tokenizer, exact=True))
    assert np.all(np.isfinite(alone)) and np.array_equal(beside, alone)


@pytest.mark.parametrize("block_dot", ["int8", "float32"])
def test_q5_0_and_q5_1_matrices_packed_give_the_unpacked_bits(
    tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, block_dot: str
) -> None:
    """Q5_0 attention and head, Q5_1 gate/up (q8 blocks packed compact with their scales a
    block, "q5b") packed or not: the same tokens and logits, bit for bit."""
    path = tmp_path / "small_rows_k_m.gguf"
    write_tiny(path, "llama", **SMALL_ROWS_K_M)  # type: ignore[arg-type]
    out = {}
    for pack in (True, False):
        kinds = frozenset({"q4", "q6", "q8"} if pack else ())
        monkeypatch.setattr(lean_runner, "packed_kinds", lambda kinds=kinds: kinds)
        r = runner(path, tokenizer, block_dot=block_dot)
        layer = r.weights.layers[0].matrices
        for name in ("qkv_w", "o_w", "gate_up_w"):
            assert layer[name].kind == ("q5b" if pack else "q8")  # type: ignore[union-attr]
        assert r.weights.head.kind == ("q5b" if pack else "q8")  # type: ignore[union-attr]
        assert layer["gate_up_w"].offset is not None  # type: ignore[union-attr]
        out[pack] = greedy(r)
    assert out[True][0] == out[False][0]
    assert out[True][1].tobytes() == out[False][1].tobytes()


def test_a_tied_q6_k_embedding_runs_lean_as_its_float64_forward(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "q6_k.gguf"
    write_tiny(path, "llama", **Q6_K_TIED)  # type: ignore[arg-type]
    r = runner(path, tokenizer, block_dot="float32")
    assert isinstance(r.weights.embed, Blocks) and kind_of(r.weights.embed) == "q6"
    assert r.weights.head is r.weights.embed and r.head_matrix is r.embed_matrix
    assert kind_of(r.weights.layers[0].matrices["gate_up_w"]) == "q6"
    check_logits(r)


# a Q3_K_M file as llama-quantize writes one: Q3_K attention and gate/up (the q6 kind: int8 -4..3,
# a scale per 16 weights), Q4_K V and down, a Q6_K head
Q3_K_M = dict(attn=Q.Q3_K, v=Q.Q4_K, mlp=Q.Q3_K, down=Q.Q4_K, head=Q.Q6_K, embed=Q.Q8_0)


def test_a_q3_k_m_file_runs_lean_as_its_float64_forward(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "q3_k_m.gguf"
    write_tiny(path, "llama", **Q3_K_M)  # type: ignore[arg-type]
    r = runner(path, tokenizer, block_dot="float32")
    assert r.cpu_paths.weights == "blocks"
    for layer in r.weights.layers:
        ms = layer.matrices
        qkv, gate_up = ms["qkv_w"], ms["gate_up_w"]
        assert isinstance(qkv, Stacked) and isinstance(gate_up, Blocks)
        assert [kind_of(p) for p in qkv.parts] == ["q6", "q6", "q4"]
        assert kind_of(gate_up) == "q6" and kind_of(ms["down_w"]) == "q4"
        rows = gate_up.unpacked() if gate_up.kind == "q6p" else gate_up  # packed compact
        assert int(np.abs(rows.qs.astype(np.int16)).max()) <= 4  # 3-bit quants, -4..3
    check_logits(r)
    for dot in ("int8", "float32"):
        alone, beside = alone_and_beside_others(runner(path, tokenizer, block_dot=dot, exact=True))
        assert np.all(np.isfinite(alone)) and np.array_equal(beside, alone)


@pytest.mark.parametrize("block_dot", ["int8", "float32"])
def test_in_exact_mode_a_q6_k_rows_bits_do_not_depend_on_its_step(
    q4_k_m: Path, tokenizer: Tokenizer, block_dot: str
) -> None:
    r = runner(q4_k_m, tokenizer, block_dot=block_dot, exact=True)
    assert r.row_invariant and r.cpu_paths.describe()["block_dot"] == block_dot
    alone, beside = alone_and_beside_others(r)
    assert np.all(np.isfinite(alone)) and np.array_equal(beside, alone)


# a Q4_K_M file of a bigger model: Q4_K Q and K beside a Q6_K V in one fused Q/K/V, and a
# Q6_K down; and an F16 V beside Q4_0 Q and K (dense beside blocks in one matrix)
MIXED_QKV = {
    "Q6_K V beside Q4_K": dict(attn=Q.Q4_K, v=Q.Q6_K, mlp=Q.Q4_K, down=Q.Q6_K, embed=Q.Q8_0),
    "F16 V beside Q4_0": dict(attn=Q.Q4_0, v=Q.F16, embed=Q.Q8_0),
}


@pytest.mark.parametrize("case", list(MIXED_QKV))
def test_a_fused_matrix_of_two_kinds_runs_lean_part_by_part(
    case: str, tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "mixed.gguf"
    write_tiny(path, "llama", **MIXED_QKV[case])  # type: ignore[arg-type]
    r = runner(path, tokenizer, block_dot="float32")
    assert all(isinstance(ms["qkv_w"], tuple) and len(ms["qkv_w"]) == 3 for ms in r.matrices)
    check_logits(r)
    for dot in ("int8", "float32"):
        alone, beside = alone_and_beside_others(runner(path, tokenizer, block_dot=dot, exact=True))
        assert np.all(np.isfinite(alone)) and np.array_equal(beside, alone)


def test_iq4_nl_and_iq4_xs_matrices_run_lean_as_their_float64_forward(
    tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IQ4_XS attention and down, IQ4_NL gate/up and head: all "iq4" blocks (nibbles into the
    table), within the float64 forward's bound; exact mode's rows alone equal them beside
    others, and bit for bit the rows of the same model read as the q8 blocks they equal (the
    kernels look the table up in registers: one row's kernel of its own, the others on q8
    blocks expanded a few columns at a time)."""
    path = tmp_path / "iq4.gguf"
    write_tiny(
        path, "llama", attn=Q.IQ4_XS, mlp=Q.IQ4_NL, down=Q.IQ4_XS, head=Q.IQ4_NL, embed=Q.Q8_0
    )  # type: ignore[arg-type]
    r = runner(path, tokenizer, block_dot="float32")
    layer = r.weights.layers[0].matrices
    assert {attr: kind_of(m) for attr, m in layer.items()} == {
        "qkv_w": "iq4", "o_w": "iq4", "gate_up_w": "iq4", "down_w": "iq4",
    }  # fmt: skip
    assert isinstance(r.weights.head, Blocks) and r.weights.head.kind == "iq4"
    check_logits(r)
    for dot in ("int8", "float32"):
        alone, beside = alone_and_beside_others(runner(path, tokenizer, block_dot=dot, exact=True))
        assert np.all(np.isfinite(alone)) and np.array_equal(beside, alone)
        with monkeypatch.context() as m:
            m.setattr(gguf_tensors, "iq4_blocks", lambda *args: iq4_blocks(*args).as_q8())
            as_q8 = runner(path, tokenizer, block_dot=dot, exact=True)
            assert as_q8.weights.layers[0].matrices["down_w"].kind == "q8"
            assert np.array_equal(alone_and_beside_others(as_q8)[0], alone)
