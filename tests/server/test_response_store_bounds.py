"""The response store's bounds, in process, on a clock of its own (server/response_store.py): at
most ``--response-store`` responses and ``--response-store-mib`` bytes, the oldest finished
forgotten first, a running background response never; a finished one forgotten
``--response-store-ttl`` seconds after it finished; another key's responses not found."""

from __future__ import annotations

import contextlib

import pytest

from kvpark.server.errors import APIError
from kvpark.server.response_store import ResponseStore, StoredResponse, json_size

KEY, OTHER = b"k" * 32, b"o" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def finished(response_id: str, text: str = "x", owner: bytes | None = KEY) -> StoredResponse:
    final: dict[str, object] = {"id": response_id, "status": "completed", "output_text": text}
    return StoredResponse(response_id, owner, False, (), final)


def running(response_id: str) -> StoredResponse:
    return StoredResponse(response_id, KEY, True, live=lambda status: {"status": status})


def ids(store: ResponseStore) -> set[str]:
    found = set()
    for response_id in ("a", "b", "c", "d", "e", "bg"):
        with contextlib.suppress(APIError):  # not found
            found.add(store.get(response_id, KEY).response_id)
    return found


def test_the_oldest_finished_go_first_past_the_count() -> None:
    store = ResponseStore(3, 2**20, 0.0)
    store.add(running("bg"))  # the oldest, but running: never forgotten
    for response_id in "abcd":
        store.add(finished(response_id))
    assert ids(store) == {"bg", "c", "d"} and len(store) == 3
    store.finish(store.get("bg", KEY), {"id": "bg", "status": "completed"}, ())
    store.add(finished("e"))
    assert ids(store) == {"c", "d", "e"}  # finished, bg is the oldest: it goes now


def test_bytes_bound_and_time_to_live() -> None:
    clock = Clock()
    one = json_size([finished("a", "y" * 1000).final])
    store = ResponseStore(100, 2 * one + 10, 60.0, clock)
    for response_id in "abc":
        store.add(finished(response_id, "y" * 1000))
        clock.now += 1
    assert ids(store) == {"b", "c"} and store.held_bytes() == 2 * one
    clock.now += 57.5  # b finished 59.5 s ago, c 58.5 s ago
    assert ids(store) == {"b", "c"}
    clock.now += 0.5
    assert ids(store) == {"c"}
    clock.now += 1
    assert ids(store) == set() and store.held_bytes() == 0


def test_a_response_is_found_only_with_its_key() -> None:
    store = ResponseStore(10, 2**20, 0.0)
    store.add(finished("a"))
    store.add(finished("b", owner=None))  # made without keys: any caller finds it
    assert store.get("a", KEY).response_id == "a"
    assert store.get("b", OTHER).response_id == "b"
    for key in (OTHER, None):
        with pytest.raises(APIError) as caught:
            store.get("a", key)
        assert caught.value.status == 404  # the unknown id's answer: nothing to probe
    with pytest.raises(APIError, match="no stored response 'z'"):
        store.get("z", KEY)


def test_a_store_of_none_keeps_nothing() -> None:
    store = ResponseStore(0, 2**20, 0.0)
    assert not store.enabled
    store.add(finished("a"))
    assert len(store) == 0
