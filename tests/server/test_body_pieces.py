"""The large-body parser (server/body_thread.py) against ``json.loads``: with pieces shrunk to a
few characters, so every string is cut many times, next to escapes, escaped quotes and surrogate
pairs, it gives the same values, and the same errors at the same positions."""

from __future__ import annotations

import json
import random

import pytest

from kvpark.server import body_thread
from kvpark.server.body_thread import decode_in_pieces, interruptible_loads

ALPHABET = ["a", " ", "\\", '"', "\n", "\u00e9", "\U0001f600", "\\\\", "\x01", "\udc00", "\ud800"]


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(body_thread, "PIECE", 32)


def outcome(parse: object, raw: bytes) -> object:
    try:
        return parse(raw)  # type: ignore[operator]
    except json.JSONDecodeError as error:
        return (error.msg, error.pos)
    except UnicodeDecodeError as error:  # a lone surrogate written as UTF-8 bytes
        return str(error)


def strict_loads(raw: bytes) -> object:
    """``json.loads`` of strict UTF-8 (given bytes, it lets surrogates through as the server
    does not: a lone surrogate written as bytes is no UTF-8)."""
    return json.loads(raw.decode("utf-8"))


def test_strings_cut_in_pieces_parse_as_json_loads_parses_them() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 300)))
        doc = json.dumps(
            {"k": text, "l": [text[: len(text) // 2], 1]}, ensure_ascii=rng.random() < 0.5
        )
        raw = doc.encode("utf-8", "surrogatepass")
        assert outcome(interruptible_loads, raw) == outcome(strict_loads, raw), doc


@pytest.mark.parametrize(
    "doc",
    [
        '{"k": "' + "a" * 100 + "\x01" + "b" * 50 + '"}',  # a raw control character
        '{"k": "' + "a\\\\" * 40 + '\\q"}',  # an unknown escape past many cuts
        '{"k": "' + "a" * 100,  # never closed: the error names where the string began
        '{"k": "' + '\\"' * 60 + '"}',  # escaped quotes only
    ],
)
def test_errors_and_escapes_match_json_loads(doc: str) -> None:
    assert outcome(interruptible_loads, doc.encode()) == outcome(json.loads, doc.encode())


def test_utf8_decoded_in_pieces_is_the_whole_decode() -> None:
    text = "naïve 😀 日本 " * 40  # multi-byte characters cut between pieces
    assert decode_in_pieces(text.encode()) == text
    bad = text.encode()[:101] + b"\xff" + text.encode()
    with pytest.raises(UnicodeDecodeError) as error:
        decode_in_pieces(bad)
    assert error.value.start == 101  # where the whole body has it, not where its piece does
