"""Our paged forward against Hugging Face transformers on the same GGUF weights, and against itself
alone vs batched.

No tolerance here is a number measured on one machine (the CPU differs between machines of one
kind: AVX2-only, or AVX-512 with native bf16). Logits are judged against transformers run in
float64 on the same weights, and our error must stay within a small factor of transformers' own
error in the same precision, measured in the same run on the same machine:
- fp32: max |ours - f64| <= FP32_FACTOR * max |transformers fp32 - f64| (+ one float32 ulp of
  the largest logit); greedy tokens identical to transformers fp32.
- bf16: max |ours bf16 - f64| <= BF16_FACTOR * max |transformers bf16 - f64|. Greedy tokens are
  not compared: bf16 decode parts from float32 within 32 tokens (the reason ``--dtype auto`` is
  float32 on the CPU, docs/cpu-kernels.md).
"""

from __future__ import annotations

import copy
import functools
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpark.model import LoadedModel, load_model
from kvpark.model.ops import AttentionMetadata, KVCache

PAGE = 16
CPU = torch.device("cpu")
FP32_FACTOR = 4.0  # two float32 implementations differ in sum order, not in error size
BF16_FACTOR = 2.0
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
]


class Pager:
    """Sequences in a paged pool. Pages come from a shuffled free list, so page tables are scattered
    and never contiguous, as in a pool that has seen churn."""

    def __init__(self, n_pages: int, seed: int = 0) -> None:
        self.free = list(range(n_pages))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def cell(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // PAGE] * PAGE + pos % PAGE

    def step(
        self, work: list[tuple[int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, ctx = [0], []
        for seq, toks in work:
            start = self.lens.get(seq, 0)
            end = start + len(toks)
            table = self.tables.setdefault(seq, [])
            while len(table) * PAGE < end:
                table.append(self.free.pop())
            ids += toks
            positions += range(start, end)
            slots += [self.cell(seq, p) for p in range(start, end)]
            starts.append(starts[-1] + len(toks))
            ctx.append(end)
            self.lens[seq] = end
        cell_index = torch.zeros(len(work), max(ctx), dtype=torch.int64)
        for b, (seq, _) in enumerate(work):
            cell_index[b, : ctx[b]] = torch.tensor([self.cell(seq, p) for p in range(ctx[b])])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start=starts,
            context_lens=ctx,
            cell_index=cell_index,
            max_query_len=max(len(t) for _, t in work),
        )
        return torch.tensor(ids), torch.tensor(positions), meta


def run(
    lm: LoadedModel,
    kv: KVCache,
    pager: Pager,
    work: list[tuple[int, list[int]]],
    all_rows: bool = False,
) -> torch.Tensor:
    """One step; logits of every row, or of each sequence's last row."""
    ids, positions, meta = pager.step(work)
    rows = torch.arange(len(ids)) if all_rows else torch.tensor(meta.query_start[1:]) - 1
    return lm.model(ids, positions, meta, kv, rows)


def new_cache(lm: LoadedModel, n_pages: int = 64) -> KVCache:
    return KVCache.allocate(lm.arch, n_pages, PAGE, lm.model.dtype, CPU)


def greedy(
    lm: LoadedModel,
    prompts: dict[int, list[int]],
    n: int,
    late: dict[int, list[int]] | None = None,
    join_at: int = 0,
) -> dict[int, list[int]]:
    """Greedy decode all prompts together, one token per step; ``late`` prompts join (prefill
    beside the others' decode rows) at step ``join_at``."""
    kv, pager = new_cache(lm, 128), Pager(128, seed=len(prompts))
    out: dict[int, list[int]] = {s: [] for s in [*prompts, *(late or {})]}
    work = list(prompts.items())
    for step in range(join_at + n):
        if late and step == join_at:
            work += list(late.items())
        if not work:
            continue
        nxt = run(lm, kv, pager, work).argmax(-1).tolist()
        for (s, _), t in zip(work, nxt, strict=True):
            out[s].append(t)
        work = [(s, [t]) for (s, _), t in zip(work, nxt, strict=True) if len(out[s]) < n]
    return out


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    # past_key_values works from transformers 4.46 on; 5.x only warns that it is being renamed.
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        res = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            res = hf(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="module")
def ours(default_gguf_path: str) -> LoadedModel:
    return load_model(default_gguf_path, torch.float32, CPU, progress=False)


@pytest.fixture(scope="module")
def ours_bf16(default_gguf_path: str) -> LoadedModel:
    return load_model(default_gguf_path, torch.bfloat16, CPU, progress=False)


@pytest.fixture(scope="module")
def hf(default_gguf_path: str) -> Any:
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    # transformers rebuilds gguf's tensor-name table once per module (~400 times, a third of its
    # load time); the table is a pure function of its arguments, so cache it.
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    path = Path(default_gguf_path)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    finally:
        monkeypatch.undo()
    return model.eval()


@pytest.fixture(scope="module")
def prompts(ours: LoadedModel) -> list[list[int]]:
    tok = ours.tokenizer
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_reference(hf: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """transformers' greedy tokens and first-prompt logits in fp32, and its logits in float64
    and bf16 (the same weights, copied) to judge every logit error against."""
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        logits = hf(ids).logits[0].float()
        f64 = copy.deepcopy(hf).double()(ids).logits[0]
        bf16 = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits[0].double()
    return {
        "logits": logits,
        "f64": f64,
        "fp32_error": (logits.double() - f64).abs().max().item(),
        "bf16_error": (bf16 - f64).abs().max().item(),
        "greedy": [hf_greedy(hf, p, 32) for p in prompts],
    }


def fp32_bound(ref: dict[str, Any]) -> float:
    """What our float32 logits may be off from float64: FP32_FACTOR times transformers' own
    float32 error, plus one float32 rounding of the largest logit."""
    ulp = float(ref["f64"].abs().max()) * 2.0**-23
    return FP32_FACTOR * float(ref["fp32_error"]) + ulp


def test_prompt_logits_one_chunk(
    ours: LoadedModel, prompts: list[list[int]], hf_reference: dict[str, Any]
) -> None:
    assert 30 <= len(prompts[0]) <= 50
    logits = run(ours, new_cache(ours), Pager(64), [(0, prompts[0])], all_rows=True)
    diff = (logits.double() - hf_reference["f64"]).abs().max().item()
    print(f"fp32 one chunk: max |ours - f64| = {diff:.2e}, transformers fp32 "
          f"{hf_reference['fp32_error']:.2e}")  # fmt: skip
    assert diff <= fp32_bound(hf_reference)


def test_prompt_logits_in_chunks(
    ours: LoadedModel, prompts: list[list[int]], hf_reference: dict[str, Any]
) -> None:
    ids = prompts[0]
    kv, pager = new_cache(ours), Pager(64, seed=7)
    parts = [ids[:7], ids[7:20], ids[20:]]
    logits = torch.cat([run(ours, kv, pager, [(0, part)], all_rows=True) for part in parts])
    assert pager.tables[0] != sorted(pager.tables[0])  # scattered pages
    diff = (logits.double() - hf_reference["f64"]).abs().max().item()
    print(f"fp32 chunks 7+13+rest: max |ours - f64| = {diff:.2e}")
    assert diff <= fp32_bound(hf_reference)


def test_greedy_matches_transformers(
    ours: LoadedModel, prompts: list[list[int]], hf_reference: dict[str, Any]
) -> None:
    for ids, expected in zip(prompts, hf_reference["greedy"], strict=True):
        assert greedy(ours, {0: ids}, 32)[0] == expected


def test_bf16_as_accurate_as_transformers_bf16(
    ours_bf16: LoadedModel, prompts: list[list[int]], hf_reference: dict[str, Any]
) -> None:
    logits = run(ours_bf16, new_cache(ours_bf16), Pager(64), [(0, prompts[0])], all_rows=True)
    diff = (logits.double() - hf_reference["f64"]).abs().max().item()
    agree = (logits.argmax(-1) == hf_reference["logits"].argmax(-1)).float().mean().item()
    print(f"bf16: max |ours - f64| = {diff:.3f}, transformers bf16 "
          f"{hf_reference['bf16_error']:.3f}, argmax agreement with fp32 {agree:.2f}")  # fmt: skip
    assert diff <= BF16_FACTOR * hf_reference["bf16_error"]


@pytest.fixture(scope="module")
def six_prompts(ours: LoadedModel) -> dict[int, list[int]]:
    tok = ours.tokenizer
    texts = [
        "Hi!",
        "List three colours.",
        "What is 12 times 7?",
        "Translate 'cat' to French.",
        "Tell me a very short story about a brave little robot who learns to paint.",
        "Why do leaves change colour in autumn? Answer briefly.",
    ]
    return {
        i: tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
        for i, t in enumerate(texts)
    }


@pytest.fixture(scope="module")
def alone(ours: LoadedModel, six_prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    return {s: greedy(ours, {s: ids}, 16)[s] for s, ids in six_prompts.items()}


def test_batched_prompts_decode_as_alone(
    ours: LoadedModel, six_prompts: dict[int, list[int]], alone: dict[int, list[int]]
) -> None:
    assert len({len(p) for p in six_prompts.values()}) == 6  # all lengths differ
    assert greedy(ours, six_prompts, 16) == alone


def test_mixed_steps_decode_as_alone(
    ours: LoadedModel, six_prompts: dict[int, list[int]], alone: dict[int, list[int]]
) -> None:
    """Prompts 3-5 arrive while 0-2 decode: their prefill rows share steps with decode rows."""
    first = {s: six_prompts[s] for s in (0, 1, 2)}
    late = {s: six_prompts[s] for s in (3, 4, 5)}
    assert greedy(ours, first, 16, late=late, join_at=3) == alone
