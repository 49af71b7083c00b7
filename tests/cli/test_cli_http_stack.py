"""``--http-stack``: the event loop and HTTP parser it picks (uvloop + httptools by default,
asyncio + h11 as the off switch), its env mirror, and a usage error where uvloop is missing."""

from __future__ import annotations

import pytest

from support.cli_args import exit_code_and_error, parse


def test_the_http_stack_flag_picks_the_loop_and_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--http-stack``: uvloop + httptools by default (both are dependencies), asyncio + h11 as
    the off switch, and an unknown name refused by the parser."""
    import asyncio

    import uvloop

    from kvpark.server.run import http_stack

    _, default = parse(["serve"])
    assert default.http_stack == "auto"  # type: ignore[attr-defined]
    assert http_stack("auto") == (uvloop.new_event_loop, "httptools")
    assert http_stack("uvloop") == (uvloop.new_event_loop, "httptools")
    assert http_stack("asyncio") == (None, "h11")
    loop = http_stack("auto")[0]
    assert loop is not None and isinstance(loop(), asyncio.AbstractEventLoop)
    _, off = parse(["serve", "--http-stack", "asyncio"])
    assert off.http_stack == "asyncio"  # type: ignore[attr-defined]
    monkeypatch.setenv("KVPARK_HTTP_STACK", "asyncio")
    _, from_env = parse(["serve"])
    assert from_env.http_stack == "asyncio"  # type: ignore[attr-defined]
    monkeypatch.delenv("KVPARK_HTTP_STACK")
    with pytest.raises(SystemExit):
        parse(["serve", "--http-stack", "trio"])


def test_http_stack_uvloop_without_its_packages_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where uvloop is missing, ``auto`` falls back to asyncio + h11 and an explicit ``uvloop``
    is refused before any model loads, naming the flag."""
    import importlib.util

    from kvpark.server.run import http_stack

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    assert http_stack("auto") == (None, "h11")
    code, err = exit_code_and_error(["serve", "--http-stack", "uvloop"], capsys)
    assert code == 2 and "--http-stack uvloop needs" in err
