"""The flags of what the server keeps for clients (docs/server.md, "Reattachable streams" and
"Stored and background responses"): ``--reattach-seconds``, ``--response-store``,
``--response-store-mib`` and ``--response-store-ttl``, their ``KVPARK_`` mirrors, defaults, bad
values and ``--help`` lines. The behaviours: test_reattach.py, test_responses_store.py."""

from __future__ import annotations

import pytest

from kvpark.config.layers import ServerConfig
from support.cli_args import exit_code_and_error, help_text, parse


def server(argv: list[str]) -> ServerConfig:
    config = parse(argv)[1]
    assert isinstance(config, ServerConfig)
    return config


def settings(config: ServerConfig) -> tuple[float, int, int, float]:
    return (
        config.reattach_seconds,
        config.response_store,
        config.response_store_mib,
        config.response_store_ttl,
    )


def test_defaults_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings(server(["serve"])) == (0.0, 1024, 256, 3600.0)
    flags = ["--reattach-seconds", "90", "--response-store", "0"]
    flags += ["--response-store-mib", "8", "--response-store-ttl", "0"]
    assert settings(server(["serve", *flags])) == (90.0, 0, 8, 0.0)
    monkeypatch.setenv("KVPARK_REATTACH_SECONDS", "2.5")
    monkeypatch.setenv("KVPARK_RESPONSE_STORE", "16")
    monkeypatch.setenv("KVPARK_RESPONSE_STORE_MIB", "64")
    monkeypatch.setenv("KVPARK_RESPONSE_STORE_TTL", "60")
    assert settings(server(["serve"])) == (2.5, 16, 64, 60.0)
    assert server(["serve", "--reattach-seconds", "3"]).reattach_seconds == 3.0  # the flag wins


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--reattach-seconds", "-1"),
        ("--response-store", "-1"),
        ("--response-store-mib", "0"),
        ("--response-store-ttl", "soon"),
    ],
)
def test_a_bad_value_is_a_usage_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = exit_code_and_error(["serve", flag, value], capsys)
    assert code == 2 and flag in err


def test_help_lists_them_with_their_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_text(["serve", "--help"], capsys).split())
    assert "--reattach-seconds SECONDS" in text and "GET /v1/streams/{id}" in text
    assert "--response-store N" in text and "(default: 1024)" in text
    assert "--response-store-mib MIB" in text and "(default: 256)" in text
    assert "--response-store-ttl SECONDS" in text and "(default: 3600.0)" in text
