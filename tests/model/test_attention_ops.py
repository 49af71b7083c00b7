"""The torch reference ops: paged attention against a float64 per-sequence reference, the KV pool,
rope and RMSNorm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpark.model.arch import RopeScaling
from kvpark.model.ops import KVCache, OpSet, attention
from kvpark.model.ops.attention import paged_attention, prepare
from kvpark.model.ops.cpu_attention import NativeDecode
from kvpark.model.ops.kv_cache import store_kv
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.model.ops.norm import rms_norm
from kvpark.model.ops.rope import RopeTable, apply_rope
from support.attention import PAGE, STEPS, make_step, reference, tiny_arch


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("step", list(STEPS))
def test_paged_attention_matches_reference(
    step: str,
    heads: tuple[int, int],
    dtype: torch.dtype,
    split: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if split:  # every decode sequence in a group of its own
        monkeypatch.setattr(attention, "DECODE_GROUP_BYTES", 1)
    n_heads, n_kv = heads
    arch = tiny_arch(n_heads, n_kv)
    meta, cells = make_step(STEPS[step], n_pages=40, seed=len(step))
    kv = KVCache.allocate(arch, 40, PAGE, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for layer in (kv.k[0], kv.v[0]):  # older cells already hold something
        layer.copy_(torch.randn(layer.shape, generator=g).to(dtype))
    rows = meta.n_rows
    q = torch.randn(rows, n_heads, arch.head_dim, generator=g).to(dtype)
    k_new = torch.randn(rows, n_kv, arch.head_dim, generator=g).to(dtype)
    v_new = torch.randn(rows, n_kv, arch.head_dim, generator=g).to(dtype)
    store_kv(kv.k[0], kv.v[0], meta.slot_mapping, k_new, v_new)
    k_flat = kv.k[0].view(-1, n_kv, arch.head_dim)
    assert torch.equal(k_flat[meta.slot_mapping], k_new)
    got = paged_attention(q, kv.k[0], kv.v[0], prepare(meta, arch, dtype))
    want = reference(q, k_flat, kv.v[0].view(-1, n_kv, arch.head_dim), meta, cells)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == q.shape and got.dtype == dtype
    assert (got.double() - want).abs().max().item() < tol


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("pool", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_16_bit_pool_under_float32_activations_reads_its_values_widened(
    step: str, pool: torch.dtype, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--kv-dtype``: float32 rows are stored rounded as ``.to(pool)`` rounds them, and both the
    Rust decode kernel and the torch path (gather + SDPA, also every prompt row) attend over the
    stored values widened exactly: float32 arithmetic on them, to float32's tolerance."""
    if not native:  # the torch path for decode rows too, as where the kernel cannot run
        monkeypatch.setattr(attention.cpu_attention, "usable", lambda device, dtype: False)
    arch = tiny_arch(6, 2)
    meta, cells = make_step(STEPS[step], n_pages=40, seed=len(step))
    kv = KVCache.allocate(arch, 40, PAGE, pool, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    for layer in (kv.k[0], kv.v[0]):
        layer.copy_(torch.randn(layer.shape, generator=g).to(pool))
    q = torch.randn(meta.n_rows, 6, arch.head_dim, generator=g)
    k_new = torch.randn(meta.n_rows, 2, arch.head_dim, generator=g) * 3
    v_new = torch.randn(meta.n_rows, 2, arch.head_dim, generator=g)
    store_kv(kv.k[0], kv.v[0], meta.slot_mapping, k_new, v_new)
    k_flat, v_flat = kv.k[0].view(-1, 2, arch.head_dim), kv.v[0].view(-1, 2, arch.head_dim)
    assert k_flat.dtype == pool and torch.equal(k_flat[meta.slot_mapping], k_new.to(pool))
    assert not torch.equal(k_flat[meta.slot_mapping].float(), k_new)  # it was rounded
    plan = prepare(meta, arch, pool)
    has_native = any(isinstance(group, NativeDecode) for group in plan.groups)
    assert has_native == (native and any(n == 1 for n, _ in STEPS[step]))
    got = paged_attention(q, kv.k[0], kv.v[0], plan)
    want = reference(q, k_flat.float(), v_flat.float(), meta, cells)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 1e-5


def test_prepare_rejects_rows_beyond_context() -> None:
    meta, _ = make_step([(3, 3)], n_pages=4, seed=0)
    bad = AttentionMetadata(meta.slot_mapping, meta.query_start, [2], meta.cell_index, 3)
    with pytest.raises(ValueError, match="bad step"):
        prepare(bad, tiny_arch(), torch.float32)


def test_kv_cache_pages() -> None:
    arch = tiny_arch()
    kv = KVCache.allocate(arch, 6, PAGE, torch.float32, torch.device("cpu"))
    assert len(kv.k) == len(kv.v) == arch.n_layers
    assert kv.k[0].shape == (6, PAGE, arch.n_kv_heads, arch.head_dim)
    assert kv.bytes_per_cell() == 2 * arch.n_layers * arch.n_kv_heads * arch.head_dim * 4
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in (*kv.k, *kv.v)]
    kv.copy_pages([(1, 4), (2, 5)])
    for old, new in zip(before, (*kv.k, *kv.v), strict=True):
        assert torch.equal(new[4], old[1]) and torch.equal(new[5], old[2])
        assert torch.equal(new[:4], old[:4])
    with pytest.raises(ValueError):
        kv.copy_pages([(0, 6)])
    for half in (torch.bfloat16, torch.float16):
        cells16 = KVCache.allocate(arch, 2, PAGE, half, torch.device("cpu"))
        assert cells16.bytes_per_cell() == kv.bytes_per_cell() // 2


