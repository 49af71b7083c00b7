"""Reattachable streams on a real ``kvpark serve`` (docs/server.md, "Reattachable streams").

One server: ``--reattach-seconds``, ``--exact``, two API keys, and a park forced on every
generating request every 8 tokens (swap). A client drops its connection mid-stream, beside another
request, reconnects to ``GET /v1/streams/{id}`` with ``Last-Event-ID`` and must read exactly the
rest: the joined text (and, on chat, every logprob, bit for bit) is the unbroken stream's, the ids
run on without a gap, the park notices are replayed in order, on every streaming route. Then the
refusals (a second attach: 409; another key or an unknown id: 404; a bad ``Last-Event-ID``: 400),
the expiry (cells back to the cached pages only, parked and logged bytes back, the engine stops
feeding it) and the ``openai`` and ``anthropic`` clients reading reattachable streams with notices.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from support.servers import Server, serve_for_module
from support.sse_events import Event, events, notices, text_of

REATTACH_S = 4.0
KEY, OTHER_KEY = "key-one", "key-two"
EVERY = 8  # KVPARK_PREEMPT_EVERY: every generating request is parked every 8 tokens
TOKENS = 40
ATTACH_TIMEOUT_S = 30.0
MESSAGES = [{"role": "user", "content": "Name three colours and say why you like them."}]
# greedy on every route; chat also seeded at temperature 0.9 with logprobs (compared bit for bit)
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": TOKENS}),
    "chat": (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": TOKENS,
            "temperature": 0.9,
            "seed": 11,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    "responses": ("/v1/responses", {"input": MESSAGES, "max_output_tokens": TOKENS}),
    "messages": (
        "/v1/messages",
        {"model": "default", "messages": MESSAGES, "max_tokens": TOKENS},
    ),
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module(
        "--reattach-seconds",
        str(REATTACH_S),
        "--exact",
        # no bound on unwritten events: the expiring stream must still be generating when it
        # expires, however fast the machine (the bound: test_stream_log.py)
        "--stream-buffer",
        "0",
        "--api-key",
        OTHER_KEY,
        api_key=KEY,
        environ={"KVPARK_PREEMPT_EVERY": str(EVERY)},
    )


def body_of(route: str, **more: Any) -> tuple[str, dict[str, Any]]:
    path, body = BODIES[route]
    return path, {"temperature": 0, **body, "stream": True, **more}


def reattach(
    server: Server, stream_id: str, last_id: int, key: str = KEY
) -> tuple[httpx.Response, list[Event]]:
    """The rest of the stream after ``last_id``; retries a 409 while the server has not yet
    noticed the dropped connection."""
    headers = {"Last-Event-ID": str(last_id), "Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
        while True:
            with http.stream("GET", f"/v1/streams/{stream_id}", headers=headers) as response:
                if response.status_code == 409 and time.monotonic() < deadline:
                    response.read()
                    time.sleep(0.05)
                    continue
                if response.status_code != 200:
                    response.read()
                    return response, []
                return response, events(response)


def dropped(server: Server, route: str, after: int, **more: Any) -> tuple[str, list[Event]]:
    """The stream id and the first ``after`` events of a stream whose connection then drops."""
    path, body = body_of(route, **more)
    with server.client() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        stream_id = response.headers["x-kvpark-stream-id"]
        first = events(response, stop_after=after)
    return stream_id, first  # leaving the block closes the connection mid-stream


def unbroken(server: Server, route: str) -> list[Event]:
    path, body = body_of(route)
    with server.client() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        return events(response)


def logprobs(stream: list[Event]) -> list[Any]:
    return [c["logprobs"] for e in stream if (o := e.json()) for c in o.get("choices", [])]


@pytest.mark.parametrize("route", list(BODIES))
def test_a_dropped_stream_reattaches_to_the_same_text(server: Server, route: str) -> None:
    whole = unbroken(server, route)
    beside: list[str] = []
    check_path, check = body_of("completions", max_tokens=24, stream=False)

    def run_beside() -> None:
        with server.client() as http:
            beside.append(http.post(check_path, json=check).json()["choices"][0]["text"])

    thread = threading.Thread(target=run_beside)
    thread.start()
    stream_id, first = dropped(server, route, after=6)
    response, rest = reattach(server, stream_id, first[-1].id or 0)
    thread.join(timeout=120)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvpark-stream-id"] == stream_id
    joined = first + rest
    assert len(first) == 6 and len(rest) > 6  # it really dropped mid-stream
    # every event numbered, without a gap, across the drop; the first names the stream
    assert [e.id for e in joined] == list(range(1, len(joined) + 1))
    assert joined[0].comments[0] == f"stream {stream_id}"
    assert text_of(route, joined) == text_of(route, whole) != ""
    if route == "chat":  # --exact: the same bits whatever ran beside it, parks included
        assert logprobs(joined) == logprobs(whole) and logprobs(whole)[0] is not None
    # the forced parks' notices are events like any, replayed in order
    assert notices(joined)[:2] == ["preempted", "resumed"]
    assert notices(joined) == notices(whole)
    if route in ("completions", "chat"):
        assert joined[-1].data == "[DONE]"
    if route == "responses":  # its sequence numbers run on across the drop: id - 1
        assert [e.json()["sequence_number"] for e in joined] == [e.id - 1 for e in joined]
        assert joined[-1].type in ("response.completed", "response.incomplete")
    if route == "messages":
        types = [e.type for e in joined]
        assert types[0] == "message_start" and types[-1] == "message_stop"
        assert types == [e.type for e in whole]
    assert beside and beside[0] != ""
    # read to its end: the stream is gone
    assert reattach(server, stream_id, 0)[0].status_code == 404
    server.wait_cells_free()


def test_a_second_attach_is_a_409_and_other_keys_get_a_404(server: Server) -> None:
    path, body = body_of("completions", max_tokens=4 * TOKENS)  # still running at the GETs
    with server.client() as http, http.stream("POST", path, json=body) as response:
        stream_id = response.headers["x-kvpark-stream-id"]
        assert stream_id.startswith("strm_") and len(stream_id) == len("strm_") + 32
        int(stream_id.removeprefix("strm_"), 16)  # 128 bits, in hex
        lines = response.iter_lines()  # kept: the connection stays open while it lives
        first = events(lines, stop_after=2)
        headers = {"Authorization": f"Bearer {KEY}"}
        url = f"{server.base_url}/v1/streams/{stream_id}"
        conflict = httpx.get(url, headers=headers)
        assert conflict.status_code == 409, conflict.text
        assert "attached to another connection" in conflict.json()["error"]["message"]
        stranger = httpx.get(url, headers={"Authorization": f"Bearer {OTHER_KEY}"})
        assert stranger.status_code == 404  # not 409: another key cannot learn it exists
        assert httpx.get(url).status_code == 401  # no key at all
        rest = events(lines)
    assert [e.id for e in first + rest] == list(range(1, len(first + rest) + 1))
    unknown = httpx.get(f"{server.base_url}/v1/streams/strm_{'0' * 32}", headers=headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_another_key_cannot_pick_up_a_dropped_stream(server: Server) -> None:
    stream_id, first = dropped(server, "chat", after=3)
    assert reattach(server, stream_id, 1, key=OTHER_KEY)[0].status_code == 404
    bad = reattach(server, stream_id, 10_000)[0]
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]
    # from event 1 again: the whole rest, the events after it among it once more
    response, rest = reattach(server, stream_id, 1)
    assert response.status_code == 200
    assert [e.id for e in rest] == list(range(2, len(rest) + 2))
    assert [e.data for e in rest[: len(first) - 1]] == [e.data for e in first[1:]]
    server.wait_cells_free()


def test_an_unclaimed_stream_expires_and_gives_everything_back(server: Server) -> None:
    server.wait_cells_free()
    stream_id, _ = dropped(server, "completions", after=2, max_tokens=4000, ignore_eos=True)
    assert server.metric("kvpark_reattach_detached_streams") >= 0  # the gauge is served
    text = server.wait_for_log(f"stream {stream_id} expired", timeout=REATTACH_S + 60)
    # it was still generating when it expired: aborted, not finished
    assert f"stream {stream_id} expired: unclaimed for {REATTACH_S:g} s (its requests aborted)" in (
        text
    )
    server.wait_cells_free(timeout=10.0)  # cells back; its full pages stay as cached ones
    assert server.metric("kvpark_kv_cells_cached") > 0
    assert server.metric("kvpark_preempt_ram_bytes") == 0
    assert server.metric("kvpark_reattach_streams") == 0
    assert server.metric("kvpark_reattach_bytes") == 0
    settled = server.metric("kvpark_generation_tokens_total")
    time.sleep(1.0)
    assert server.metric("kvpark_generation_tokens_total") == settled  # nothing feeds it now
    assert reattach(server, stream_id, 0)[0].status_code == 404


def test_the_clients_read_a_reattachable_stream(server: Server) -> None:
    """Notices ride as comment lines with the next event: the openai client's decoder, which
    keeps the last id, would otherwise read a block of comments alone as an event of empty data.
    The same chat at temperature 0 on /v1/messages gives the same text."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=MESSAGES, max_tokens=3 * EVERY, temperature=0, stream=True
    )
    assert raw.headers["x-kvpark-stream-id"].startswith("strm_")
    text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    _, body = body_of("chat", max_tokens=3 * EVERY, stream=False, temperature=0, seed=None)
    with server.client() as http:
        plain = http.post("/v1/chat/completions", json=body).json()
    assert plain["preempt"]["parks"] >= 2  # the stream carried notices too
    assert text == plain["choices"][0]["message"]["content"] != ""
    # and the anthropic client, on /v1/messages
    claude = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    extra = {"temperature": 0}  # anthropic 2.x takes it only through extra_body
    with claude.messages.stream(
        model="default", max_tokens=3 * EVERY, messages=MESSAGES, extra_body=extra
    ) as stream:
        said = "".join(stream.text_stream)
    assert said == text
