"""The CPU's paths (cpu_paths.py): a fixed rule on the CPU's flags, the KVPARK_CPU_ISA switch that
narrows them, and the rule's first numeric condition: every path this CPU can run gives the plain
path's bits (test_cpu_path_greedy.py holds the others: a prompt path is only a default where its
greedy tokens equal float32's, a 16-bit KV pool where it agrees with the reference of the
arithmetic in force, the float32 pool or llama.cpp, at least as well as the float32 pool does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvpark import _core
from kvpark.runner.cpu_paths import KV_DTYPE_NAMES, PROMPT_MIN_ROWS, choose

AVX512_BF16 = {"isa": "avx512", "avx2": True, "avx512f": True, "avx512_bf16": True}
AVX512 = {"isa": "avx512", "avx2": True, "avx512f": True, "avx512_bf16": False}
AVX2 = {"isa": "avx2", "avx2": True, "avx512f": False, "avx512_bf16": False}
PLAIN = {"isa": "plain", "avx2": False, "avx512f": False, "avx512_bf16": False}


@pytest.mark.parametrize(
    "features", [AVX512_BF16, AVX512, AVX2, PLAIN], ids=["avx512-bf16", "avx512", "avx2", "plain"]
)
def test_the_rule_on_each_cpu_family(features: dict[str, bool | str]) -> None:
    """One CPU stack: every family multiplies the GGUF's blocks (plain Rust without AVX2), and
    prompt chunks stay on them unless a dense prompt GEMM is asked for."""
    blocks = True
    paths = choose(features)
    assert paths.dtype == "float32"  # bf16 decode fails the greedy rule everywhere
    assert paths.blocks == blocks
    assert paths.block_dot == "int8"  # llama.cpp's arithmetic wherever there are blocks
    assert paths.prompt_dtype is None  # int8 prompt rows too; dense weights are dense already
    # the pool rule (test_cpu_path_greedy.py): f16 cells under int8 activations, where they
    # agree with llama.cpp at least as well as float32 cells do; bf16 under float32 ones
    assert paths.kv_dtype == "float16"
    exact = choose(features, exact=True)
    assert exact.blocks == blocks and exact.prompt_dtype is None  # one arithmetic
    assert exact.kv_dtype == paths.kv_dtype and exact.block_dot == "int8"
    as_before = choose(features, block_dot="float32")  # float32 activations against the blocks
    assert as_before.prompt_dtype is None and as_before.kv_dtype == "bfloat16"
    assert choose(features, block_dot="float32", prompt_path="same").prompt_dtype is None
    assert choose(features, prompt_path="float32").prompt_dtype == ("float32" if blocks else None)
    assert choose(features, kv_dtype="f32").kv_dtype == "float32"  # the float32 pool, asked for
    assert choose(features, kv_dtype="f16").describe()["kv_dtype"] == "float16"
    shown = paths.describe()
    assert shown["isa"] == features["isa"] and shown["kv_dtype"] == paths.kv_dtype
    assert shown["prompt_min_rows"] is None
    assert as_before.describe()["prompt_min_rows"] is None
    assert choose(features, prompt_path="float32").describe()["prompt_min_rows"] == PROMPT_MIN_ROWS
    assert choose(features, weights="dense").blocks is False  # asked for: the torch runner


def test_explicit_choices_win_or_are_refused() -> None:
    assert choose(AVX2, dtype="bfloat16").blocks is False  # bf16 activations: dense weights
    assert choose(AVX2, weights="dense").prompt_dtype is None
    assert choose(AVX2, prompt_path="bfloat16").prompt_dtype == "bfloat16"
    assert choose(PLAIN, weights="blocks").blocks is True
    with pytest.raises(ValueError, match="float32"):
        choose(AVX2, dtype="bfloat16", weights="blocks")
    with pytest.raises(ValueError, match="exact mode"):
        choose(AVX2, prompt_path="float32", exact=True)
    with pytest.raises(ValueError, match="prompt path"):
        choose(AVX2, prompt_path="fast")
    assert choose(AVX2).block_dot == "int8"  # llama.cpp's arithmetic (test_llamacpp_greedy)
    assert choose(AVX2, block_dot="float32").block_dot == "float32"
    assert choose(AVX2).describe()["block_dot"] == "int8"
    assert choose(PLAIN, weights="dense").describe()["block_dot"] is None  # no blocks
    with pytest.raises(ValueError, match="block dot"):
        choose(AVX2, block_dot="int4")
    with pytest.raises(ValueError, match="KV dtype"):
        choose(AVX2, kv_dtype="int8")
    assert choose(AVX2, dtype="float16").kv_dtype == "float16"  # a float16 model's own cells


@pytest.mark.parametrize(
    "features", [AVX512_BF16, AVX512, AVX2, PLAIN], ids=["avx512-bf16", "avx512", "avx2", "plain"]
)
def test_bf16_matrices_take_bf16_activations_where_the_cpu_multiplies_them(
    features: dict[str, bool | str],
) -> None:
    """Under the int8 dot, BF16 matrices take bf16 activations on AVX-512 BF16 (vdpbf16ps, as
    llama.cpp multiplies them), float32 ones elsewhere; ``--block-dot float32`` is the off
    switch. The decoder's dot, /props and the start-up line say which."""
    native = features is AVX512_BF16
    paths = choose(features)
    assert paths.dense_dot == ("bf16" if native else "float32")
    assert paths.decoder_dot == ("int8+bf16" if native else "int8")
    assert paths.describe()["bf16_dot"] == paths.dense_dot
    assert ("bf16 matrices by bf16 activations" in paths.summary()) == native
    assert choose(features, exact=True).dense_dot == paths.dense_dot  # row-invariant too
    off = choose(features, block_dot="float32")
    assert (off.dense_dot, off.decoder_dot) == ("float32", "float32")
    # KVPARK_CPU_ISA=avx2 on the same CPU: the capped flags decide
    capped = {**features, "isa": "avx2"} if native else features
    assert choose(capped).dense_dot == ("float32" if native else paths.dense_dot)


