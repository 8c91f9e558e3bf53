"""The first stage of the loader's graph: the epoch order in chunks of documents, and loading each chunk's
lengths (and tokens) in reader threads (see `nodes.py` for the whole graph)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from torchdata.nodes import BaseNode

from packloader.sources.order import split_range
from packloader.sources.stream import DocumentStream


@dataclass(frozen=True)
class ChunkSpec:
    epoch: int
    start: int  # positions [start, stop) of the epoch's stream
    stop: int
    last: bool  # the last chunk of this epoch's span


@dataclass
class Chunk:
    spec: ChunkSpec
    ids: np.ndarray  # int64 document ids
    lengths: np.ndarray  # int64; -1 where not known yet (gather: other ranks' share)
    tokens: dict[int, np.ndarray] = field(default_factory=dict)


class ChunkNode(BaseNode[ChunkSpec]):
    """Positions of each epoch's span in chunks, epoch after epoch, from a start that the StepNode sets."""

    def __init__(self, span: Callable[[int], tuple[int, int]], chunk_docs: int, max_epochs: int | None = None) -> None:
        super().__init__()
        self.span = span
        self.chunk_docs = int(chunk_docs)
        self.max_epochs = max_epochs
        self._start = (0, None)
        self.epoch, self.pos = 0, 0

    def set_start(self, epoch: int, position: int | None) -> None:
        self._start = (int(epoch), position)

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch, pos = initial_state["epoch"], initial_state["pos"]
        else:
            self.epoch, pos = self._start
        lo, _ = self.span(self.epoch)
        self.pos = lo if pos is None else max(lo, int(pos))

    def next(self) -> ChunkSpec:
        while True:
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                raise StopIteration
            lo, hi = self.span(self.epoch)
            if self.pos < hi:
                break
            self.epoch += 1
            self.pos = self.span(self.epoch)[0]
        stop = min(hi, self.pos + self.chunk_docs)
        spec = ChunkSpec(self.epoch, self.pos, stop, stop == hi)
        self.pos = stop
        return spec

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}


class ChunkLoader:
    """The map function of the chunk stage: lengths of a chunk's documents, and their tokens where read."""

    def __init__(self, stream: DocumentStream, mode: str, rank: int = 0, world: int = 1) -> None:
        self.stream, self.mode, self.rank, self.world = stream, mode, rank, world

    def __call__(self, spec: ChunkSpec) -> Chunk:
        ids = self.stream.doc_ids(spec.epoch, np.arange(spec.start, spec.stop, dtype=np.int64))
        if self.mode == "column":
            return Chunk(spec, ids, self.stream.column_lengths(ids))
        if self.mode == "local":
            toks = self.stream.read(ids)
            lengths = np.fromiter((len(t) for t in toks), dtype=np.int64, count=len(toks))
            return Chunk(spec, ids, lengths, dict(zip(ids.tolist(), toks)))
        a, b = split_range(spec.start, spec.stop, self.world, self.rank)
        mine = ids[a - spec.start : b - spec.start]
        toks = self.stream.read(mine)
        lengths = np.full(len(ids), -1, dtype=np.int64)
        lengths[a - spec.start : b - spec.start] = [len(t) for t in toks]
        return Chunk(spec, ids, lengths, dict(zip(mine.tolist(), toks)))