def test_rope_is_neox_rotation() -> None:
    arch = tiny_arch(head_dim=16)
    table = RopeTable.build(arch.inv_freq(), arch.max_position, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 255])
    x = torch.randn(4, 3, 16)
    cos, sin = table.at(positions, torch.float32)
    got = apply_rope(x, cos, sin)
    # Hugging Face's form: x * cos + rotate_half(x) * sin with cos/sin over the doubled frequencies.
    angles = positions[:, None].double() * torch.from_numpy(arch.inv_freq())[None, :]
    c = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    s = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    half = torch.cat((-x[..., 8:], x[..., :8]), -1).double()
    assert torch.allclose(got.double(), x.double() * c + half * s, atol=1e-6)
    assert torch.equal(apply_rope(x[:1], *table.at(positions[:1], torch.float32)), x[:1])  # pos 0
    with pytest.raises(ValueError, match="beyond the rope table"):
        table.at(torch.tensor([256]), torch.float32)


@pytest.mark.parametrize(
    "scaling", [RopeScaling("llama3", 8.0, 1.0, 4.0, 64), RopeScaling("linear", 2.0)]
)
def test_rope_scaling_matches_transformers(scaling: RopeScaling) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    arch = tiny_arch(head_dim=32, rope_scaling=scaling, rope_theta=500000.0)
    params = {"rope_type": scaling.rope_type, "factor": scaling.factor, "rope_theta": 500000.0}
    if scaling.rope_type == "llama3":
        params.update(
            low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        )
    cfg = transformers.LlamaConfig(
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.n_heads,
        head_dim=32,
        rope_parameters=params,
        max_position_embeddings=256,
    )
    theirs, _ = ROPE_INIT_FUNCTIONS[scaling.rope_type](cfg, torch.device("cpu"))
    assert torch.allclose(torch.from_numpy(arch.inv_freq()).float(), theirs, rtol=1e-6)
    assert not np.allclose(arch.inv_freq(), tiny_arch(head_dim=32, rope_theta=500000.0).inv_freq())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype: torch.dtype) -> None:
    x = torch.randn(5, 64).to(dtype)
    w = torch.randn(64).to(dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)
    # both sets' one-call CPU version (row-wise, so exact mode uses it too): the same result
    for ops in (OpSet.default(), OpSet.exact()):
        fast = ops.rms_norm(x, w, 1e-5)
        assert torch.allclose(
            fast.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2
        )
