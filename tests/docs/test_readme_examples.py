"""The README's "Talking to it" and "Tools and structured outputs" examples, run verbatim: the code
is read out of README.md itself, so an example that stops working (or drifts from what the server
accepts) fails here.

- the ``openai`` client snippets (a stream, a two-step tool call, a JSON-schema reply) against one
  real ``kvpark serve`` on the port they name, 8000;
- the offline ``kvpark.LLM`` snippet;
- the ``kvpark generate ...`` command, with the installed ``kvpark`` script.

Each runs in its own process with one thread (``KVPARK_THREADS=1`` reaches the commands; the offline
snippet takes no flags).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvpark
from support.servers import start_server, stop_server

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Talking to it"
TOOLS_SECTION = "## Tools and structured outputs"
README_PORT = 8000  # the port the client snippets' base_url names
RUN_TIMEOUT_S = 600.0
# The first snippet asks for no max_tokens, so a chat completion runs to the end of the context: a
# short context keeps a rambling answer short (and still holds the tool loop's history).
README_SERVER_FLAGS = ("--max-model-len", "512")


def readme_section(heading: str = SECTION) -> str:
    """The text under the heading, up to the next ``## `` heading."""
    text = README.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def python_snippet(containing: str, heading: str = SECTION) -> str:
    blocks = re.findall(r"```python\n(.*?)```", readme_section(heading), re.DOTALL)
    matches = [block for block in blocks if containing in block]
    assert len(matches) == 1, f"expected one python block with {containing!r} under {heading!r}"
    return str(matches[0])


def shell_command(prefix: str) -> list[str]:
    commands = re.findall(r"`(" + re.escape(prefix) + r"[^`]*)`", readme_section())
    assert commands, f"no `{prefix}...` command under {SECTION!r}"
    return shlex.split(commands[0])


def light_environ() -> dict[str, str]:
    package_root = str(Path(kvpark.__file__).resolve().parent.parent)
    return {
        **os.environ,
        "KVPARK_THREADS": "1",
        "KVPARK_DTYPE": "float32",
        "KVPARK_KV_CELLS": "1024",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]),
    }


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=light_environ()
    )


def assert_printed_text(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"printed nothing; stderr:\n{result.stderr[-4000:]}"


def port_is_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as uvicorn binds: a socket left in TIME_WAIT by an earlier run does not count
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_section_holds_the_three_examples() -> None:
    assert f"http://127.0.0.1:{README_PORT}/v1" in python_snippet("OpenAI(")
    assert "kvpark.LLM(" in python_snippet("import kvpark")
    assert shell_command("kvpark generate")[:2] == ["kvpark", "generate"]


@pytest.fixture(scope="module")
def readme_server() -> Iterator[None]:
    if port_is_taken(README_PORT):
        pytest.fail(
            f"port {README_PORT} on 127.0.0.1 is taken: this test serves the README's examples "
            f"on it (base_url http://127.0.0.1:{README_PORT}/v1); stop whatever listens there"
        )
    server = start_server(*README_SERVER_FLAGS, port=README_PORT)
    try:
        yield
    finally:
        stop_server(server)


def test_the_openai_client_example_streams_text_from_kvpark_serve(readme_server: None) -> None:
    assert_printed_text(run([sys.executable, "-c", python_snippet("OpenAI(")]))


def test_the_tool_call_example_gets_a_valid_call_then_an_answer(readme_server: None) -> None:
    snippet = python_snippet("tool_choice=", TOOLS_SECTION)
    assert f"http://127.0.0.1:{README_PORT}/v1" in snippet
    result = run([sys.executable, "-c", snippet])
    assert_printed_text(result)
    first = result.stdout.splitlines()[0]
    # the first print: the called function's name and its parsed arguments, a dict with "city"
    name, _, arguments = first.partition(" ")
    assert name == "get_weather", result.stdout
    assert ast.literal_eval(arguments).keys() == {"city"}, result.stdout


def test_the_json_schema_example_prints_a_valid_person(readme_server: None) -> None:
    snippet = python_snippet("response_format=", TOOLS_SECTION)
    result = run([sys.executable, "-c", snippet])
    assert_printed_text(result)
    *name, age = result.stdout.split()
    assert name and 0 <= int(age) <= 120, result.stdout


def test_the_offline_llm_example_prints_text() -> None:
    assert_printed_text(run([sys.executable, "-c", python_snippet("import kvpark")]))


def test_the_generate_command_prints_text() -> None:
    argv = shell_command("kvpark generate")
    script = Path(sys.executable).parent / "kvpark"  # the venv's console script, as users run it
    assert script.exists(), f"{script} is missing: is kvpark installed in this environment?"
    assert_printed_text(run([str(script), *argv[1:]]))
