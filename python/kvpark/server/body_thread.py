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
"""

from __future__ import annotations

import json
import json.scanner
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

ON_LOOP_BYTES = 256 * 1024  # the C parser takes ~1-3 ms for this much: fine on the event loop
PARSE_SWITCH_S = 0.0005
_SLICE = 4096  # objects freed at once by release(): well under a millisecond

T = TypeVar("T")
_lock = threading.Lock()
_parsing = 0  # large parses running: the switch interval is restored when the last one ends
_saved_interval = 0.0


def interruptible_loads(raw: bytes) -> object:
    """``json.loads`` as bytecode (the pure-Python scanner), so other threads get the GIL."""
    decoder = json.JSONDecoder()
    make_scanner = vars(json.scanner)["py_make_scanner"]  # public in the module, not in its stubs
    decoder.scan_once = make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder.decode(raw.decode("utf-8"))


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
