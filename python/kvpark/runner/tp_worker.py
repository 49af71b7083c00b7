"""The loop of tensor-parallel ranks 1..N-1: ``python -m kvpark.runner.tp_worker``, as rank 0
spawns them (runner/tp_group.py), or ``kvpark serve`` itself on a rank other than 0 under
torchrun (cli/main.py).

It joins the group, takes the engine's config from rank 0, loads its shard, says whether that
worked, then carries out rank 0's commands (runner/tp_rank.py) until ``stop``. Anything that
raises ends the process with status 1: its sockets close, so rank 0's next collective fails at
once and the server fails its requests and exits (runner/tp_runner.py). A worker kvpark spawned
also ends when the thread that spawned it does (``PR_SET_PDEATHSIG`` on Linux), and rank 0's exit
closes its sockets, which ends the others.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from kvpark.config import env

log = logging.getLogger("kvpark.runner.tp")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    parent = os.environ.get("KVPARK_TP_PARENT")
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(parent):  # it went before the signal was asked for
        sys.exit(1)


def run_worker() -> int:
    """The worker loop; the process's exit status."""
    from kvpark.runner.tp_group import join_group, leave  # torch
    from kvpark.runner.tp_rank import RankShard

    group = join_group()
    rank = group.rank
    try:
        config = group.receive()
        try:
            shard = RankShard(config, group)
        except BaseException:
            log.exception("rank %d: loading the model failed", rank)
            group.all_loaded(False)
            return 1
        if not group.all_loaded(True):
            return 1  # another rank failed to load: rank 0 says why
        log.info("rank %d of %d: ready", rank, group.world)
        while True:
            message = group.receive()
            if message[0] == "stop":
                return 0
            shard.handle(message)
    except Exception as e:  # rank 0 gone, or a step that raised here: this rank is done
        log.error("rank %d of the tensor-parallel group stops: %s: %s", rank, type(e).__name__, e)
        return 1
    finally:
        leave()


def main() -> int:
    logging.basicConfig(
        level=env.raw("KVPARK_LOG_LEVEL").upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [rank {os.environ.get('RANK', '?')}]: "
        "%(message)s",
    )
    _die_with_parent()
    return run_worker()


if __name__ == "__main__":
    sys.exit(main())
