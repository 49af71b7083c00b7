"""Gemma 2, Gemma 3, Phi-3 and Mistral with its sliding window against transformers, with no
download: tiny random models built from transformers configs (support/tiny_arch.py), read from
their safetensors and from GGUFs written as llama.cpp writes them, on the lean runner and on
the torch path. Prompts run past the 8-position window, so the sliding layers slide.

Bounds are derived, not measured: the lean runner's logits are within the float32 bound of a
float64 forward of the very values it holds (support/lean_reference.py), and transformers'
float32 logits within twice that; quantised files are held to their own dequantised values,
and the F32 file to transformers, which checks the GGUF names, norms and rope keys."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvpark.model import load_model
from kvpark.model.gguf_file import GgufFile
from kvpark.model.numpy_weights import read_model
from kvpark.model.ops import AttentionMetadata, KVCache, OpSet
from kvpark.runner.lean_runner import LeanCpuRunner
from kvpark.sched.plan import StepItem, StepPlan
from kvpark.tokenizer.tokenizer import Tokenizer
from support.lean_reference import (
    PROMPT,
    alone_and_beside_others,
    budget,
    check_logits,
    config,
    exact,
    greedy,
    reference,
)
from support.tiny_arch import ARCHS, COMMON, WINDOW, save_arch, write_gguf

CPU = torch.device("cpu")
SECOND_PROMPT = [101, 7, 3000, 45, 45, 9, 812, 77, 5, 1234, 66, 18, 4, 250]


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GgufFile(default_gguf_path).metadata)


@pytest.fixture(scope="module")
def default_metadata(default_gguf_path: str) -> dict[str, Any]:
    return GgufFile(default_gguf_path).metadata


def hf_logits(model: Any, tokens: list[int]) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = model(torch.tensor([tokens])).logits[0].double().numpy()
    return out


@pytest.mark.parametrize("kind", list(ARCHS))
def test_a_checkpoint_runs_lean_as_transformers_does(
    kind: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    hf = save_arch(kind, tokenizer, tmp_path)
    r = LeanCpuRunner.load(config(str(tmp_path)))
    a = r.weights.arch
    if kind == "qwen3moe":
        assert a.n_experts == 8 and all(a.moe_layers)
    else:
        assert a.sliding_window == WINDOW and any(a.sliding_layers)
        assert len(PROMPT) + 8 > WINDOW  # the window slides within the sequence
    for prompt in (PROMPT, SECOND_PROMPT):
        seq, _ = greedy(r, prompt)
        check_logits(r, hf_logits(hf, seq[:-1]), prompt)
        if kind == "qwen3moe":  # the rows route to several experts: the mixture is exercised
            assert len(experts_routed(r.weights, seq)) >= 6


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
@pytest.mark.parametrize("kind", list(ARCHS))
def test_a_gguf_runs_lean_as_its_weights_say(
    kind: str, qtype: Q, tokenizer: Tokenizer, default_metadata: dict[str, Any], tmp_path: Path
) -> None:
    """F32: transformers' logits (names, Gemma's 1 + w norms, Llama's permuted rows, rope and
    window keys all read as the converter wrote them); the others: their own dequantised
    values (float32 block dot and cells: the float32 bound)."""
    torch.set_num_threads(1)
    hf = save_arch(kind, tokenizer, tmp_path)
    path = tmp_path / f"tiny.{qtype.name}.gguf"
    write_gguf(kind, hf, path, qtype, default_metadata)
    options = {} if qtype in (Q.F32, Q.F16) else dict(block_dot="float32", kv_dtype="float32")
    r = LeanCpuRunner.load(config(str(path), **options))
    ours, theirs = r.weights.arch, read_model(str(tmp_path))[0].arch
    assert ours.sliding_layers == theirs.sliding_layers
    assert (ours.attn_softcap, ours.final_softcap) == (theirs.attn_softcap, theirs.final_softcap)
    assert np.array_equal(ours.inv_freq(), theirs.inv_freq())
    want = None
    if qtype == Q.F32:
        seq, _ = greedy(r)
        want = hf_logits(hf, seq[:-1])
    check_logits(r, want)


def experts_routed(w: Any, tokens: list[int]) -> set[int]:
    """The experts the float64 forward's routers pick for some row of ``tokens``."""
    routed: set[int] = set()
    reference(w, tokens, routed)
    return routed


