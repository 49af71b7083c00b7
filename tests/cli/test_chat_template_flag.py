"""``--chat-template FILE`` (and ``KVPARK_CHAT_TEMPLATE``): the file's text reaches the model
config, replaces the tokenizer's template, and a bad file exits 2 before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvpark
from kvpark.cli import main as cli
from kvpark.cli.flags import engine_config
from kvpark.config.layers import EngineConfig, ModelConfig
from kvpark.runner.echo_runner import EchoRunner
from kvpark.runner.protocol import build_runner

HERMES = Path(__file__).parent.parent / "data" / "hermes_tools.jinja"


def model_config(argv: list[str]) -> ModelConfig:
    args = cli.build_parser().parse_args(argv)
    return engine_config(args, args.parser).model


def test_the_file_reaches_the_config_from_flag_and_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert model_config(["serve"]).chat_template is None
    assert model_config(["serve", "--chat-template", str(HERMES)]).chat_template == (
        HERMES.read_text()
    )
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setenv("KVPARK_CHAT_TEMPLATE", str(other))
    assert model_config(["serve"]).chat_template == other.read_text()
    # the command line wins over the variable
    assert model_config(["serve", "--chat-template", str(HERMES)]).chat_template == (
        HERMES.read_text()
    )


def test_the_template_replaces_the_models() -> None:
    source = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    config = EngineConfig(model=ModelConfig(chat_template=source))
    runner = build_runner(config, EchoRunner)
    rendered = runner.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[user] hi"
    assert kvpark.load_tokenizer(None).chat_template != source  # the model's own is untouched


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "No such file"),
        ("{% for m in messages %}{{ m['content'] }}", "does not compile: line 1"),
        ("ok\n{{ messages[0]['content'] }\n", "does not compile: line 2"),
        (b"\xff\xfe\x00bad", "codec"),
    ],
)
def test_a_bad_file_exits_2_naming_it(
    content: str | bytes | None,
    words: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "template.jinja"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", "--chat-template", str(path)])
    err = capsys.readouterr().err
    assert raised.value.code == 2
    assert f"--chat-template {path}" in err and words in err


def test_a_bad_env_file_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPARK_CHAT_TEMPLATE", "/no/such/template.jinja")
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve"])
    assert raised.value.code == 2 and "/no/such/template.jinja" in capsys.readouterr().err


def test_help_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "--chat-template FILE" in capsys.readouterr().out
