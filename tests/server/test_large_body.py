"""An 8 MiB JSON body does not stall the streams beside it (docs/server.md, "Limits"): a body that
large is parsed off the event loop, interruptibly (server/body_thread.py), and a long prompt is
tokenized on a worker thread with the GIL released (tokenizer.py). A stream's inter-token
gaps while such bodies arrive stay within a few milliseconds of its gaps just before, measured in
the same test (the C parser on the loop would add one gap of a few hundred milliseconds).
(On two shared cores the parse thread's CPU still shows: tens of ms, not a few.)
The bodies are structure-heavy (a million short strings, the slowest kind to parse) and end in a
lone surrogate, so each is answered 400 naming its field right after the parse: what is timed is
the parse, not a model call. The other kind is one 8 MiB prompt, refused as longer than the model's
context once it is tokenized (~1 s of tokenizer per MiB, all of it once holding the GIL)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from support.servers import Server, serve_for_module

BODY_BYTES = 8 * 1024 * 1024
TOKENS = 400
# The bounds are relative to the same stream's gaps just before, as the CPUs vary: the C parser
# on the event loop adds a gap of ~350 ms here (20 ms gaps) for every body; off the loop the gaps
# grow by tens of ms on two busy cores, the parse thread's share of the CPU, not the GIL. Every
# gap but the worst must stay within the first bound; the worst, within the looser second: a
# shared host once held one gap of a passing run for 135 ms (22.5 ms gaps before), a stall no
# code of the server's made, where a body parsed holding the GIL stalls every time it arrives.
WORST_TIMES = 3.0
SLACK_S = 0.030
OUTLIER_TIMES = 10.0
OUTLIER_SLACK_S = 0.100
MAX_MODEL_LEN = 4096  # the default model's context
OVER_CONTEXT = "a fox " * 100_000  # 200,001 tokens: counted on its head alone
USER_TURN = {"role": "user", "content": OVER_CONTEXT}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module()


def structure_heavy_body() -> bytes:
    items = (BODY_BYTES - 100) // len('"ab", ')
    body = json.dumps({"prompt": "hi", "pad": ["ab"] * items, "bad": "\ud800"}).encode()
    assert BODY_BYTES * 0.9 < len(body) <= BODY_BYTES
    return body


def long_prompt_body() -> bytes:
    sentence = "Once upon a time a fox and a crow shared one small pool. "
    body = json.dumps({"prompt": sentence * ((BODY_BYTES - 100) // len(sentence))}).encode()
    assert BODY_BYTES * 0.9 < len(body) <= BODY_BYTES
    return body


def post_bodies(server: Server, body: bytes, statuses: list[str], stop: threading.Event) -> None:
    """Post ``body`` again and again from another process (curl): a client in this process would
    take this process's GIL to send it, and the gaps measured here would be its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        file.write(body)
        file.flush()
        command = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--data-binary"]
        command += [f"@{file.name}", "-H", "content-type: application/json"]
        while not stop.is_set():
            done = subprocess.run(
                [*command, f"{server.base_url}/v1/completions"], capture_output=True
            )
            statuses.append(done.stdout.decode())


@pytest.mark.parametrize("make_body", [structure_heavy_body, long_prompt_body])
def test_an_8_mib_body_does_not_stall_a_stream(
    server: Server, make_body: Callable[[], bytes]
) -> None:
    body = make_body()  # serialised before anything is timed: the client's own GIL
    request = {
        "prompt": "Once upon a time",
        "max_tokens": TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    arrivals: list[float] = []
    answers: list[str] = []
    stop = threading.Event()
    poster = threading.Thread(target=post_bodies, args=(server, body, answers, stop))
    with server.client() as http, http.stream("POST", "/v1/completions", json=request) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.perf_counter())
            if len(arrivals) == TOKENS // 2:
                posted_from = len(arrivals)
                poster.start()
    stop.set()
    poster.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    before, during = gaps[10 : posted_from - 1], gaps[posted_from:]
    assert answers, "no large body was answered while the stream ran"
    assert set(answers) == {"400"}, answers
    worst_before = max(before)
    *rest, worst_during = sorted(during)
    shown = f"worst gap {worst_before * 1e3:.1f} ms before, {worst_during * 1e3:.1f} ms during"
    shown += f", the next {rest[-1] * 1e3:.1f} ms"
    assert rest[-1] <= WORST_TIMES * worst_before + SLACK_S, shown
    assert worst_during <= OUTLIER_TIMES * worst_before + OUTLIER_SLACK_S, shown


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        ("/v1/completions", "prompt", {"prompt": OVER_CONTEXT}),
        ("/v1/chat/completions", "messages", {"messages": [USER_TURN]}),
        ("/v1/embeddings", "input", {"input": OVER_CONTEXT}),
    ],
)  # fmt: skip
def test_a_text_over_the_context_is_a_400_that_counts_its_tokens(
    server: Server, path: str, field: str, body: dict[str, object]
) -> None:
    """Refused as soon as the tokenizer's count is known (before its ids become a Python list),
    with the context-size error every route uses, naming the field as its API names it."""
    with server.client() as http:
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("exceed_context_size_error", field), error
        counted = re.search(
            r"However, your prompt has more: (\d+) tokens in its first", error["message"]
        )
        assert counted is not None and int(counted.group(1)) > MAX_MODEL_LEN, error
        assert (
            http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        )
