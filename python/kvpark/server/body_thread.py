"""A large request body parsed without stalling the streams the server is writing.

Python's C JSON parser holds the GIL from start to end: an 8 MiB body of small items takes it
for a few hundred milliseconds, on the event loop or on any other thread alike, and every stream
(and the engine thread, between its steps) waits that long. So a body over
:data:`ON_LOOP_BYTES` is parsed on a worker thread by the json module's own pure-Python scanner
(strings still go through its C ``scanstring``): it runs as bytecode, so the interpreter hands the
GIL to the threads that want it at every switch interval. For as long as such a parse runs the
switch interval is :data:`PARSE_SWITCH_S` rather than Python's 5 ms, so the event loop and the
engine thread wait at most about that for the GIL each time. The parse itself is several times
slower, which only the large body's own request pays.

The C code it still calls is given at most a piece of a long text at a time, as each call holds
the GIL throughout: the body is decoded from UTF-8 a :data:`PIECE` at a time, and a long string
is scanned a piece at a time, cut only where no escape straddles the cut
(:func:`scanstring_in_pieces`). An 8 MiB prompt was otherwise two calls of ~7 and ~15 ms.
"""

from __future__ import annotations

import codecs
import json
import json.decoder
import json.scanner
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

ON_LOOP_BYTES = 256 * 1024  # the C parser takes ~1-3 ms for this much: fine on the event loop
PARSE_SWITCH_S = 0.0005
_SLICE = 4096  # objects freed at once by release(): well under a millisecond
PIECE = 1 << 18  # characters (or bytes) one C call decodes or scans: ~0.5 ms
_ESCAPE_REACH = 12  # the longest escape: a surrogate pair, \\ud83d\\ude00

T = TypeVar("T")
_lock = threading.Lock()
_parsing = 0  # large parses running: the switch interval is restored when the last one ends
_saved_interval = 0.0


def interruptible_loads(raw: bytes) -> object:
    """``json.loads`` as bytecode (the pure-Python scanner), so other threads get the GIL."""
    decoder = json.JSONDecoder()
    decoder.parse_string = scanstring_in_pieces  # type: ignore[attr-defined]
    make_scanner = vars(json.scanner)["py_make_scanner"]  # public in the module, not in its stubs
    decoder.scan_once = make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder.decode(decode_in_pieces(raw))


def decode_in_pieces(raw: bytes) -> str:
    """``raw.decode("utf-8")`` a piece at a time; on a bad byte, the whole decode's own error."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        parts = [decoder.decode(raw[i : i + PIECE]) for i in range(0, len(raw), PIECE)]
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError:
        raw.decode("utf-8")  # raises, with the position in the whole body
        raise
    return "".join(parts)


_c_scanstring = vars(json.decoder)["c_scanstring"] or vars(json.decoder)["py_scanstring"]


def scanstring_in_pieces(s: str, end: int, strict: bool = True) -> tuple[str, int]:
    """The JSON string whose text starts at ``s[end]`` and the index past its closing quote, as
    ``json.decoder.scanstring`` gives them, with no C call over more than a piece of ``s``."""
    quote = s.find('"', end, end + PIECE)
    if quote != -1 and s[quote - 1] != "\\":  # it ends within a piece: one call
        return _c_scanstring(s, end, strict)  # type: ignore[no-any-return]
    parts: list[str] = []
    pos = end
    while (cut := _cut_after(s, pos)) is not None:
        piece = s[pos:cut] + '"'  # the piece, closed: each is a string of its own
        try:
            value, stop = _c_scanstring(piece, 0, strict)
        except json.JSONDecodeError as error:
            raise json.JSONDecodeError(error.msg, s, pos + error.pos) from None
        parts.append(value)
        if stop < len(piece):  # the string's own closing quote was in this piece
            return "".join(parts), pos + stop
        pos = cut
    try:  # the rest: within a piece, or no place to cut
        value, stop = _c_scanstring(s, pos, strict)
    except json.JSONDecodeError as error:
        if error.msg.startswith("Unterminated"):  # where the string started, not this piece
            raise json.JSONDecodeError(error.msg, s, end - 1) from None
        raise
    return "".join([*parts, value]), stop


def _cut_after(s: str, pos: int) -> int | None:
    """A place a piece after ``pos`` can end with no escape cut in two: where no backslash is
    within reach before it, or at the backslash that starts an escape (an even run of
    backslashes before it) other than a surrogate pair's second half. None when the rest fits in
    one piece or the second half of the piece offers no such place."""
    target = pos + PIECE
    if target >= len(s):
        return None
    if s.rfind("\\", target - _ESCAPE_REACH, target) == -1:
        return target
    floor = pos + PIECE // 2
    b = s.rfind("\\", floor, target)
    while b > floor:
        run = 0
        while s[b - 1 - run] == "\\":
            run += 1
        low_half = s[b + 1 : b + 3].lower() == "ud" and s[b + 3 : b + 4].lower() in "cdef"
        if run % 2 == 0 and not low_half:
            return b
        b = s.rfind("\\", floor, b - run)
    return None


def release(value: object) -> None:
    """Free a parsed body a slice at a time. Dropping it whole frees every object of it in one C
    call, which holds the GIL as long as the parse's worst stretch (tens of milliseconds for a
    million strings); in slices the other threads get the GIL between them."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            item.clear()
        elif isinstance(item, list):
            while item:
                tail = item[-_SLICE:]
                del item[-_SLICE:]
                stack.extend(x for x in tail if isinstance(x, dict | list))
                del tail


async def parse_off_loop(raw: bytes, parse: Callable[[bytes, Callable[[bytes], object]], T]) -> T:
    """``parse(raw, interruptible_loads)`` on a worker thread, with the short switch interval."""
    return await run_in_threadpool(_with_short_switches, parse, raw)


def _with_short_switches(parse: Callable[[bytes, Callable[[bytes], object]], T], raw: bytes) -> T:
    global _parsing, _saved_interval
    with _lock:
        if _parsing == 0:
            _saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(PARSE_SWITCH_S)
        _parsing += 1
    try:
        return parse(raw, interruptible_loads)
    finally:
        with _lock:
            _parsing -= 1
            if _parsing == 0:
                sys.setswitchinterval(_saved_interval)
