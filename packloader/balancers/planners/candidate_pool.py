"""Threads that plan `auto`'s candidates at once at scale. The planners' kernels release the GIL (numba
nogil), so on idle cores a step costs about its slowest candidate rather than the sum of all; the caller takes
the results in its own order, so the plan is the one planned in turn. Off by default (PACKLOADER_AUTO_THREADS,
default 1): on the shared 2-core development machine threads cost more than they saved (docs/benchmarks.md,
"Planning speed (issue 25)")."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

THREADS_ENV = "PACKLOADER_AUTO_THREADS"

T = TypeVar("T")


def auto_threads() -> int:
    """Threads from PACKLOADER_AUTO_THREADS: a whole number, 1 (the default) for candidates in turn."""
    text = os.environ.get(THREADS_ENV, "1").strip() or "1"
    n = int(text) if text.isdigit() else 0
    if n < 1:
        raise ValueError(f"{THREADS_ENV}={text!r}: expected a whole number of threads, 1 or more")
    return n


class CandidatePool:
    """A thread pool made on first use in each process (a forked child does not inherit the parent's threads)
    and left out when the planner is pickled."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None

    def start(self, fn: Callable[..., T], jobs: dict[int, tuple]) -> dict[int, Future]:
        """fn(*args) for every job, started at once; {} when threads are off or there is one job."""
        if self.threads <= 1 or len(jobs) < 2:
            return {}
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="packloader-auto")
            self._pid = os.getpid()
        return {k: self._pool.submit(fn, *args) for k, args in jobs.items()}

    def __getstate__(self) -> dict:
        return {"threads": self.threads, "_pool": None, "_pid": None}
