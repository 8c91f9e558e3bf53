"""Length-band upsampling of one mixture entry: in every pass over the entry, each document of at least
`min_tokens` tokens (its highest band) is taken `times` times, the copies shuffled into the pass with the rest
(per-source long-document upsampling, as long-context data recipes use it).

`UpsampledEntry` has the `DocumentStream` interface the mixture reads an entry through: its ids are
`pass * V + position` over the V documents and copies of a pass, each pass a permutation seeded by the entry's
seed and the pass; the documents themselves are read from a `DocumentStream` in file order (shuffle off), whose
id in its first epoch is the document's index over the shards.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from packloader.sources.order import _rng

_UPSAMPLE_TAG = 0x5550  # "UP": keeps the passes' permutations apart from the other orders of one seed


class LengthBand(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Documents of at least `min_tokens` tokens (EOS included, as trained) taken `times` times per pass."""

    min_tokens: Annotated[int, msgspec.Meta(ge=1)]
    times: Annotated[int, msgspec.Meta(ge=1, le=1000)]


def copies(lengths: np.ndarray, bands: list[LengthBand]) -> np.ndarray:
    """How many times each document is taken per pass: its highest band's `times`, 1 below every band."""
    out = np.ones(len(lengths), np.int64)
    for b in sorted(bands, key=lambda b: b.min_tokens):
        out[lengths >= b.min_tokens] = b.times
    return out


class UpsampledEntry:
    def __init__(self, base, bands: list[LengthBand], *, seed: int, shuffle: bool = True) -> None:
        self.base, self.seed, self.shuffle = base, int(seed), bool(shuffle)
        ids = np.arange(base.num_docs, dtype=np.int64)
        if base.has_column_lengths:
            self.base_lengths = base.column_lengths(ids)
        else:
            self.base_lengths = np.concatenate([[len(t) for t in base.read(ids[i:i + 1024])]
                                                for i in range(0, len(ids), 1024)]).astype(np.int64)
        self.copies = copies(self.base_lengths, bands)
        self.vmap = np.repeat(ids, self.copies)  # virtual document -> the document's index over the shards
        self.num_docs = int(len(self.vmap))
        self.offsets = np.concatenate([[0], np.cumsum(base.sizes)]).astype(np.int64)
        self._perms: dict[int, np.ndarray] = {}

    def __getattr__(self, name):  # tokenizer, EOS, source, sizes, ...: the entry's own stream's
        if name in ("base", "__setstate__", "__getstate__"):
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def has_column_lengths(self) -> bool:
        return True

    def _order(self, p: int) -> np.ndarray:
        perm = self._perms.get(p)
        if perm is None:
            perm = _rng(self.seed, p, _UPSAMPLE_TAG).permutation(self.num_docs) if self.shuffle \
                else np.arange(self.num_docs)
            if len(self._perms) > 3:
                self._perms.clear()
            self._perms[p] = perm
        return perm

    def flat(self, ids) -> np.ndarray:
        """Each id's document index over the shards."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty_like(ids)
        passes, pos = ids // self.num_docs, ids % self.num_docs
        for p in np.unique(passes).tolist():
            sel = passes == p
            out[sel] = self.vmap[self._order(int(p))[pos[sel]]]
        return out

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        b = self.flat(ids)
        shards = np.searchsorted(self.offsets, b, side="right") - 1
        return shards, b - self.offsets[shards]

    def column_lengths(self, ids) -> np.ndarray:
        return self.base_lengths[self.flat(ids)]

    def read(self, ids) -> list[np.ndarray]:
        return self.base.read(self.flat(ids))  # the base reads in file order: its id is the index over the shards
