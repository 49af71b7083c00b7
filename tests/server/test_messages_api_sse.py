"""The Anthropic stream's framing on cue: a scripted event source stands in for the engine, so an
error after the first frame, a park before the first token and the stop-sequence search happen
exactly when wanted (the real server's streams are test_messages_api*.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpark.engine.outputs import ErrorEvent, NoticeEvent, TokenEvent
from kvpark.server.errors import APIError
from kvpark.server.messages_api_errors import ANTHROPIC
from kvpark.server.messages_api_events import MessageBuilder
from kvpark.server.sse import sse_frames
from support.scripted import FINISHED, FakeTokenizer, ScriptedSource


def builder(stop: tuple[str, ...] = ()) -> MessageBuilder:
    return MessageBuilder("msg_1", "m", 3, stop, FakeTokenizer(), with_preempt=True)


def frames(script: list[tuple[float, int, object]], stop: tuple[str, ...] = ()) -> list[bytes]:
    async def run() -> list[bytes]:
        source = ScriptedSource(script)  # type: ignore[arg-type]
        return [f async for f in sse_frames(source, builder(stop), 30.0, False, framing=ANTHROPIC)]

    return asyncio.run(run())


def events(out: list[bytes]) -> list[tuple[str, dict[str, object]]]:
    parsed = []
    for frame in out:
        if frame.startswith(b"event: "):
            head, data = frame.decode().strip().split("\n")
            parsed.append((head[len("event: ") :], json.loads(data[len("data: ") :])))
    return parsed


def test_an_error_after_the_first_frame_is_an_error_event() -> None:
    out = frames(
        [
            (0.0, 0, TokenEvent(0, "Hi", [7], None)),
            (0.0, 0, ErrorEvent("the context is full", 500, "server_error")),
        ]
    )
    names = [name for name, _ in events(out)]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    assert events(out)[-1][1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "the context is full"},
    }
    assert not any(b"[DONE]" in f for f in out)  # Anthropic streams have no sentinel


def test_an_error_before_any_frame_is_a_plain_anthropic_error() -> None:
    with pytest.raises(APIError) as caught:
        frames([(0.0, 0, ErrorEvent("the wait queue is full", 503, "unavailable_error"))])
    response = ANTHROPIC.error_response(caught.value)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    body = json.loads(bytes(response.body))
    assert body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the wait queue is full"},
    }


def test_a_park_before_the_first_token_opens_the_stream() -> None:
    out = frames(
        [
            (0.0, 0, NoticeEvent("preempted")),
            (0.0, 0, NoticeEvent("resumed")),
            (0.0, 0, TokenEvent(0, "Hi", [7], None, "length")),
            (0.0, 0, FINISHED),
        ]
    )
    assert out[:2] == [b": preempted\n\n", b": resumed\n\n"]
    names = [name for name, _ in events(out)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    delta = events(out)[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 0}


@pytest.mark.parametrize(
    ("stop", "reason", "sequence"),
    [(("Z", "C"), "stop_sequence", "C"), (("Z",), "end_turn", None), ((), "end_turn", None)],
)
def test_the_matched_stop_sequence_is_found_from_the_tokens(
    stop: tuple[str, ...], reason: str, sequence: str | None
) -> None:
    # FakeTokenizer decodes id i as chr(65 + i): ids [0, 1] emitted "AB", then id 2 ("C") ended
    # the choice with its text cut, as the engine cuts a stop string
    b = builder(stop)
    b.on_tokens(0, TokenEvent(0, "AB", [0, 1], None))
    b.on_tokens(0, TokenEvent(0, "", [2], None, "stop"))
    b.on_finished(FINISHED)
    message = b.response()
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)
    assert message["content"] == [{"type": "text", "text": "AB"}]
