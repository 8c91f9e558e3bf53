"""Run a function in a child forked from the test process, under a timeout, and get back what it returned or raised.

A bad input that kills the process (SIGBUS under a memory map, a crash in native code) or hangs it must fail its
own case, naming it, not the whole suite. A fresh interpreter per case costs seconds of imports (torch, pyarrow,
transformers); a fork of the already-imported pytest process costs milliseconds. Fork copies only the calling
thread, so thread pools the parent used are gone in the child: the child turns off the tokenizers' pool and keeps
torch to one thread rather than wait on locks a dead pool thread held.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Outcome:
    """What the function did: returned `value`, or raised an exception whose classes (most derived first, as
    `module.qualname`) are `raised`, with message `message`."""

    value: Any = None
    raised: tuple[str, ...] = ()
    message: str = ""
    trace: str = ""


class ChildFailed(AssertionError):
    """The child died by a signal, exited without an answer, or ran past its timeout."""


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _child(fn: Callable[[], Any], send) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    try:
        outcome = Outcome(value=fn())
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent, SystemExit included
        outcome = Outcome(raised=tuple(qualified(c) for c in type(e).__mro__), message=str(e),
                          trace=traceback.format_exc())
    try:
        send.send(outcome)
    except Exception as e:  # a value that does not pickle: say so rather than die without an answer
        send.send(Outcome(raised=(qualified(type(e)),), message=f"the child's answer did not pickle: {e}"))
    send.close()


def run_forked(fn: Callable[[], Any], *, name: str, timeout: float) -> Outcome:
    """`fn()` in a forked child; its return value must pickle. Raises `ChildFailed` naming `name` when the child
    is killed by a signal, exits without answering, or runs past `timeout` seconds (it is then killed)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, send), name=f"case {name}")
    proc.start()
    send.close()  # the child holds the only write end: its death is an EOF here
    try:
        if not recv.poll(timeout):
            proc.kill()
            proc.join()
            raise ChildFailed(f"case {name}: no answer within {timeout:g} s (killed)")
        try:
            outcome = recv.recv()
        except EOFError:
            proc.join(timeout)
            code = proc.exitcode
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            raise ChildFailed(f"case {name}: the child died without an answer ({why})") from None
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        return outcome
    finally:
        recv.close()
