"""The prefix cache on the real default model (docs/preemption.md "Prefix cache"): a
request that finds its prompt's pages cached computes only the rest; in exact mode its tokens and
logprobs are bitwise those of the same request on a cold engine, beside neighbours, under any
chunking and across swap and recompute parks; in normal mode its greedy tokens stay the same.

The control runs the same warm/cold comparison in normal mode, where a hit changes which kernel
computes the suffix rows, and sees the logprobs' bits change: the comparison can see a
difference when there is one.
"""

from __future__ import annotations

import pytest
import torch

import kvpark
from kvpark import SamplingParams
from kvpark.engine.llm_engine import LLMEngine
from kvpark.engine.outputs import TokenEvent, TokenLogprob

PAGE = 16
PREFIX = (
    "You are a careful assistant. Answer briefly and precisely, in plain words, and say so when "
    "you do not know something. Keep every answer under three sentences. " * 3
)
PROBE = PREFIX + "Question: why is the sky blue?"
OTHER = PREFIX + "Question: what is the largest planet?"
NEIGHBOURS = ["Write a haiku about autumn leaves.", "def fibonacci(n):", "Once upon a time,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=77, max_tokens=12, ignore_eos=True, logprobs=3
)


def make(monkeypatch: pytest.MonkeyPatch, every: int = 0, **options: object) -> kvpark.LLM:
    torch.set_num_threads(1)
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "0")
    options.setdefault("kv_cells", 2048)
    options.setdefault("threads", 1)
    return kvpark.LLM(**options)


def run(
    engine: LLMEngine,
    prompts: list[tuple[str, str, SamplingParams]],
) -> dict[str, list[TokenLogprob]]:
    """Every (id, text, params) added at once, run to the end: each one's logprobs."""
    for rid, text, params in prompts:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        engine.check_request(ids, params)
        engine.add_request(rid, ids, params)
    got: dict[str, list[TokenLogprob]] = {rid: [] for rid, _, _ in prompts}
    while engine.has_work:
        for rid, events in engine.step().items():
            for ev in events:
                if isinstance(ev, TokenEvent) and ev.logprobs is not None:
                    got[rid].extend(ev.logprobs)
    assert engine.scheduler.pool.cells_used() == 0
    return got


def hits(engine: LLMEngine) -> int:
    return engine.stats.prefix_cache_hits_total


SETUPS = {  # engine options and the forced-park knob
    "plain": ({}, 0),
    "chunked prompts": ({"max_batch_tokens": 7}, 0),
    "swap parks": ({"max_batch_tokens": 33}, 4),
    "recompute parks": ({"preempt_ram_mib": 0}, 4),
}


@pytest.fixture(scope="module")
def cold() -> dict[str, list[TokenLogprob]]:
    """The probes alone, each on a fresh engine: nothing cached."""
    mp = pytest.MonkeyPatch()
    out = {}
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        llm = make(mp, exact=True)
        out[kind] = run(llm.engine, [("probe", PROBE, params)])["probe"]
        assert hits(llm.engine) == 0
    mp.undo()
    return out


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_warm_probe_is_bit_identical_to_a_cold_one_in_exact_mode(
    cold: dict[str, list[TokenLogprob]], monkeypatch: pytest.MonkeyPatch, setup: str
) -> None:
    options, every = SETUPS[setup]
    llm = make(monkeypatch, every=every, exact=True, **options)
    engine = llm.engine
    # another question under the same long prefix warms the cache; then each probe beside
    # neighbours: its prefix pages come from the cache, the rest is computed
    run(engine, [("warm", OTHER, GREEDY)])
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        before = hits(engine)
        neighbours = [(f"n{i}", text, GREEDY) for i, text in enumerate(NEIGHBOURS)]
        got = run(engine, [("probe", PROBE, params), *neighbours])["probe"]
        assert hits(engine) - before >= PAGE * 4, "the probe found no cached prefix"
        assert got == cold[kind], f"{kind}: a warm hit changed the probe's bits"
    if every:
        mode = "recompute" if "recompute" in setup else "swap"
        assert engine.stats.preemptions_total[mode] > 0, "the knob parked nothing"


