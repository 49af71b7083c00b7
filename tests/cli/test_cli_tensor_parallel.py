"""``--tensor-parallel N`` (``KVPARK_TENSOR_PARALLEL``) on the command line, parsed in-process:
what tensor parallel cannot run exits 2 with the reason before any process starts or any weight
is read, the default model's head counts (9 query, 3 KV) included; a model that divides
becomes the config. The runs themselves: tests/runner/test_tp_runner.py, tests/server/
test_tp_server.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.cli_args import exit_code_and_error, parse


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "the model's 9 query heads and 3 KV heads do not both divide by 2"),
        (["--runner", "lean"], "the lean runner runs one process"),
        (["--weights", "blocks"], "block weights are the single-process CPU path"),
        (["--runner", "kvpark.runner.echo_runner:EchoRunner"], "not a custom runner"),
    ],
)
def test_what_two_ranks_cannot_run_exits_2_with_the_reason(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = exit_code_and_error(["serve", "--tensor-parallel", "2", *argv], capsys)
    assert code == 2 and f"--tensor-parallel 2{'' if argv else ':'}" in err and words in err


def test_the_env_mirror_and_a_bad_size(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPARK_TENSOR_PARALLEL", "4")
    code, err = exit_code_and_error(["serve"], capsys)
    assert code == 2 and "--tensor-parallel 4: the model's 9 query heads" in err
    code, err = exit_code_and_error(["serve", "--tensor-parallel", "0"], capsys)
    assert code == 2 and "--tensor-parallel" in err and "must be >= 1" in err


def test_a_model_whose_heads_divide_becomes_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, '
        '"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, '
        '"vocab_size": 49152}'
    )
    engine, _ = parse(["serve", "--model", str(tmp_path), "--tensor-parallel", "2"])
    assert engine.model.tensor_parallel == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_every_rank_checks_the_flags_before_joining(
    rank: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in {"RANK": rank, "WORLD_SIZE": "2", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    code, err = exit_code_and_error(["serve"], capsys)
    assert (
        code == 2 and f"rank {rank} of 2 processes under torchrun needs --tensor-parallel 2" in err
    )
    code, err = exit_code_and_error(["serve", "--tensor-parallel", "2"], capsys)
    assert code == 2 and "the model's 9 query heads and 3 KV heads" in err  # no rank waits
