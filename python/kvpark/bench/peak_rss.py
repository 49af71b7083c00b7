"""The peak resident memory of a server's process tree, read from ``/proc`` (Linux only).

Two measures, both over the process and all its descendants:

- ``rss_max_mib``: the largest sum of ``VmRSS`` seen by a thread that samples every
  ``interval_s`` while the server runs (it can miss a peak shorter than the interval);
- ``hwm_mib``: the sum of every live process's ``VmHWM`` (the kernel's own high-water mark of
  its RSS), read once at the end. Each process's peak is exact, but the peaks need not have
  coincided, so the sum is an upper bound of the tree's peak.

``peak_mib`` is the larger of the two: what the comparison's memory target is judged on. With one
process (llama-server, kvpark serve) the two agree to within a sample.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

PROC = Path("/proc")


def status_kib(text: str, field: str) -> int | None:
    """The value in kB of ``field`` (``VmRSS``, ``VmHWM``) in a ``/proc/<pid>/status`` text."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                return int(parts[0])
    return None


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """``root`` and every pid whose chain of parents (``parents[pid]`` = ppid) leads to it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue  # pids are reused; never loop on a stale table
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def parent_table(proc: Path = PROC) -> dict[int, int]:
    """pid -> ppid of every process, from ``/proc/<pid>/stat`` (the 4th field, after ``(comm)``)."""
    table = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1].isdigit():
            table[int(entry.name)] = int(fields[1])
    return table


def tree_kib(pids: Iterable[int], field: str, proc: Path = PROC) -> int:
    """The sum of ``field`` over ``pids`` (processes gone meanwhile count 0)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            total += status_kib((proc / str(pid) / "status").read_text(), field) or 0
    return total


@dataclass(frozen=True)
class PeakMemory:
    rss_max_mib: float
    hwm_mib: float
    processes: int  # in the tree at the end

    @property
    def peak_mib(self) -> float:
        return max(self.rss_max_mib, self.hwm_mib)

    def to_json(self) -> dict[str, float | int]:
        return {
            "peak_mib": round(self.peak_mib, 1),
            "rss_max_mib": round(self.rss_max_mib, 1),
            "hwm_mib": round(self.hwm_mib, 1),
            "processes": self.processes,
        }


class PeakRss:
    """``with PeakRss(pid) as peak: ...`` samples while the block runs; ``peak.result`` after it
    (read before the server is stopped: a dead process has no ``VmHWM``)."""

    def __init__(self, pid: int, interval_s: float = 0.2, proc: Path = PROC) -> None:
        self.pid, self.interval_s, self.proc = pid, interval_s, proc
        self.rss_max_kib = 0
        self.result: PeakMemory | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def _tree(self) -> list[int]:
        return descendants(self.pid, parent_table(self.proc))

    def _sample(self) -> None:
        while True:
            self.rss_max_kib = max(self.rss_max_kib, tree_kib(self._tree(), "VmRSS", self.proc))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        tree = self._tree()
        self.rss_max_kib = max(self.rss_max_kib, tree_kib(tree, "VmRSS", self.proc))
        hwm = tree_kib(tree, "VmHWM", self.proc)
        self.result = PeakMemory(self.rss_max_kib / 1024, hwm / 1024, len(tree))