def test_normal_mode_hits_can_move_low_bits_but_keep_greedy_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control, and normal mode's promise. Cold, the probe's whole prompt is one chunk of the
    dense prompt path; warm, its prefix comes from the cache and its last rows are too few for
    that path, so they take the block kernels: the logprobs' bits differ (so the exact test above
    would see such a change), the greedy tokens do not."""
    # float32 dense prompts beside float32 block rows on every machine: the two paths then
    # differ only in the order of their sums (int8 block rows would differ by their rounding)
    dense = {"prompt_path": "float32", "block_dot": "float32"}
    cold = run(make(monkeypatch, **dense).engine, [("probe", PROBE, GREEDY)])["probe"]
    llm = make(monkeypatch, **dense)
    if llm.engine.runner.cpu_paths.prompt_dtype is None:  # type: ignore[attr-defined]
        pytest.fail("this CPU's default has no dense prompt path: the control needs one")
    run(llm.engine, [("warm", OTHER, GREEDY)])
    warm = run(llm.engine, [("probe", PROBE, GREEDY)])["probe"]
    assert hits(llm.engine) >= PAGE * 4
    assert [t.token_id for t in warm] == [t.token_id for t in cold]
    assert [t.logprob for t in warm] != [t.logprob for t in cold]


def test_a_recompute_resume_replays_only_what_is_not_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forced recompute parks every 4 tokens: with the cache each resume takes its own full
    pages back by hash and replays less than a page; without it, the whole history."""
    out, replayed = {}, {}
    for cache in (True, False):
        # float32 prompts (the whole replay without the cache is one): as the control above
        llm = make(
            monkeypatch,
            every=4,
            preempt_ram_mib=0,
            prefix_cache=cache,
            prompt_path="float32",
            block_dot="float32",
        )
        out[cache] = run(llm.engine, [("probe", PROBE, GREEDY)])["probe"]
        stats = llm.engine.stats
        assert stats.preemptions_total["recompute"] >= 2
        replayed[cache] = stats.recomputed_tokens_total / stats.preemptions_total["recompute"]
    assert [t.token_id for t in out[True]] == [t.token_id for t in out[False]]
    assert 0 < replayed[True] < PAGE
    assert replayed[False] > len(PROBE) // 8  # the prompt at least (tokens of ~4+ characters)


def test_a_chat_turn_finds_the_pages_of_the_turn_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next turn's prompt re-renders the history through the chat template. Where its
    token ids start with the first turn's prompt and answer (as they do here up to the answer's
    re-tokenisation), the hit is their common prefix in whole pages (the last token excepted):
    no more, since a page whose ids differ anywhere is not the same page, and no less."""
    llm = make(monkeypatch)
    engine = llm.engine
    system = {"role": "system", "content": PREFIX}
    turn1 = [system, {"role": "user", "content": "Name three colours."}]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    first = llm.chat([turn1], params)[0]
    answer = {"role": "assistant", "content": first.text}
    turn2 = [*turn1, answer, {"role": "user", "content": "And three more?"}]
    # the last token drawn was never fed back: its K and V were not computed
    computed = list(first.prompt_token_ids) + list(first.token_ids)[:-1]
    tok = engine.tokenizer
    again = tok.encode(tok.apply_chat_template(turn2), add_special_tokens=False)
    common = next(
        (i for i, (a, b) in enumerate(zip(computed, again, strict=False)) if a != b),
        min(len(computed), len(again)),
    )
    want = min(common, len(again) - 1) // PAGE * PAGE
    before = hits(engine)
    llm.chat([turn2], params)
    assert hits(engine) - before == want
    assert want >= len(first.prompt_token_ids) // PAGE * PAGE  # at least the first prompt


def test_cached_pages_are_evicted_before_anyone_parks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool of 512 cells and prompts that together need several times it: cached pages make
    room for each new prompt (oldest leaves first), nobody parks, every request completes."""
    llm = make(monkeypatch, kv_cells=512, parallel=2)
    engine = llm.engine
    prompts = [(f"r{i}", f"Topic {i}: " + PREFIX, GREEDY) for i in range(8)]
    for rid, text, params in prompts:  # one at a time: each leaves its pages cached
        got = run(engine, [(rid, text, params)])
        assert len(got[rid]) == GREEDY.max_tokens
        assert 0 < engine.scheduler.pool.cells_cached() <= 512
    assert sum(engine.stats.preemptions_total.values()) == 0
    engine.scheduler.pool.check_integrity()


def test_a_swap_resume_copies_back_only_what_is_not_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forced swap parks every 4 tokens: each resume takes its own full pages, still cached, by
    hash and the copy back writes only the cells after them; the tokens are those of a run
    without parks."""
    plain = run(make(monkeypatch).engine, [("probe", PROBE, GREEDY)])["probe"]
    llm = make(monkeypatch, every=4)
    runner = llm.engine.runner
    restores: list[tuple[int, int]] = []
    restore = runner.restore_cells

    def recorded(src: torch.Tensor, cells: list[int], first: int = 0) -> None:
        restores.append((len(cells), first))
        restore(src, cells, first)  # type: ignore[call-arg]

    monkeypatch.setattr(runner, "restore_cells", recorded)
    parked = run(llm.engine, [("probe", PROBE, GREEDY)])["probe"]
    assert llm.engine.stats.preemptions_total["swap"] >= 2
    assert restores and all(0 < first <= n and first % PAGE == 0 for n, first in restores)
    assert all(n - first < PAGE for n, first in restores)  # at most the partly used tail page
    assert [t.token_id for t in parked] == [t.token_id for t in plain]
