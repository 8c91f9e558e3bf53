"""The keys and values of a document's earlier slices, kept between micro-batches of a step with a gradient
accumulator each (what `SliceContext` reads and writes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch


@dataclass(eq=False)
class CacheEntry:
    start: int
    end: int
    k: torch.Tensor  # [end - start, Hkv, D], detached
    v: torch.Tensor
    gk: torch.Tensor | None = None  # gradient accumulated from later micro-batches
    gv: torch.Tensor | None = None

    def add_grad(self, gk: torch.Tensor | None, gv: torch.Tensor | None) -> None:
        if gk is not None:
            self.gk = gk.clone() if self.gk is None else self.gk.add_(gk)
        if gv is not None:
            self.gv = gv.clone() if self.gv is None else self.gv.add_(gv)


class SliceKVCache:
    """Keys and values of earlier slices: per layer and document, a list of token ranges `[start, end)` of the
    document with their (detached) keys/values and gradient accumulators."""

    def __init__(self) -> None:
        self._store: dict[tuple[Hashable, int], list[CacheEntry]] = {}

    def put(self, layer: Hashable, doc: int, start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> CacheEntry:
        entries = self._store.setdefault((layer, doc), [])
        for e in entries:
            if e.start < end and start < e.end:
                raise ValueError(f"KV cache already holds tokens {e.start}..{e.end - 1} of document {doc} at layer "
                                 f"{layer!r}; cannot store {start}..{end - 1} again")
        e = CacheEntry(start, end, self._keep(k), self._keep(v))
        entries.append(e)
        entries.sort(key=lambda x: x.start)
        return e

    @staticmethod
    def _keep(t: torch.Tensor) -> torch.Tensor:
        # a copy, not a view: a view would keep the whole micro-batch's key tensor alive
        return t.detach().clone()

    def find(self, layer: Hashable, doc: int, pos: int) -> CacheEntry | None:
        for e in self._store.get((layer, doc), ()):
            if e.start <= pos < e.end:
                return e
        return None

    def entry(self, layer: Hashable, doc: int, start: int, end: int) -> CacheEntry | None:
        for e in self._store.get((layer, doc), ()):
            if e.start == start and e.end == end:
                return e
        return None

    def drop(self, doc: int, start: int, end: int) -> None:
        """Forget tokens `start..end-1` of `doc` at every layer."""
        for key in [k for k in self._store if k[1] == doc]:
            self._store[key] = [e for e in self._store[key] if not (e.start == start and e.end == end)]
            if not self._store[key]:
                del self._store[key]

    def clear(self) -> None:
        self._store.clear()

    def __len__(self) -> int:
        return sum(len(v) for v in self._store.values())

    def nbytes(self) -> int:
        """Bytes held: keys, values and gradient accumulators."""
        n = 0
        for entries in self._store.values():
            for e in entries:
                for t in (e.k, e.v, e.gk, e.gv):
                    if t is not None:
                        n += t.numel() * t.element_size()
        return n


