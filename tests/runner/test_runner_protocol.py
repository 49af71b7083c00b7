"""The runner protocol's plumbing, on the documented example runner (kvpark.runner.echo_runner):
its tokens follow its rule through the engine, across forced swap and recompute parks and as n=2
choices; exact mode accepts it (row_invariant = True); ``--runner`` / ``KVPARK_RUNNER`` /
``LLM(runner="module:factory")`` / ``AsyncEngine(runner=...)`` plug it in; a runner that lacks a
member is refused; docs/custom-runners.md shows the example file as it is and its snippets run.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

import kvpark
from kvpark import SamplingParams
from kvpark.cli import main as cli
from kvpark.cli.flags import engine_config
from kvpark.config.layers import EngineConfig, ModelConfig, PoolConfig
from kvpark.runner.echo_runner import EchoRunner

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "custom-runners.md"
SPEC = "kvpark.runner.echo_runner:EchoRunner"
TEXTS = ["one two three one two", "a b c d a b", "The cat sat on the mat. The cat"]


def echo_rule(prompt: list[int], n: int) -> list[int]:
    """What EchoRunner predicts, on plain lists: the token that followed the last earlier
    occurrence of the newest token, else the first token."""
    seq = list(prompt)
    for _ in range(n):
        earlier = [i for i in range(len(seq) - 1) if seq[i] == seq[-1]]
        seq.append(seq[earlier[-1] + 1] if earlier else seq[0])
    return seq[len(prompt) :]


def greedy(tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **kw)


def make(
    monkeypatch: pytest.MonkeyPatch, every: int = 0, fail_save: bool = False, **options: Any
) -> kvpark.LLM:
    monkeypatch.setenv("KVPARK_PREEMPT_EVERY", str(every))
    monkeypatch.setenv("KVPARK_PREEMPT_FAIL_SAVE", "1" if fail_save else "0")
    monkeypatch.setenv("KVPARK_PREEMPT_PLANNER", "on")
    options.setdefault("kv_cells", 512)
    options.setdefault("parallel", 4)
    return kvpark.LLM(runner=EchoRunner, **options)


def assert_clean(llm: kvpark.LLM) -> None:
    pool = llm.engine.scheduler.pool
    assert not llm.engine.has_work and pool.cells_used() == 0
    pool.check_integrity()
    assert llm.engine.stats.preempt_ram_bytes == 0


@pytest.mark.parametrize(
    ("every", "fail_save", "mode"), [(0, False, None), (5, False, "swap"), (5, True, "recompute")]
)
def test_echo_runner_follows_its_rule_through_the_engine_and_parks(
    monkeypatch: pytest.MonkeyPatch, every: int, fail_save: bool, mode: str | None
) -> None:
    llm = make(monkeypatch, every=every, fail_save=fail_save, max_batch_tokens=8)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    outs = llm.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == [echo_rule(p, 24) for p in prompts]
    if mode is not None:
        assert llm.engine.stats.preemptions_total[mode] >= 3 * len(TEXTS)
    assert_clean(llm)


def test_echo_runner_forks_n2_and_runs_in_exact_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make(monkeypatch, exact=True)
    assert llm.engine.runner.row_invariant
    prompt = llm.tokenizer.encode(TEXTS[2])  # 9 tokens: the fork copies a partly used page
    out = llm.generate(prompt, greedy(12, n=2))[0]
    assert [c.token_ids for c in out.choices] == [echo_rule(prompt, 12)] * 2
    assert_clean(llm)


def test_a_module_factory_string_plugs_in_like_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make(monkeypatch)
    by_name = kvpark.LLM(runner=SPEC, kv_cells=512)
    assert by_name.engine.config.model.runner == SPEC
    assert type(by_name.engine.runner) is EchoRunner
    assert (
        by_name.generate(TEXTS[0], greedy(6))[0].text == llm.generate(TEXTS[0], greedy(6))[0].text
    )


def test_async_engine_takes_a_runner_and_props_report_its_row_invariance() -> None:
    config = EngineConfig(model=ModelConfig(exact=True, runner=SPEC), pool=PoolConfig(kv_cells=256))
    engine = kvpark.AsyncEngine(config)
    engine.start()
    try:
        assert engine.wait_ready(60), engine.load_error
        assert engine.props()["exact"] is True and engine.props()["model"] == "echo"
    finally:
        asyncio.run(engine.shutdown())


def test_the_engine_closes_a_runner_that_has_close_once_at_shutdown() -> None:
    engines: list[Any] = []
    closed: list[list[str]] = []  # the requests still in the engine at each close

    class Closing(EchoRunner):
        def close(self) -> None:
            closed.append(engines[0].request_ids)

    llm = kvpark.LLM(runner=Closing, kv_cells=256)
    engines.append(llm.engine)
    llm.engine.add_request("left running", [5, 6, 5], greedy(50))
    llm.engine.step()
    llm.engine.close()
    assert closed == [[]]  # once, after every request was aborted


def test_runner_flag_and_env_name_the_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    args = cli.build_parser().parse_args(["serve", "--runner", SPEC, "--model", "any/thing"])
    config = engine_config(args, args.parser)
    assert config.model.runner == SPEC and config.model.model == "any/thing"  # not checked
    monkeypatch.setenv("KVPARK_RUNNER", SPEC)
    args = cli.build_parser().parse_args(["serve"])
    assert engine_config(args, args.parser).model.runner == SPEC


@pytest.mark.parametrize("name", ["auto", "lean", "torch"])
def test_the_built_in_runners_are_named_by_the_flag(name: str) -> None:
    args = cli.build_parser().parse_args(["serve", "--runner", name])
    assert engine_config(args, args.parser).model.runner == name
    default = cli.build_parser().parse_args(["serve"])
    assert engine_config(default, default.parser).model.runner == "auto"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no_colon", "not one of auto, lean, torch nor of the form module:factory"),
        ("no_such_module_here:make", "ModuleNotFoundError"),
        ("kvpark.runner.echo_runner:Missing", "AttributeError"),
        ("kvpark.runner.echo_runner:CONFIDENCE", "not callable"),
    ],
)
def test_a_bad_runner_flag_exits_2_naming_it(
    spec: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", "--runner", spec])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and "--runner" in err and words in err


def test_generate_runs_a_custom_runner(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["generate", "--runner", SPEC, "--kv-cells", "256", "--max-tokens", "5", "a b c a b"]
    )
    assert code == 0 and capsys.readouterr().out.strip() == "c a b c a"


class _Incomplete:
    tokenizer = None
    model_name = "incomplete"

    def __init__(self, config: EngineConfig) -> None:
        pass


def test_a_runner_without_every_member_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"_Incomplete is not a kvpark.Runner: it lacks vocab_size"):
        kvpark.LLM(runner=_Incomplete, kv_cells=256)


INCLUDE = re.compile(r"<!-- include: (\S+) -->\n```python\n(.*?)```\n", re.S)
RUN = re.compile(r"<!-- run -->\n```python\n(.*?)```\n", re.S)


def test_the_doc_shows_the_example_files_as_they_are() -> None:
    text = DOC.read_text(encoding="utf-8")
    included = INCLUDE.findall(text)
    assert [path for path, _ in included] == ["python/kvpark/runner/echo_runner.py"]
    for path, block in included:
        assert block == (ROOT / path).read_text(encoding="utf-8"), (
            f"{DOC.name} shows a stale {path}"
        )


def test_the_doc_snippets_run() -> None:
    snippets = RUN.findall(DOC.read_text(encoding="utf-8"))
    assert snippets
    for code in snippets:
        exec(compile(code, str(DOC), "exec"), {"__name__": "doc_snippet"})
