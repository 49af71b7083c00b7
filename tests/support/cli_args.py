"""The command line parsed in-process, for the CLI tests (tests/cli/): argv to the engine and server
configs, the exit code and stderr of a usage error, and ``--help`` text."""

from __future__ import annotations

import pytest

from kvpark.cli import main as cli
from kvpark.cli.flags import engine_config
from kvpark.cli.server_flags import server_config


def parse(argv: list[str]) -> tuple[object, object]:
    args = cli.build_parser().parse_args(argv)
    return engine_config(args, args.parser), server_config(args, args.parser)


def exit_code_and_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    return int(raised.value.code or 0), capsys.readouterr().err


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``--help`` output, whitespace folded (argparse wraps lines anywhere)."""
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 0
    return " ".join(capsys.readouterr().out.split())
