"""The server process's memory habits (process_memory.py): ``kvpark serve`` freezes what loading
made (``gc.freeze``) once the engine is ready, unless ``KVPARK_GC_FREEZE=off`` (a full collection
would otherwise walk ~1M long-lived objects, ~0.1 s with the GIL held, in the middle of the
streams), and caps glibc's malloc arenas unless ``MALLOC_ARENA_MAX`` is set."""

from __future__ import annotations

import asyncio
import gc
import json
import platform
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

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
    frozen = weakref.ref(kept[0])
    try:
        process_memory.freeze_loaded_objects()
        assert gone() is None, "loading's garbage was frozen instead of collected"
        assert gc.get_freeze_count() >= len(kept)
        # a frozen cycle that becomes garbage is out of the collector's reach. (Not the frozen
        # count before and after: another thread may free a frozen object by its reference
        # count in between, as an xdist worker's once did.)
        del kept
        gc.collect()
        assert frozen() is not None, "a full collection walked the frozen objects"
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen() is None  # unfrozen, the collector frees it again


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


_RELEASE = """
import json, mmap, sys
import torch  # as a torch runner's server has it (the lean runner's has none to hand back)
from kvpark.server import process_memory as pm

def resident_kib(path):
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        f = line.split()
        if "-" in f[0] and len(f) >= 5 and ":" in f[3]:
            inside = len(f) >= 6 and f[5] == path
        elif inside and f[0] == "Rss:":
            total += int(f[1])
    return total

path = sys.argv[1]
with open(path, "rb") as f:
    lib = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
assert sum(lib[i] for i in range(0, len(lib), mmap.PAGESIZE)) >= 0  # touch every page
before = resident_kib(path)
advised = pm.release_gpu_libraries()
after = resident_kib(path)
product = float((torch.ones(64, 64) @ torch.ones(64, 64))[0, 0])  # still works after it
print(json.dumps({"before": before, "after": after, "advised": advised, "product": product}))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc")
def test_the_gpu_libraries_pages_are_handed_back(tmp_path: Path) -> None:
    """A library under ``nvidia/`` that only this fresh process maps, every page read: after
    the release its pages are gone from the process (a page other processes map too stays: the
    kernel reclaims only pages mapped once, so the test cannot use torch's, which pytest holds).
    torch's own GPU libraries are advised with it (the CUDA build), and torch still computes."""
    lib = tmp_path / "nvidia" / "lib" / "libkvpark_test_gpu.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(bytes(range(256)) * (8 << 12))  # 8 MiB
    out = subprocess.run(
        [sys.executable, "-c", _RELEASE, str(lib)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] >= 8 * 1024 - 64, got  # all of it was resident
    assert got["after"] < 1024, got
    assert got["advised"] >= (2 if "+cu" in torch.__version__ else 1), got
    assert got["product"] == 64.0


def test_the_gpu_libraries_stay_where_switched_off_or_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve`` asks for the release only on the CPU and unless ``KVPARK_RELEASE_GPU_LIBS=off``."""
    from kvpark.config.env import Knobs

    monkeypatch.setenv("KVPARK_RELEASE_GPU_LIBS", "off")
    assert not Knobs.from_env().release_gpu_libs
    monkeypatch.delenv("KVPARK_RELEASE_GPU_LIBS")
    assert Knobs.from_env().release_gpu_libs
