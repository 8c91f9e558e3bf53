"""One gloo harness for every multi-rank test: start N processes, run fn(rank, world_size, *args) in each with
torch.distributed initialised, and return each rank's result (or raise with every failing rank's traceback).

The ranks are forked from a forkserver that imported torch, packloader and the test tools once (per pytest
process): a spawned rank paid 2-3 s of CPU importing them, over 100 ranks in the suite. A forked rank starts from
fresh imports, never from the test process's state (its threads, its torch settings), as a spawned one did; it
takes the test process's environment, working directory and sys.path as they are at the call, like spawn.
"""

from __future__ import annotations

import atexit
import multiprocessing.forkserver
import os
import socket
import sys
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports anyway; a module missing here is skipped by the forkserver (ImportError is ignored).
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.multiprocessing", "pyarrow", "pyarrow.parquet", "msgspec",
           "numba", "pytest", "packloader", "helpers.distributed"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs: then it already has them
    return ctx


@atexit.register
def _stop_forkserver() -> None:
    """Reap the server at exit, so its CPU and its ranks' count in the test process's RUSAGE_CHILDREN."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        server._stop()


def _entry(fn, rank: int, world_size: int, port: int, args: tuple, queue, env: dict, cwd: str, path: list) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    # the server imported torch before this rank's environment was set: apply its thread count as a spawned
    # rank's first torch op did (one thread unless the caller set OMP_NUM_THREADS)
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])) if os.environ["OMP_NUM_THREADS"].isdigit()
                          else 1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent re-raises with this text
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """fn must be a module-level function (it is pickled into the rank processes)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    here = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, *here), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as queue_mod

    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except queue_mod.Empty:
                errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(results))}")
                break
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
