"""The processes of a tensor-parallel group (``--tensor-parallel N``) and their torch.distributed
groups: who starts them, how rank 0 talks to the others, how a rank that is gone is noticed.

::

    rank 0 (the server)          ranks 1..N-1 (tp_worker.py)
    start_group: spawns them      join_group
    ── send(message) ──────────► receive()          the command group: gloo, no deadline (a
                                                     worker waits here between steps)
    ◄──── collectives ─────────► collectives         the default group: gloo on the CPU, NCCL on
                                                     CUDA, every op bounded by KVPARK_TP_TIMEOUT

kvpark starts the workers itself (``python -m kvpark.runner.tp_worker`` on 127.0.0.1, the store's
port picked by the kernel), or ``torchrun`` starts every rank (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK`` in the environment): rank 0 serves and the others
run the worker loop. Rank 0 checks the workers it spawned before every command; a collective
with a rank that is gone fails at once (its socket closes) or at the timeout.
"""

from __future__ import annotations

import logging
import os
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
TCPStore = dist.TCPStore  # type: ignore[attr-defined]  # torch's stubs do not name it
FOREVER = timedelta(days=365)  # the command group's deadline: a worker waits there between steps


@dataclass
class TpGroup:
    rank: int
    world: int
    device: torch.device
    commands: Any  # the gloo group commands go through (a ProcessGroup)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)  # rank 0's spawned

    def send(self, message: object) -> None:
        """Rank 0: one command to every other rank."""
        self.check_workers()
        dist.broadcast_object_list([message], src=0, group=self.commands)

    def receive(self) -> Any:
        """The other ranks: the next command from rank 0 (waits as long as it takes)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (each rank calls it with its own)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

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
    timeout = timedelta(seconds=tp_timeout_s())
    launched = torchrun_world()
    if launched is not None:
        rank, size = launched
        if size != world or rank != 0:
            raise ValueError(
                f"--tensor-parallel {world} under a launcher of {size} processes (this is rank "
                f"{rank}): start {world} processes, one a rank"
            )
        device = local_device(device_kind, int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend_of(device), timeout=timeout)
        return TpGroup(0, world, device, dist.new_group(backend="gloo", timeout=FOREVER))
    device = local_device(device_kind, 0)
    store = TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
    workers = [_spawn(rank, world, store.port, device_kind) for rank in range(1, world)]
    try:
        dist.init_process_group(
            backend_of(device), store=store, rank=0, world_size=world, timeout=timeout
        )
    except Exception:
        for proc in workers:
            proc.kill()
        raise
    log.info("tensor parallel: %d ranks on %s (%s)", world, device.type, backend_of(device))
    commands = dist.new_group(backend="gloo", timeout=FOREVER)
    return TpGroup(0, world, device, commands, workers)


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
    timeout = timedelta(seconds=tp_timeout_s())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kind = os.environ.get("KVPARK_TP_DEVICE", "auto")
    device = local_device(kind, int(os.environ.get("LOCAL_RANK", str(rank))))
    if os.environ.get(SPAWNED):
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = TCPStore(addr, port, world, False, timeout=timeout)
        dist.init_process_group(
            backend_of(device), store=store, rank=rank, world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(backend_of(device), timeout=timeout)
    return TpGroup(rank, world, device, dist.new_group(backend="gloo", timeout=FOREVER))


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
