"""``--no-web`` and its variable ``KVPARK_NO_WEB``: the pages are on by default, off by either
(the command line's switch wins as every flag's does), and ``--help`` says what the switch does.
test_pool_events.py serves with the variable set and checks that no page is served."""

from __future__ import annotations

import pytest

from support.cli_args import help_text, parse


def web(argv: list[str]) -> bool:
    _, server = parse(["serve", *argv])
    return bool(server.web)  # type: ignore[attr-defined]


def test_the_pages_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPARK_NO_WEB", raising=False)
    assert web([]) is True
    assert web(["--no-web"]) is False
    monkeypatch.setenv("KVPARK_NO_WEB", "1")
    assert web([]) is False
    monkeypatch.setenv("KVPARK_NO_WEB", "off")
    assert web([]) is True


def test_help_says_what_no_web_turns_off(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(["serve", "--help"], capsys)
    assert "--no-web serve neither the chat page at / nor the pool view at /pool" in text
