"""The flags of slow and stalled readers (docs/server.md, "Slow and stalled readers"):
``--stall-timeout``, ``--stream-buffer`` and ``--send-buffer``, their ``KVPARK_`` mirrors,
defaults and ``--help`` lines, and the send buffer on the socket ``kvpark serve`` listens on.
The behaviours: test_stalled_readers.py, test_stream_buffer.py."""

from __future__ import annotations

import socket

import pytest
import uvicorn

from kvpark.config.layers import ServerConfig
from kvpark.server.run import listen_socket
from support.cli_args import exit_code_and_error, help_text, parse
from support.servers import free_port


def server(argv: list[str]) -> ServerConfig:
    config = parse(argv)[1]
    assert isinstance(config, ServerConfig)
    return config


def settings(config: ServerConfig) -> tuple[float, int, int]:
    return config.stall_timeout, config.stream_buffer, config.send_buffer


def test_defaults_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings(server(["serve"])) == (30.0, 1024, 65536)
    flags = ["--stall-timeout", "0", "--stream-buffer", "0", "--send-buffer", "0"]
    assert settings(server(["serve", *flags])) == (0.0, 0, 0)
    monkeypatch.setenv("KVPARK_STALL_TIMEOUT", "2.5")
    monkeypatch.setenv("KVPARK_STREAM_BUFFER", "16")
    monkeypatch.setenv("KVPARK_SEND_BUFFER", "8192")
    assert settings(server(["serve"])) == (2.5, 16, 8192)
    assert server(["serve", "--stream-buffer", "3"]).stream_buffer == 3  # the flag wins


@pytest.mark.parametrize("flag", ["--stall-timeout", "--stream-buffer", "--send-buffer"])
def test_a_negative_value_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = exit_code_and_error(["serve", flag, "-1"], capsys)
    assert code == 2 and flag in err


def test_help_lists_them_with_their_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_text(["serve", "--help"], capsys).split())
    assert "--stall-timeout SECONDS" in text and "(default: 30.0)" in text
    assert "--stream-buffer EVENTS" in text and "(default: 1024)" in text
    assert "--send-buffer BYTES" in text and "(default: 65536)" in text


def test_the_listening_socket_carries_the_send_buffer() -> None:
    config = uvicorn.Config(lambda: None, host="127.0.0.1", port=free_port())
    sock = listen_socket(config, 16384)
    try:  # Linux doubles the value for its bookkeeping; accepted connections inherit it
        assert 16384 <= sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * 16384
    finally:
        sock.close()
