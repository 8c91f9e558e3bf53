"""A local disk cache of object blocks, bounded in bytes: later epochs and restarts read the blocks they already
fetched from disk. Blocks are keyed by URL, ETag, size and byte range (first and end byte, so a restart with
another block size never takes an old block for a new one), so a replaced object never serves stale bytes as its
new self. Least recently used blocks are evicted first; writes are atomic (a temporary file renamed), so
processes sharing the directory never see half a block."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict


class BlockCache:
    def __init__(self, directory: str, max_bytes: int) -> None:
        if int(max_bytes) < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory, self.max_bytes = os.fspath(directory), int(max_bytes)
        os.makedirs(self.directory, exist_ok=True)
        self.hits = self.misses = self.evictions = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + ".blk")

    def get(self, key: str, disk: bool = True) -> bytes | None:
        if not disk:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # recency for eviction
        except FileNotFoundError:
            self.misses += 1
            return None
        self.hits += 1
        return data

    def put(self, key: str, data: bytes, disk: bool = True) -> None:
        if not disk or len(data) > self.max_bytes:
            return  # a block larger than the whole cache is not kept
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            self._evict()

    def used_bytes(self) -> int:
        return sum(e.stat().st_size for e in os.scandir(self.directory) if e.name.endswith(".blk"))

    def _evict(self) -> None:
        entries = []
        for e in os.scandir(self.directory):
            if e.name.endswith(".blk"):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(s for _, s, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            total -= size
            self.evictions += 1


class MemoryBlocks:
    """The most recent blocks in memory, bounded in bytes, in front of an optional disk `BlockCache`: a shard's
    footer and the blocks its row groups share are fetched once however many handles read them."""

    def __init__(self, max_bytes: int, below: BlockCache | None = None) -> None:
        self.max_bytes, self.below = int(max_bytes), below
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"max_bytes": self.max_bytes, "below": self.below}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_bytes"], state["below"])

    def get(self, key: str, disk: bool = True) -> bytes | None:
        """The block from memory, else (with `disk`) from the disk cache below."""
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
                return data
        data = self.below.get(key) if self.below is not None and disk else None
        if data is not None:
            self._keep(key, data)
        return data

    def put(self, key: str, data: bytes, disk: bool = True) -> None:
        self._keep(key, data)
        if self.below is not None and disk:
            self.below.put(key, data)

    def _keep(self, key: str, data: bytes) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = data
            self._size += len(data)
            while self._size > self.max_bytes and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self._size -= len(old)
