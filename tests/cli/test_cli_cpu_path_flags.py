"""The CPU-path flags (``--kv-dtype``, ``--prompt-path``, ``--block-dot``) and ``KVPARK_CPU_ISA``:
bad values exit 2 naming the flag or variable, good ones reach the model config, and ``--kv-dtype``
takes short and long names from the flag and its env mirror, each named in ``--help``."""

from __future__ import annotations

import pytest

from kvpark.cli import main as cli
from kvpark.cli.flags import engine_config
from support.cli_args import help_text


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--kv-dtype", "int8"], "--kv-dtype"),
        (["--prompt-path", "fast"], "--prompt-path"),
        (["--block-dot", "int4"], "--block-dot"),
    ],
)
def test_the_cpu_path_flags_refuse_a_bad_value(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_a_bad_cpu_isa_cap_exits_2_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPARK_CPU_ISA", "sse9")
    args = cli.build_parser().parse_args(["serve"])
    with pytest.raises(SystemExit) as exit_:
        engine_config(args, args.parser)
    assert exit_.value.code == 2 and "KVPARK_CPU_ISA" in capsys.readouterr().err


def test_the_cpu_path_flags_reach_the_model_config() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--kv-dtype", "float32", "--prompt-path", "same", "--block-dot", "float32"]
    )
    model = engine_config(args, args.parser).model
    assert (model.kv_dtype, model.prompt_path, model.block_dot) == ("float32", "same", "float32")


@pytest.mark.parametrize(
    ("spelt", "name"),
    [
        ("auto", "auto"),
        ("f32", "float32"),
        ("bf16", "bfloat16"),
        ("f16", "float16"),
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
    ],
)
def test_kv_dtype_takes_short_and_long_names_from_flag_and_env(
    spelt: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = cli.build_parser().parse_args(["serve", "--kv-dtype", spelt])
    assert engine_config(args, args.parser).model.kv_dtype == name
    monkeypatch.setenv("KVPARK_KV_DTYPE", spelt)
    args = cli.build_parser().parse_args(["serve"])
    assert args.kv_dtype == name


def test_a_bad_kv_dtype_exits_2_naming_every_choice(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["serve", "--kv-dtype", "fp8"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--kv-dtype" in err and "'fp8'" in err
    assert "auto, f32, bf16, f16, float32, bfloat16, float16" in err


def test_help_names_every_kv_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(["serve", "--help"], capsys)
    at = text.index("--kv-dtype KV_DTYPE the")  # the entry, not the usage line
    entry = text[at : text.index("--prompt-path", at)]
    for name in ("f32", "bf16", "f16", "float32", "bfloat16", "float16", "auto"):
        assert f" {name}" in entry, name
