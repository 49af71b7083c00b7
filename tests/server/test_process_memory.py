"""The server process's memory habits (process_memory.py): ``kvpark serve`` freezes what loading
made (``gc.freeze``) once the engine is ready, unless ``KVPARK_GC_FREEZE=off`` (a full collection
would otherwise walk ~1M long-lived objects, ~0.1 s with the GIL held, in the middle of the
streams), and caps glibc's malloc arenas unless ``MALLOC_ARENA_MAX`` is set."""

from __future__ import annotations

import asyncio
import gc
import platform
import weakref
from types import SimpleNamespace

import pytest

from kvpark.config.layers import ServerConfig
from kvpark.server import process_memory, run


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freezing_collects_the_garbage_first_then_freezes_the_rest() -> None:
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage  # a cycle: only the collector frees it
    kept = [_Cycle() for _ in range(3)]
    try:
        process_memory.freeze_loaded_objects()
        assert gone() is None, "loading's garbage was frozen instead of collected"
        assert gc.get_freeze_count() >= len(kept)
        before = gc.get_freeze_count()
        gc.collect()
        assert gc.get_freeze_count() == before  # a full collection leaves the frozen alone
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(("value", "frozen"), [(None, 1), ("on", 1), ("off", 0)])
def test_the_server_freezes_once_ready_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch, value: str | None, frozen: int
) -> None:
    if value is None:
        monkeypatch.delenv("KVPARK_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("KVPARK_GC_FREEZE", value)
    calls: list[None] = []
    monkeypatch.setattr(run, "freeze_loaded_objects", lambda: calls.append(None))
    engine = SimpleNamespace(ready=True, load_error=None, model_name="m")
    server = SimpleNamespace(should_exit=False)
    asyncio.run(run._watch_loading(server, engine, ServerConfig()))  # type: ignore[arg-type]
    assert len(calls) == frozen


def test_a_failed_load_freezes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[None] = []
    monkeypatch.setattr(run, "freeze_loaded_objects", lambda: calls.append(None))
    engine = SimpleNamespace(ready=False, load_error="ModelLoadError: no such file")
    server = SimpleNamespace(should_exit=False)
    asyncio.run(run._watch_loading(server, engine, ServerConfig()))  # type: ignore[arg-type]
    assert calls == [] and server.should_exit


def test_the_malloc_arenas_are_capped_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """glibc's own ``MALLOC_ARENA_MAX`` wins; otherwise ``mallopt`` takes the cap (on glibc)."""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert not process_memory.limit_malloc_arenas()
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert process_memory.limit_malloc_arenas() == (platform.libc_ver()[0] == "glibc")
