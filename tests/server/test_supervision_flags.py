"""The flags and knobs of the server's supervision (docs/server.md, "Failures and shutdown"):
``--engine-timeout`` and ``--shutdown-timeout`` with their ``KVPARK_`` mirrors, defaults and
``--help`` lines, and the fault knobs, whose bad values stop ``serve`` before anything loads.
The behaviours themselves: test_step_faults.py, test_engine_death.py, test_graceful_shutdown.py.
"""

from __future__ import annotations

import pytest

from kvpark.config import env
from kvpark.config.layers import ServerConfig
from support.cli_args import exit_code_and_error, help_text, parse

FAULT_KNOBS = ("KVPARK_FAULT_STEP", "KVPARK_FAULT_PANIC", "KVPARK_FAULT_WEDGE", "KVPARK_FAULT_DIE")


def server(argv: list[str]) -> ServerConfig:
    config = parse(argv)[1]
    assert isinstance(config, ServerConfig)
    return config


def test_the_timeouts_default_and_come_from_flags_or_their_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    defaults = server(["serve"])
    assert (defaults.engine_timeout, defaults.shutdown_timeout) == (60.0, 30.0)
    given = server(["serve", "--engine-timeout", "0", "--shutdown-timeout", "2.5"])
    assert (given.engine_timeout, given.shutdown_timeout) == (0.0, 2.5)
    monkeypatch.setenv("KVPARK_ENGINE_TIMEOUT", "5")
    monkeypatch.setenv("KVPARK_SHUTDOWN_TIMEOUT", "7")
    from_env = server(["serve"])
    assert (from_env.engine_timeout, from_env.shutdown_timeout) == (5.0, 7.0)
    assert server(["serve", "--shutdown-timeout", "1"]).shutdown_timeout == 1.0  # the flag wins


@pytest.mark.parametrize("flag", ["--engine-timeout", "--shutdown-timeout"])
def test_a_bad_timeout_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = exit_code_and_error(["serve", flag, "-1"], capsys)
    assert code == 2 and flag in err


def test_help_lists_both_timeouts_with_their_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(["serve", "--help"], capsys)
    assert "--engine-timeout SECONDS" in text and "(default: 60.0)" in text
    assert "--shutdown-timeout SECONDS" in text and "(default: 30.0)" in text


def test_the_fault_knobs_are_test_knobs_that_parse_as_counts() -> None:
    for name in FAULT_KNOBS:
        assert env.KNOBS[name].test_only and env.KNOBS[name].default == "0"
    knobs = env.Knobs.from_env({"KVPARK_FAULT_STEP": "3", "KVPARK_FAULT_DIE": "9"})
    assert (knobs.fault_step, knobs.fault_panic, knobs.fault_wedge, knobs.fault_die) == (
        frozenset({3}),
        0,
        0,
        9,
    )
    several = env.Knobs.from_env({"KVPARK_FAULT_STEP": "5, 40,41"})
    assert several.fault_step == frozenset({5, 40, 41})
    assert env.Knobs.from_env({"KVPARK_FAULT_STEP": "0"}).fault_step == frozenset()
    with pytest.raises(ValueError, match="KVPARK_FAULT_STEP='5,x': 'x' is not an integer"):
        env.Knobs.from_env({"KVPARK_FAULT_STEP": "5,x"})


@pytest.mark.parametrize("name", FAULT_KNOBS)
def test_a_bad_fault_knob_stops_serve_naming_it(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, "-2")
    code, err = exit_code_and_error(["serve"], capsys)
    assert code == 2 and f"{name}=-2 must be >= 0" in err