@pytest.mark.parametrize(
    ("spellings", "name"),
    [
        (("f32", "float32"), "float32"),
        (("bf16", "bfloat16"), "bfloat16"),
        (("f16", "float16"), "float16"),
    ],
)
def test_each_kv_dtype_has_a_short_and_a_long_spelling(
    spellings: tuple[str, str], name: str
) -> None:
    for spelt in spellings:
        assert KV_DTYPE_NAMES[spelt] == name
        assert choose(AVX2, kv_dtype=spelt).kv_dtype == name
        assert choose(PLAIN, kv_dtype=spelt).describe()["kv_dtype"] == name
    assert set(KV_DTYPE_NAMES) == {"auto", "f32", "bf16", "f16", "float32", "bfloat16", "float16"}


def features_under(cap: str) -> dict[str, object]:
    code = "import json; from kvpark import _core; print(json.dumps(_core._cpu_features()))"
    env = {**os.environ, "KVPARK_CPU_ISA": cap}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    cpu, effective = json.loads(done.stdout)
    assert cpu == _core._cpu_features()[0]  # the cap never changes what the CPU has
    return dict(effective)


def test_the_switch_narrows_the_kernels_isa() -> None:
    assert features_under("plain")["isa"] == "plain"
    assert features_under("plain")["avx2"] is False
    capped = features_under("avx2")
    assert capped["isa"] in ("avx2", "plain") and capped["avx512f"] is False
    assert features_under("auto") == _core._cpu_features()[0]
    bad = subprocess.run(
        [sys.executable, "-c", "from kvpark import _core; _core._cpu_features()"],
        env={**os.environ, "KVPARK_CPU_ISA": "sse9"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "KVPARK_CPU_ISA" in bad.stderr


# the inputs come from the parent: under a cap, torch's own kernels (its random numbers too) run
# other code, and only the block kernel's output is being compared
PRODUCT = """
import sys, torch
from kvpark.model.ops.block_weights import BlockWeight, block_linear
raw, x = torch.load(sys.argv[1])
w = BlockWeight.from_gguf(3, raw.view(-1), (96, 128))
torch.save(block_linear(x, w), sys.argv[2])
"""
# decode attention on each kind of pool (the f16 one widened by F16C or by plain Rust)
ATTEND = """
import sys, torch
from kvpark.model.ops import cpu_attention
q, pools, cells = torch.load(sys.argv[1])
p = cpu_attention.plan(cells, [0, 1, 2], [30, 7, 19], [2, 0, 1])
outs = []
for k, v in pools:
    out = torch.zeros_like(q)
    cpu_attention.decode(q, k, v, p, out)
    outs.append(out)
torch.save(outs, sys.argv[2])
"""


def test_every_path_this_cpu_runs_gives_the_plain_bits(tmp_path: os.PathLike[str]) -> None:
    levels = ["plain", "avx2", "avx512"]
    runnable = levels[: levels.index(str(_core._cpu_features()[0]["isa"])) + 1]
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (96 * 128 // 32, 20), dtype=torch.uint8, generator=g)
    raw[:, 0:4] = torch.tensor([0, 0x2C, 0, 0xAC], dtype=torch.uint8)  # scale 1/16, offset -1/16
    inputs = f"{tmp_path}/inputs.pt"
    torch.save((raw, torch.randn(11, 128, generator=g)), inputs)
    k, v = torch.randn(2, 8, 16, 3, 64, generator=g).unbind()  # [pages, page, kv_heads, d]
    pools = [(k.to(dt), v.to(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    cells = torch.randperm(128, generator=g)[:90].view(3, 30)
    attend_inputs = f"{tmp_path}/attend.pt"
    torch.save((torch.randn(3, 9, 64, generator=g), pools, cells), attend_inputs)
    results = {}
    for cap in runnable:
        env = {**os.environ, "KVPARK_CPU_ISA": cap}
        for what, code, given in (
            ("product", PRODUCT, inputs),
            ("attend", ATTEND, attend_inputs),
        ):
            out = f"{tmp_path}/{what}-{cap}.pt"
            done = subprocess.run(
                [sys.executable, "-c", code, given, out], env=env, capture_output=True, timeout=120
            )
            assert done.returncode == 0, done.stderr.decode()
            results[what, cap] = torch.load(out)
    for (what, cap), got in results.items():
        plain = results[what, "plain"]
        if what == "product":
            assert torch.equal(got, plain), cap
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True)), cap
            assert all(o.abs().sum() > 0 for o in got)
