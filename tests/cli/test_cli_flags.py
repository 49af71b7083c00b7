"""The command line's flags and their KVPARK_<NAME> mirrors become configs; bad ones exit 2 clearly.

Parsed in-process (fast): ``serve``'s flags and env mirrors (the command line wins), bad flags and
bad env values as usage errors, ``--help``'s defaults in words, ``--version``, a positional model,
the logging flags, ``--api-key-file`` and the internal knobs. test_cli_runs.py runs the command in
processes; the CPU-path and HTTP-stack flags have files of their own.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from kvpark.cli import main as cli
from kvpark.config import env
from support.cli_args import exit_code_and_error, help_text, parse


def test_serve_flags_become_configs() -> None:
    engine, server = parse(
        [
            "serve",
            "--kv-cells",
            "2048",
            "--page-size",
            "32",
            "--parallel",
            "3",
            "--max-batch-tokens",
            "256",
            "--max-model-len",
            "1024",
            "--dtype",
            "bf16",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--preempt-ram",
            "-1",
            "--no-preempt",
            "--preempt-policy",
            "cost",
            "--no-preempt-async",
            "--exact",
            "--api-key",
            "k",
            "--sse-ping-interval",
            "0.5",
            "--log-format",
            "json",
            "--port",
            "9001",
        ]
    )
    assert engine.pool.kv_cells == 2048 and engine.pool.page_size == 32  # type: ignore[attr-defined]
    s = engine.scheduler  # type: ignore[attr-defined]
    assert (s.parallel, s.max_batch_tokens, s.max_model_len) == (3, 256, 1024)
    assert (s.preempt_ram_mib, s.preempt, s.preempt_policy) == (-1, False, "cost")
    assert s.preempt_async is False and engine.model.exact is True  # type: ignore[attr-defined]
    assert engine.model.dtype == "bfloat16" and engine.model.threads == 1  # type: ignore[attr-defined]
    assert server.api_keys == ("k",) and server.sse_ping_interval == 0.5  # type: ignore[attr-defined]
    assert server.log_format == "json" and server.port == 9001  # type: ignore[attr-defined]


def test_env_mirrors_every_flag_and_the_command_line_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPARK_KV_CELLS", "1024")
    monkeypatch.setenv("KVPARK_PORT", "9100")
    monkeypatch.setenv("KVPARK_NO_PREEMPT", "1")
    monkeypatch.setenv("KVPARK_PREEMPT_ASYNC", "false")
    monkeypatch.setenv("KVPARK_EXACT", "yes")
    monkeypatch.setenv("KVPARK_PREFIX_CACHE", "0")
    monkeypatch.setenv("KVPARK_WINDOW_RELEASE", "off")
    engine, server = parse(["serve", "--port", "9200"])
    assert engine.pool.prefix_cache is False  # type: ignore[attr-defined]
    assert engine.pool.window_release is False  # type: ignore[attr-defined]
    assert parse(["serve"])[0].pool.window_release is False  # type: ignore[attr-defined]
    monkeypatch.delenv("KVPARK_WINDOW_RELEASE")
    assert parse(["serve"])[0].pool.window_release is True  # type: ignore[attr-defined]
    assert engine.pool.kv_cells == 1024  # type: ignore[attr-defined]
    assert engine.scheduler.preempt is False  # type: ignore[attr-defined]
    assert engine.scheduler.preempt_async is False  # type: ignore[attr-defined]
    assert engine.model.exact is True  # type: ignore[attr-defined]
    assert server.port == 9200  # type: ignore[attr-defined]


def test_every_serve_flag_has_an_env_name() -> None:
    serve = cli.build_parser().parse_args(["serve"]).parser
    names = {env.flag_env_name(o) for a in serve._actions for o in a.option_strings[:1]}
    for name in (
        "MODEL",
        "HOST",
        "PORT",
        "KV_CELLS",
        "PAGE_SIZE",
        "PARALLEL",
        "MAX_BATCH_TOKENS",
        "MAX_MODEL_LEN",
        "DTYPE",
        "DEVICE",
        "THREADS",
        "WEIGHTS",
        "PREEMPT_RAM",
        "NO_PREEMPT",
        "PREEMPT_POLICY",
        "PREEMPT_ASYNC",
        "EXACT",
        "RUNNER",
        "API_KEY",
        "API_KEY_FILE",
        "SSE_PING_INTERVAL",
        "LOG_FORMAT",
        "LOG_HEALTH",
        "LOG_STATS_INTERVAL",
        "SERVED_MODEL_NAME",
    ):
        assert f"KVPARK_{name}" in names


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["serve", "--port", "abc"], "--port"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--kv-cells", "0"], "--kv-cells"),
        (["serve", "--kv-cells", "1000"], "multiple of --page-size"),
        (["serve", "--dtype", "int3"], "--dtype"),
        (["serve", "--device", "tpu"], "--device"),
        (["serve", "--preempt-ram", "-2"], "--preempt-ram"),
        (["serve", "--preempt-policy", "random"], "--preempt-policy"),
        (["serve", "--sse-ping-interval", "-1"], "--sse-ping-interval"),
        (["serve", "--log-format", "xml"], "--log-format"),
        (["serve", "--log-stats-interval", "-1"], "--log-stats-interval"),
        (["serve", "--log-stats-interval", "nan"], "--log-stats-interval"),
        (["serve", "--model", "/no/such/model.gguf"], "no such file"),
        (["serve", "--api-key", "a", "--api-key-file", "/etc/hostname"], "not both"),
        (["serve", "--api-key-file", "/no/such/key"], "--api-key-file"),
        (["serve", "--api-key", ""], "--api-key is empty"),
        (["serve", "--cache-salt-by-key"], "--cache-salt-by-key needs --api-key"),
        (["serve", "--bogus"], "unrecognized"),
        (["generate"], "no prompts"),
        (["generate", "Hi", "--temperature", "9"], "temperature"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = exit_code_and_error(argv, capsys)
    assert code == 2
    assert words in err


def test_bad_env_values_exit_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = (("KVPARK_KV_CELLS", "lots"), ("KVPARK_EXACT", "maybe"), ("KVPARK_PREFIX_CACHE", "maybe"))
    for name, value in bad:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            code, err = exit_code_and_error(["serve"], capsys)
            assert code == 2 and name in err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_shows_every_flags_default_in_words(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_text([command, "--help"], capsys)
    parser = (
        cli.build_parser().parse_args([command, "x"] if command == "generate" else [command]).parser
    )
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    # every option's help ends with its default: count them against the options
    assert text.count("(default: ") >= len(options)
    assert "default: None" not in text and "default: False" not in text
    assert "default: True" not in text and "default: []" not in text
    for words in ("(default: 16384)", "(default: off)", "(default: on)", "(default: auto)"):
        assert words in text
    if command == "serve":
        assert "--log-stats-interval SECONDS" in text and "(default: 10.0)" in text
        assert "--api-key KEY require" in text and "lets a request in (default: none)" in text


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        cli.main(["--version"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpark {importlib.metadata.version('kvpark')}"


def test_a_positional_model_is_the_same_as_dash_dash_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "tiny.gguf"
    model.touch()  # engine_config only checks that it exists
    positional, _ = parse(["serve", str(model), "--port", "9001"])
    flagged, _ = parse(["serve", "--model", str(model), "--port", "9001"])
    assert positional == flagged
    assert positional.model.model == str(model)  # type: ignore[attr-defined]
    both, _ = parse(["serve", str(model), "--model", str(model)])
    assert both == flagged
    code, err = exit_code_and_error(["serve", str(model), "--model", str(tmp_path)], capsys)
    assert code == 2 and "MODEL" in err and "--model" in err and "differ" in err
    # KVPARK_MODEL still works, and a MODEL on the command line wins over it, as flags do
    monkeypatch.setenv("KVPARK_MODEL", str(tmp_path))
    from_env, _ = parse(["serve"])
    assert from_env.model.model == str(tmp_path)  # type: ignore[attr-defined]
    assert parse(["serve", str(model)])[0] == flagged


def test_logging_flags_and_their_env_mirrors(monkeypatch: pytest.MonkeyPatch) -> None:
    _, default = parse(["serve"])
    assert default.log_health is False and default.log_stats_interval == 10.0  # type: ignore[attr-defined]
    _, flags = parse(["serve", "--log-health", "--log-stats-interval", "0"])
    assert flags.log_health is True and flags.log_stats_interval == 0.0  # type: ignore[attr-defined]
    monkeypatch.setenv("KVPARK_LOG_HEALTH", "1")
    monkeypatch.setenv("KVPARK_LOG_STATS_INTERVAL", "2.5")
    _, from_env = parse(["serve"])
    assert from_env.log_health is True and from_env.log_stats_interval == 2.5  # type: ignore[attr-defined]
    _, overridden = parse(["serve", "--log-stats-interval", "5"])
    assert overridden.log_stats_interval == 5.0  # type: ignore[attr-defined]


def test_api_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("secret\n")
    _, server = parse(["serve", "--api-key-file", str(key_file)])
    assert server.api_keys == ("secret",)  # type: ignore[attr-defined]
    key_file.write_text("  one\n\ntwo  \none\n")  # one per line, blanks skipped, once each
    _, server = parse(["serve", "--api-key-file", str(key_file), "--cache-salt-by-key"])
    assert server.api_keys == ("one", "two") and server.cache_salt_by_key  # type: ignore[attr-defined]
    empty = tmp_path / "empty"
    empty.write_text("\n \n")
    with pytest.raises(SystemExit):
        parse(["serve", "--api-key-file", str(empty)])


def test_api_keys_repeat_and_the_command_line_replaces_the_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, server = parse(["serve", "--api-key", "a", "--api-key", "b"])
    assert server.api_keys == ("a", "b") and not server.cache_salt_by_key  # type: ignore[attr-defined]
    monkeypatch.setenv("KVPARK_API_KEY", "x, y")
    _, from_env = parse(["serve"])
    assert from_env.api_keys == ("x", "y")  # type: ignore[attr-defined]
    _, overridden = parse(["serve", "--api-key", "c"])
    assert overridden.api_keys == ("c",)  # type: ignore[attr-defined]


def test_knobs_parse_from_env() -> None:
    knobs = env.Knobs.from_env({"KVPARK_PREEMPT_EVERY": "8", "KVPARK_PREEMPT_PLANNER": "off"})
    assert knobs == env.Knobs(preempt_every=8, preempt_fail_save=False, preempt_planner=False)
    with pytest.raises(ValueError, match="KVPARK_PREEMPT_EVERY"):
        env.Knobs.from_env({"KVPARK_PREEMPT_EVERY": "-1"})


@pytest.mark.parametrize("name", ["KVPARK_GC_FREEZE", "KVPARK_RELEASE_GPU_LIBS"])
def test_a_bad_server_knob_is_a_usage_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A knob that is not a boolean stops ``serve`` before any model loads, naming the
    variable (it was a traceback from inside the server before)."""
    monkeypatch.setenv(name, "maybe")
    code, err = exit_code_and_error(["serve"], capsys)
    assert code == 2 and f"{name}: 'maybe' is not a boolean" in err