def torch_logits(path: str, tokens: list[int], chunks: list[int], ops: OpSet) -> np.ndarray:
    """Every row's logits on the torch path, the prompt in ``chunks``, pages in reverse."""
    lm = load_model(path, torch.float32, CPU, progress=False)
    page = 16
    kv = KVCache.allocate(lm.arch, 4, page, torch.float32, CPU)
    table = [3, 2, 1, 0]
    cells = torch.tensor([table[p // page] * page + p % page for p in range(len(tokens))])
    out, start = [], 0
    for n in chunks:
        end = start + n
        meta = AttentionMetadata(cells[start:end], [0, n], [end], cells[None, :end], n)
        ids, pos = torch.tensor(tokens[start:end]), torch.arange(start, end)
        out.append(lm.model(ids, pos, meta, kv, torch.arange(n), ops))
        start = end
    return torch.cat(out).double().numpy()


@pytest.mark.parametrize("kind", list(ARCHS))
def test_the_torch_path_runs_as_transformers_does(
    kind: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Default and exact op sets, the prompt whole and in chunks (the window crossing a chunk
    boundary), within twice the float32 bound of transformers' logits."""
    torch.set_num_threads(1)
    hf = save_arch(kind, tokenizer, tmp_path)
    tokens = PROMPT + SECOND_PROMPT
    w = read_model(str(tmp_path))[0]
    hidden, _ = reference(w, tokens)
    bound = 2 * budget(w, len(tokens)) * (np.abs(hidden) @ np.abs(exact(w.head)).T)
    want = hf_logits(hf, tokens)
    runs = {}
    for ops in (OpSet.default(), OpSet.exact()):
        for chunks in ([len(tokens)], [5, 9, len(tokens) - 14]):
            got = torch_logits(str(tmp_path), tokens, chunks, ops)
            assert np.all(np.abs(got - want) <= bound), (ops.name, chunks)
            runs[ops.name, len(chunks)] = got
    # exact mode: a row's bits do not depend on the chunking
    assert runs["exact", 1].tobytes() == runs["exact", 3].tobytes()


@pytest.mark.parametrize("kind", list(ARCHS))
def test_in_exact_mode_a_rows_bits_do_not_depend_on_its_step(
    kind: str, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    save_arch(kind, tokenizer, tmp_path)
    alone, beside = alone_and_beside_others(LeanCpuRunner.load(config(str(tmp_path), exact=True)))
    assert alone.tobytes() == beside.tobytes()


def test_phi3_past_its_trained_context_turns_with_the_long_factors(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Served past ``original_max_position_embeddings`` (llama.cpp's rule, and transformers'
    for a sequence that long) the table takes LongRoPE's long factors and its cos/sin factor."""
    torch.set_num_threads(1)
    hf = save_arch("phi3", tokenizer, tmp_path, max_position_embeddings=512)
    c = config(str(tmp_path))
    c = replace(c, pool=replace(c.pool, kv_cells=512))
    r = LeanCpuRunner.load(c)
    s = r.weights.arch.rope_scaling
    assert s is not None and r.weights.arch.max_position > s.original_max_position
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 40000, 300)]
    plan = StepPlan([StepItem(0, 0, tokens, True)], list(range(300)), [list(range(32))])
    got = r.execute(plan)[0]
    hidden, _ = reference(r.weights, tokens)
    bound = 2 * budget(r.weights, 300) * (np.abs(hidden[-1]) @ np.abs(exact(r.weights.head)).T)
    assert np.all(np.abs(got - hf_logits(hf, tokens)[-1]) <= bound)


def test_a_multimodal_gemma3_directory_serves_its_language_model(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """model_type gemma3 (text_config, language_model.* tensors beside a vision tower): the
    language model's, as transformers runs it on text alone."""
    import transformers

    torch.set_num_threads(1)
    _, text = ARCHS["gemma3"]
    text_cfg = COMMON | text
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    mm_config = transformers.Gemma3Config(
        text_config=text_cfg, vision_config=vision | dict(image_size=28, patch_size=14)
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(mm_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.1 if "norm" in name else 0.05)
    hf.save_pretrained(str(tmp_path))
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    r = LeanCpuRunner.load(config(str(tmp_path)))
    assert r.weights.arch.arch == "gemma3" and any(r.weights.arch.sliding_layers)
    seq, _ = greedy(r)
    check_logits(r, hf_logits(hf, seq[:-1]))
