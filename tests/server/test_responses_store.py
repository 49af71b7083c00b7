"""``/v1/responses`` kept in the response store, with the real ``openai`` client (docs/server.md,
"Stored and background responses").

One server with a small store (``--response-store``) and two API keys. A background stream is
dropped by its client and picked up with ``responses.retrieve(id, stream=True, starting_after=N)``:
the sequence numbers run on and the text is the unbroken response's. A background response without
a stream is queued and read back; a cancel stops one and gives its cells back;
``previous_response_id`` continues a stored conversation from its cached pages, with the text the
whole conversation would give; another key finds nothing; the oldest are forgotten past the bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from support.servers import Server, serve_for_module

KEY, OTHER_KEY = "store-key", "other-key"
STORED = 6
PAGE = 16
SYSTEM = "You are a helpful assistant who answers briefly."
QUESTION = "Tell me about lighthouses."
GREEDY: dict[str, Any] = {
    "model": "default",
    "instructions": SYSTEM,
    "input": QUESTION,
    "max_output_tokens": 24,
    "temperature": 0.0,
}
# a string the grammar holds open for thousands of characters: it runs until it is cancelled
LONG_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 5000}},
    "required": ["story"],
}
LONG = {"type": "json_schema", "name": "long", "schema": LONG_SCHEMA, "strict": True}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_for_module(
        "--response-store", str(STORED), "--api-key", OTHER_KEY, api_key=KEY
    )


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def finished(client: openai.OpenAI, response_id: str) -> Response:
    deadline = time.monotonic() + 120
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.05)
    return response


def test_a_dropped_background_stream_is_picked_up_after_its_sequence_number(
    client: openai.OpenAI,
) -> None:
    plain = client.responses.create(**GREEDY, store=False)
    stream = client.responses.create(**GREEDY, background=True, stream=True)
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 6:
            break
    stream.close()  # the connection drops; a background response runs on regardless
    assert first[0].type == "response.created"
    response_id = first[0].response.id
    assert first[0].response.background and first[0].response.store
    after = first[-1].sequence_number
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=after))
    joined = [*first, *rest]
    assert [e.sequence_number for e in joined] == list(range(len(joined)))
    text = "".join(e.delta for e in joined if e.type == "response.output_text.delta")
    assert text == plain.output_text != ""
    last = joined[-1]
    assert last.type in ("response.completed", "response.incomplete")
    stored = client.responses.retrieve(response_id)
    assert stored.status == last.response.status and stored.output_text == text
    # from the start again: every event once more, the same
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in joined]


def test_a_background_response_is_queued_then_read_back(client: openai.OpenAI) -> None:
    plain = client.responses.create(**GREEDY, store=False)
    queued = client.responses.create(**GREEDY, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    done = finished(client, queued.id)
    assert done.status == plain.status and done.output_text == plain.output_text != ""
    assert done.usage is not None and done.usage.output_tokens > 0


def test_cancel_stops_a_background_response_and_gives_its_cells_back(
    server: Server, client: openai.OpenAI
) -> None:
    body = {**GREEDY, "max_output_tokens": 3000, "text": {"format": LONG}}
    running = client.responses.create(**body, background=True)
    deadline = time.monotonic() + 120
    while not client.responses.retrieve(running.id).output_text:  # it has started
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.output_text
    server.wait_cells_free(timeout=10.0)
    settled = server.metric("kvpark_generation_tokens_total")
    time.sleep(0.5)
    assert server.metric("kvpark_generation_tokens_total") == settled
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # nothing more to cancel
    # its stream ends after the last event it had: no response.completed
    events = list(client.responses.retrieve(running.id, stream=True))
    assert events[0].type == "response.created"
    assert not {"response.completed", "response.incomplete"} & {e.type for e in events}


def test_previous_response_id_continues_from_the_cached_pages(client: openai.OpenAI) -> None:
    first = client.responses.create(**GREEDY)
    assert first.store and first.usage is not None
    follow = {**GREEDY, "input": "Say that again in five words."}
    second = client.responses.create(**follow, previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.usage is not None
    # the conversation's own pages, first prompt and answer, came from the cache: only the new
    # turn (and the partly filled pages) were computed
    before = first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= (before - 1) // PAGE * PAGE - PAGE, (cached, before)
    assert second.usage.input_tokens - cached <= second.usage.input_tokens - before + 2 * PAGE
    # the same text as the whole conversation sent again
    turns = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow["input"]},
    ]
    whole = client.responses.create(**{**GREEDY, "input": turns}, store=False)
    assert second.output_text == whole.output_text != ""


def test_another_key_finds_nothing_and_refusals_name_their_field(
    server: Server, client: openai.OpenAI
) -> None:
    kept = client.responses.create(**GREEDY)
    other = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(kept.id)
    with pytest.raises(openai.BadRequestError) as caught:
        other.responses.create(**GREEDY, previous_response_id=kept.id)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == (
        "previous_response_id"
    )
    not_kept = client.responses.create(**GREEDY, store=False)
    assert not not_kept.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_kept.id)
    url = f"{server.base_url}/v1/responses/{kept.id}"
    auth = {"Authorization": f"Bearer {KEY}"}
    refusals = {
        "stream": httpx.get(url, params={"stream": "true"}, headers=auth),  # not background
        "starting_after": httpx.get(url, params={"starting_after": "3"}, headers=auth),
        "colour": httpx.get(url, params={"colour": "red"}, headers=auth),
        "include": httpx.get(url, params={"include": "reasoning.encrypted_content"}, headers=auth),
    }
    for param, refused in refusals.items():
        assert refused.status_code == 400, (param, refused.text)
        assert refused.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(kept.id)  # only a background response can be cancelled
    assert client.responses.delete(kept.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_the_store_keeps_the_newest(server: Server, client: openai.OpenAI) -> None:
    ids = [client.responses.create(**{**GREEDY, "max_output_tokens": 2}).id for _ in range(7)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    assert server.metric("kvpark_responses_stored") == STORED
    assert server.metric("kvpark_responses_stored_bytes") > 0
