"""Stopping a node graph's background threads: when it is closed, when it is garbage-collected unclosed, and at
interpreter exit.

torchdata's threads are daemon threads. Left running at exit, each is frozen wherever it is when the interpreter
finalizes; one inside a C++ call that released the GIL (the rank store's poll while it waits for the other ranks'
plans, a torch op) dies taking the GIL back, with "terminate called without an active exception" and SIGABRT,
after the training script finished its work. A loader dropped without `close()` (a function's local, a loader
restored into a new object) leaves its threads running too, so the graph itself cannot be what the exit finds:
each started graph registers a finalizer holding its nodes, and the exit hook stops and waits for all of them.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

EXIT_JOIN_SECONDS = 30.0  # the exit waits this long in all for the threads to end (each finishes its item first)

_THREAD_ATTRS = ("_thread", "_read_thread", "_sort_thread")  # torchdata's Prefetcher / ParallelMapper threads
_CHILD_ATTRS = ("_it", "source", "chunks", "root")

_RUNNING: set[weakref.finalize] = set()  # one per started, unclosed graph
_LINGERING: list[tuple[list[threading.Thread], object]] = []  # threads that outlived a close, with their exchange


def shutdown(node, seen=None, threads: list | None = None) -> None:
    """Ask every node of a torchdata graph to stop (torchdata joins each thread for half a second only); the
    threads found are appended to `threads` for a caller that must see them end."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:
        return
    seen.add(id(node))
    if threads is not None:
        threads.extend(t for a in _THREAD_ATTRS if isinstance(t := getattr(node, a, None), threading.Thread))
        threads.extend(t for t in getattr(node, "_workers", ()) if isinstance(t, threading.Thread))
    if hasattr(node, "_shutdown"):
        try:
            node._shutdown()
        except Exception:  # noqa: BLE001 - cleanup only
            pass
    for attr in _CHILD_ATTRS:
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (int, str)):
            shutdown(child, seen, threads)


def _release(node, seen=None) -> None:
    """Drop a stopped graph's torchdata iterators now: left to the interpreter's teardown, their `__del__` stops
    them again after `sys` is gone ("Exception ignored in _ParallelMapperIter.__del__ ... 'maxsize'")."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen or isinstance(node, (int, str)):
        return
    seen.add(id(node))
    for attr in _CHILD_ATTRS:
        _release(getattr(node, attr, None), seen)
    if getattr(node, "_it", None) is not None:
        node._it = None


def _join(threads: list[threading.Thread], deadline: float) -> list[threading.Thread]:
    """Wait for `threads` until `deadline`; those still alive."""
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def stop(root, steps, *, final: bool, wait: float) -> None:
    """Stop a graph: its StepNode draws no more steps; `final`: its rank exchange stops too (a thread waiting for
    the other ranks' plans gives up), for a loader that is done; `wait`: seconds to wait for the threads. Threads
    still running are kept for the exit."""
    steps.close()
    exchange = getattr(steps, "exchange", None)
    if final and exchange is not None:
        exchange.stop.set()
    threads: list[threading.Thread] = []
    shutdown(root, threads=threads)
    alive = _join(threads, time.monotonic() + wait)
    if alive:
        _LINGERING[:] = [(ts, ex) for ts, ex in _LINGERING if any(t.is_alive() for t in ts)]
        _LINGERING.append((alive, exchange))
    elif final:
        _release(root)


def watch(graph, root, steps) -> weakref.finalize:
    """Register a started graph: stopped (final) when it is collected unclosed, and at exit. `detach()` the
    result when the graph is closed."""
    f = weakref.finalize(graph, _collected, root, steps)
    f.atexit = False  # the exit hook below stops it, with a wait
    _RUNNING.difference_update([x for x in _RUNNING if not x.alive])
    _RUNNING.add(f)
    return f


def _collected(root, steps) -> None:
    stop(root, steps, final=True, wait=0.0)  # the loader that owned it is gone: nobody waits for its plans


@atexit.register
def stop_all(timeout: float = EXIT_JOIN_SECONDS) -> None:
    """Stop every started graph's threads, and those that outlived a close, and wait for them (at most `timeout`
    seconds in all)."""
    deadline = time.monotonic() + timeout
    while _RUNNING:
        found = _RUNNING.pop().detach()
        if found is not None:
            _, _, (root, steps), _ = found
            stop(root, steps, final=True, wait=max(0.0, deadline - time.monotonic()))
    while _LINGERING:
        threads, exchange = _LINGERING.pop()
        if exchange is not None:
            exchange.stop.set()
        _join(threads, deadline)
