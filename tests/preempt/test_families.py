"""``n > 1`` families beside each other and beside parkable requests, on the real default model:
a pool that holds one family's most cells but not two's runs them one after the other, and
nobody fails (before the admission rule of ``StepCells.family_room`` the newer family failed
with the context error once both had stalled)."""

from __future__ import annotations

import torch

import kvpark
from kvpark import SamplingParams

STORY = "Tell me a long story about a lighthouse keeper and the ships she saved. " * 6
SHORT = ["Count to twenty:", "Name some rivers of Europe:"]


def params(n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=40, temperature=0.9, seed=seed, ignore_eos=True)


def test_families_that_outgrow_the_pool_together_all_finish_as_alone() -> None:
    torch.set_num_threads(1)
    llm = kvpark.LLM(exact=True, kv_cells=384, parallel=8, max_batch_tokens=64, threads=1)
    prompt_len = len(llm.tokenizer.encode(STORY))
    most = llm.engine.scheduler.cells.family_cells(prompt_len, 3, 40, 64)
    assert most <= 384 < 2 * most  # one family fits alone, two do not
    prompts = [STORY, STORY + " Begin.", *SHORT]
    wanted = [params(3, 1), params(3, 2), params(1, 3), params(1, 4)]
    alone = [llm.generate(p, w)[0] for p, w in zip(prompts, wanted, strict=True)]
    together = llm.generate(prompts, wanted)
    assert [o.error for o in together] == [None] * 4
    for a, t in zip(alone, together, strict=True):
        assert [c.token_ids for c in t.choices] == [c.token_ids for c in a.choices]
        assert all(len(c.token_ids) == 40 for c in t.choices)
    assert llm.engine.scheduler.pool.cells_used() == 0
    llm.engine.scheduler.pool.check_integrity()
