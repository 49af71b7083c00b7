"""The processes of a tensor-parallel group (``--tensor-parallel N``) and their torch.distributed
group: who starts them, how rank 0 talks to the others, how a rank that is gone is noticed.

::

    rank 0 (the server)          ranks 1..N-1 (tp_worker.py)
    start_group: spawns them      join_group
    ── send(message) ──────────► receive()          through the group's key-value store (the
                                                     TCPStore of the rendezvous): rank 0 sets
                                                     key n and goes on; a worker waits for it
                                                     as long as it takes (between steps)
    ◄──── collectives ─────────► collectives         the steps' group: gloo on the CPU, NCCL on
                                                     CUDA, every op bounded by KVPARK_TP_TIMEOUT
    ◄──── all_loaded ──────────► all_loaded          the default group: joining and loading,
                                                     bounded by STARTUP (a large model loads long)

Commands go through the store, not a collective, so that rank 0 never waits on a rank without a
deadline: a broadcast on a group without one blocked rank 0 for as long as a stopped rank stayed
stopped. Rank 0 deletes command n - 1 when it sets n: every command ends in a collective of every
rank, so each has read it.

kvpark starts the workers itself (``python -m kvpark.runner.tp_worker`` on 127.0.0.1, the store's
port picked by the kernel), or ``torchrun`` starts every rank (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK`` in the environment): rank 0 serves and the others
run the worker loop. Rank 0 checks the workers it spawned before every command; a collective
with a rank that is gone fails at once (its socket closes) or at the timeout.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvpark.config.env import tp_timeout_s
from kvpark.runner.failures import RunnerFailed
from kvpark.runner.tp_checks import SPAWNED, torchrun_world

log = logging.getLogger("kvpark.runner.tp")
TCPStore = dist.TCPStore  # type: ignore[attr-defined]  # torch's stubs do not name them
PrefixStore = dist.PrefixStore  # type: ignore[attr-defined]
FOREVER = timedelta(days=365)  # how long a worker waits for rank 0's next command
COMMANDS = "kvpark_tp/"  # the prefix of the commands' keys in the store
STARTUP = timedelta(minutes=10)  # every rank joins and loads its shard within it


@dataclass
class TpGroup:
    rank: int
    world: int
    device: torch.device
    store: Any  # the commands' store (a PrefixStore over the rendezvous's)
    steps: Any  # the group of the steps' collectives (a ProcessGroup, KVPARK_TP_TIMEOUT)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # rank 0's spawned
    sent: int = 0  # commands sent (rank 0) or received (the others)

    def send(self, message: object) -> None:
        """Rank 0: one command to every other rank; returns at once."""
        self.check_workers()
        self.sent += 1
        self.store.set(str(self.sent), pickle.dumps(message))
        if self.sent > 1:  # every rank read it: it ended in a collective of all of them
            self.store.delete_key(str(self.sent - 1))

    def receive(self) -> Any:
        """The other ranks: the next command from rank 0 (waits as long as it takes; raises
        when rank 0's store is gone)."""
        self.sent += 1
        key = str(self.sent)
        self.store.wait([key], FOREVER)
        return pickle.loads(self.store.get(key))

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (each rank calls it with its own), within
        KVPARK_TP_TIMEOUT."""
        return _all(ok, self.device, self.steps)

    def all_loaded(self, ok: bool) -> bool:
        """``all_ok`` after loading: the slowest rank's load may take up to ``STARTUP``."""
        return _all(ok, self.device, None)

    def check_workers(self) -> None:
        """RunnerFailed if a worker rank 0 spawned has exited."""
        for rank, proc in enumerate(self.workers, 1):
            code = proc.poll()
            if code is not None:
                raise RunnerFailed(
                    f"rank {rank} of the tensor-parallel group exited (status {code})"
                )

    def close(self) -> None:
        """Rank 0, with nothing in flight: stop the workers and leave the group."""
        try:
            self.send(("stop", None, []))
        except Exception as e:  # a rank already gone: nothing to tell
            log.warning("stopping the tensor-parallel workers: %s", e)
        for proc in self.workers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        leave()


def _all(ok: bool, device: torch.device, group: Any) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def backend_of(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def local_device(kind: str, local_rank: int) -> torch.device:
    """The rank's device: ``cuda:LOCAL_RANK`` on CUDA, else the CPU."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def start_group(world: int, device_kind: str) -> TpGroup:
    """Rank 0's side: join torchrun's group, or spawn ranks 1..world-1 and make one."""
    launched = torchrun_world()
    if launched is not None:
        rank, size = launched
        if size != world or rank != 0:
            raise ValueError(
                f"--tensor-parallel {world} under a launcher of {size} processes (this is rank "
                f"{rank}): start {world} processes, one a rank"
            )
        device = local_device(device_kind, int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend_of(device), timeout=STARTUP)
        return TpGroup(0, world, device, _commands(None), _steps(device))
    device = local_device(device_kind, 0)
    store = TCPStore("127.0.0.1", 0, world, True, timeout=STARTUP, wait_for_workers=False)
    workers = [_spawn(rank, world, store.port, device_kind) for rank in range(1, world)]
    try:
        dist.init_process_group(
            backend_of(device), store=store, rank=0, world_size=world, timeout=STARTUP
        )
        steps = _steps(device)
    except Exception:
        for proc in workers:
            proc.kill()
        raise
    log.info("tensor parallel: %d ranks on %s (%s)", world, device.type, backend_of(device))
    return TpGroup(0, world, device, _commands(store), steps, workers)


def _spawn(rank: int, world: int, port: int, device_kind: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        KVPARK_TP_DEVICE=device_kind,
        KVPARK_TP_PARENT=str(os.getpid()),
    )
    env[SPAWNED] = "1"
    return subprocess.Popen([sys.executable, "-m", "kvpark.runner.tp_worker"], env=env)


def join_group() -> TpGroup:
    """A worker's side: the group rank 0 (spawned) or torchrun (env) set up."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kind = os.environ.get("KVPARK_TP_DEVICE", "auto")
    device = local_device(kind, int(os.environ.get("LOCAL_RANK", str(rank))))
    store = None
    if os.environ.get(SPAWNED):
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = TCPStore(addr, port, world, False, timeout=STARTUP)
        dist.init_process_group(
            backend_of(device), store=store, rank=rank, world_size=world, timeout=STARTUP
        )
    else:
        dist.init_process_group(backend_of(device), timeout=STARTUP)
    return TpGroup(rank, world, device, _commands(store), _steps(device))


def _steps(device: torch.device) -> Any:
    """The steps' group, every rank at once: the default group's ranks, each collective bounded
    by KVPARK_TP_TIMEOUT (a rank that stopped answering fails the step, not the server's
    loading)."""
    return dist.new_group(backend=backend_of(device), timeout=timedelta(seconds=tp_timeout_s()))


def _commands(store: Any) -> Any:
    """The commands' store: ``store`` (the one kvpark made) or the default group's (torchrun's
    rendezvous), under a prefix of its own."""
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    return PrefixStore(COMMANDS, store)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
