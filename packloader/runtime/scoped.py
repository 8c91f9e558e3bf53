"""A context variable set for the length of a `with` block: how attention layers find the context (slices,
Zeppelin) of the micro-batch that is running without it being threaded through the model's signature."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value: T) -> Iterator[T]:
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
