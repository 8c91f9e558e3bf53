"""What every source and tokenizer offers the loader: shards of rows, read in an order the loader chooses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, Union

import msgspec
import numpy as np

# A row as a source returns it: text to tokenize, or tokens already (int32, 1-D).
RawDocument = Union[str, np.ndarray]


class DocKey(msgspec.Struct, frozen=True, array_like=True, order=True):
    """A document's stable id: its shard's index in the source's sorted shard list, and its row there."""

    shard: int
    row: int


@dataclass(frozen=True)
class Document:
    key: DocKey
    tokens: np.ndarray  # int32, EOS already appended when the tokenizer is configured to
    # SFT: True where a token is a loss target (the assistant's or the completion's); None: every token trains.
    # In the loader it rides on the token array (`sources.loss_mask.MaskedTokens`).
    loss_mask: np.ndarray | None = None
    entry: int | None = None  # the mixture entry it came from (an index into the mixture's entries); None: one source


class ShardInfo(msgspec.Struct, frozen=True):
    name: str  # a path, or a label for in-memory data; used in error messages
    num_rows: int


class Source(Protocol):
    """Shards of rows with random access by row index, so the loader owns order, sharding and resume."""

    @property
    def shards(self) -> Sequence[ShardInfo]: ...

    @property
    def pretokenized(self) -> bool: ...

    def read(self, shard: int, rows: np.ndarray) -> Iterator[RawDocument]:
        """Yield the given rows of a shard, in the order given. Errors name the shard and row."""
        ...

    def lengths(self, shard: int) -> np.ndarray | None:
        """Token count of every row, when the source knows it without reading tokens (a length column)."""
        ...


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 token arrays, without EOS (the loader appends it when configured)."""
        ...

    def decode(self, tokens: Sequence[int]) -> str: ...


class IterableSource:
    """A Python sequence of texts or token arrays as one in-memory shard (a one-shot iterator is materialised)."""

    def __init__(self, docs, name: str = "<iterable>") -> None:
        self._docs = list(docs)
        self._name = name
        kinds = {isinstance(d, str) for d in self._docs}
        if len(kinds) > 1:
            raise TypeError(f"{name}: mixes text and token rows; expected all str or all int arrays")
        self._pretokenized = bool(self._docs) and not isinstance(self._docs[0], str)
        if self._pretokenized:
            self._docs = [np.asarray(d, dtype=np.int32) for d in self._docs]

    @property
    def shards(self) -> Sequence[ShardInfo]:
        return [ShardInfo(self._name, len(self._docs))]

    @property
    def pretokenized(self) -> bool:
        return self._pretokenized

    def read(self, shard: int, rows: np.ndarray) -> Iterator[RawDocument]:
        if shard != 0:
            raise IndexError(f"{self._name}: shard {shard} does not exist (one shard)")
        for r in rows:
            yield self._docs[int(r)]

    def lengths(self, shard: int) -> np.ndarray | None:
        if not self._pretokenized:
            return None
        return np.array([len(d) for d in self._docs], dtype=np.int64)
