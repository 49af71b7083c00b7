"""The lean runner over dense models: tiny Hugging Face checkpoints of each variant (Qwen2's
Q/K/V biases and tied head, Qwen3's per-head Q/K norms and head_dim 32, Llama 3's rope scaling;
saved by transformers, tests/model/test_loader.py) in float32 and bfloat16 safetensors, and tiny
F16 and BF16 GGUFs (tests/model/test_numpy_weights.py writes them), each against a float64
forward of the very values the runner holds (bf16 widened exactly, blocks dequantised exactly)
and the checkpoints against transformers' own float32 forward too; the forward and its derived
bound are tests/support/lean_reference.py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import kvpark
from kvpark.engine.props import cpu_paths
from kvpark.model.gguf_file import GgufFile
from kvpark.model.numpy_weights import Unfit, load_numpy_weights
from kvpark.runner.cpu_decoder import Dense
from kvpark.runner.lean_runner import LeanCpuRunner, try_lean
from kvpark.runner.torch_runner import TorchRunner
from kvpark.tokenizer.tokenizer import Tokenizer
from support.lean_reference import (
    CELLS,
    F64,
    NEW,
    PROMPT,
    U,
    alone_and_beside_others,
    budget,
    check_logits,
    config,
    greedy,
    reference,
)
from support.tiny_gguf import write_tiny
from support.tiny_hf import VARIANTS, save_tiny


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GgufFile(default_gguf_path).metadata)


def hf_checkpoint(kind: str, dtype: torch.dtype, tokenizer: Tokenizer, root: Path) -> Path:
    """A tiny random checkpoint of ``kind`` (test_loader.VARIANTS) saved in ``dtype``."""
    torch.set_num_threads(1)
    model = save_tiny(kind, tokenizer, root)
    if dtype != torch.float32:
        model.to(dtype).save_pretrained(str(root))
    return root


def transformers_logits(root: Path, tokens: list[int]) -> F64:
    """transformers' float32 forward of the checkpoint (a bf16 one widened exactly)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32).eval()
    with torch.inference_mode():
        out: F64 = model(torch.tensor([tokens])).logits[0].double().numpy()
    return out


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", list(VARIANTS))
def test_a_hugging_face_checkpoint_runs_lean_as_its_float64_forward(
    kind: str, dtype: torch.dtype, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = hf_checkpoint(kind, dtype, tokenizer, tmp_path)
    # float32 activations: the bound is theirs (under the int8 dot a CPU with AVX-512 BF16
    # multiplies bf16 matrices by bf16 activations: test_decoder_dense.py bounds that)
    r = LeanCpuRunner.load(config(str(root), block_dot="float32"))
    assert r.cpu_paths.weights == "dense" and r.cpu_paths.describe()["block_dot"] is None
    kind_of = "bf16" if dtype == torch.bfloat16 else "f32"
    matrices = [r.embed_matrix, r.head_matrix, *(m for ms in r.matrices for m in ms.values())]
    assert all(isinstance(m, Dense) and m.kind == kind_of for m in matrices)
    # the file's dtype, not a float32 copy: 2 bytes a weight for bf16
    itemsize = 2 if dtype == torch.bfloat16 else 4
    assert r.weights.layers[0].matrices["qkv_w"].dtype.itemsize == itemsize
    assert (r.head_matrix is r.embed_matrix) == r.weights.arch.tie_embeddings
    seq, _ = greedy(r)
    again = LeanCpuRunner.load(config(str(root), block_dot="float32"))
    check_logits(again, transformers_logits(root, seq[:-1]))


GGUF_FILES = {
    "F16, tied": (dict(attn=Q.F16, mlp=Q.F16, embed=Q.F16), "dense"),
    "BF16, untied": (dict(attn=Q.BF16, mlp=Q.BF16, embed=Q.BF16, head=Q.BF16), "dense"),
    "F16 attention and head beside Q8_0 MLP blocks, a Q4_1 embedding": (
        dict(attn=Q.F16, head=Q.F16),
        "blocks and dense",
    ),
}


@pytest.mark.parametrize("case", list(GGUF_FILES))
def test_a_dense_gguf_runs_lean_as_its_float64_forward(
    case: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The tiny GGUFs carry no tokenizer: the runner is built over their weights. Blocks take
    float32 activations here (the bound is float32's; int8's is rust/cpu_ops/tests), and the
    cells are float32 (the default pool is bf16, which rounds K and V)."""
    options, weights = GGUF_FILES[case]
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", **options)  # type: ignore[arg-type]
    c = config(str(path), block_dot="float32", kv_dtype="float32")
    r = LeanCpuRunner(c.model, c.pool, load_numpy_weights(GgufFile(str(path))), tokenizer, "t")
    assert r.cpu_paths.weights == weights
    check_logits(r)


def test_the_embedding_of_a_dense_model_is_its_float64_pooled_hidden_state(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The mean of the final-norm rows, normalised. Each hidden value is within ``ops *
    gamma_k`` of its magnitude (the premise of the logits' bound), the float32 mean adds ``n``
    roundings of the same, and normalising a vector moves it by at most twice its error over
    its length."""
    root = hf_checkpoint("qwen3 (qk norm, head_dim 32)", torch.bfloat16, tokenizer, tmp_path)
    r = LeanCpuRunner.load(config(str(root)))
    got = r.embed(PROMPT)
    hidden, _ = reference(r.weights, PROMPT)
    mean = hidden.mean(axis=0)
    eps = budget(r.weights, len(PROMPT)) + len(PROMPT) * U
    bound = 2 * eps * float(np.linalg.norm(np.abs(hidden).mean(axis=0))) / np.linalg.norm(mean)
    assert got.dtype == np.float32 and got.shape == (r.weights.arch.hidden_size,)
    assert float(np.linalg.norm(got - mean / np.linalg.norm(mean))) <= bound < 1e-2
    assert not np.allclose(r.embed(PROMPT[::-1]), got, atol=1e-2)


def test_in_exact_mode_a_dense_rows_bits_do_not_depend_on_its_step(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = hf_checkpoint("qwen2 (qkv bias, tied)", torch.bfloat16, tokenizer, tmp_path)
    r = LeanCpuRunner.load(config(str(root), exact=True))
    assert r.row_invariant
    alone, beside = alone_and_beside_others(r)
    assert np.array_equal(beside, alone)


def test_auto_serves_a_hugging_face_directory_on_the_lean_runner(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    root = hf_checkpoint("llama3 rope scaling", torch.bfloat16, tokenizer, tmp_path)
    llm = kvpark.LLM(str(root), threads=1, kv_cells=CELLS)
    assert isinstance(llm.engine.runner, LeanCpuRunner)
    shown = cpu_paths(llm.engine)
    assert shown is not None and shown["runner"] == "lean" and shown["weights"] == "dense"
    params = kvpark.SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    assert out.error is None
    seq, _ = greedy(LeanCpuRunner.load(config(str(root), kv_dtype="auto")))  # the same pool
    assert out.choices[0].token_ids == seq[len(PROMPT) :]


def test_what_the_decoder_cannot_run_goes_to_the_torch_runner(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """bf16 activations (``--dtype bfloat16``: the decoder's are float32) and a float64
    checkpoint (no product for F64 values) are refused with the reason; auto runs them in
    torch."""
    torch.set_num_threads(1)
    root = hf_checkpoint("qwen2 (qkv bias, tied)", torch.float64, tokenizer, tmp_path)
    runner, why = try_lean(config(str(root)))
    assert runner is None and why is not None and " is F64, which the decoder" in why
    with pytest.raises(Unfit, match="F64"):
        LeanCpuRunner.load(config(str(root)))
    assert isinstance(kvpark.LLM(str(root), threads=1, kv_cells=CELLS).engine.runner, TorchRunner)
    root = hf_checkpoint("qwen2 (qkv bias, tied)", torch.bfloat16, tokenizer, tmp_path / "bf16")
    runner, why = try_lean(config(str(root), dtype="bfloat16"))
    assert runner is None and why == "its activations are float32, not bfloat16 (--dtype)"
    with pytest.raises(ValueError, match="--runner lean cannot run this model: its activations"):
        kvpark.LLM(str(root), runner="lean", dtype="bfloat16", threads=1, kv_cells=CELLS)
