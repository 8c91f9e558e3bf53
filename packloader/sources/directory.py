"""A directory of text files as a source: one document per file, sorted paths split into shards of N files.

`stdlib_corpus()` is the embedded demo corpus: the Python standard library's own `.py` files (about 1,800 files and
30 MB on CPython 3.11), found through `sysconfig`, with site-packages left out. It needs no download, and its
lengths have the long tail of real code (a few files over 100K tokens, many under 1K).

Files are read whole when their row is read. A file that is not UTF-8 is an error naming it; with
`errors="skip"` every file is read and checked once when the source opens, and the files that fail are left out of
the row space and counted in `source.skipped` (so shard membership is stable for a given directory and options).
Empty files are found from their size, at no cost.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from packloader.sources.base import RawDocument
from packloader.sources.errors import NonUtf8Error, check_policy
from packloader.sources.identity import file_set_identity
from packloader.sources.paths import refuse_duplicates, walk_glob
from packloader.sources.reader import ShardedSource


def _decode(path: str, data: bytes) -> str:
    text = data.decode("utf-8")
    return text[1:] if text.startswith("\ufeff") else text


class DirectorySource(ShardedSource):
    """Every file under `root` matching `pattern` (a `Path.glob` pattern such as "**/*.py"), one document each."""

    def __init__(
        self,
        root: str | Path,
        pattern: str = "**/*",
        *,
        files_per_shard: int = 256,
        errors: str = "error",
        empty: str = "error",
        exclude_dirs: Sequence[str] = (),
        include_hidden: bool = False,
    ) -> None:
        super().__init__(empty=empty)
        check_policy("errors", errors)
        if files_per_shard < 1:
            raise ValueError(f"files_per_shard must be >= 1, got {files_per_shard}")
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"directory not found: {self.root}")
        self.pattern = pattern
        self.errors = errors
        excluded = set(exclude_dirs)
        files = []
        for p in map(Path, walk_glob(pattern, root=str(self.root), include_hidden=include_hidden)):
            parts = p.relative_to(self.root).parts
            if excluded.intersection(parts[:-1]):
                continue
            if not include_hidden and any(part.startswith(".") for part in parts):
                continue
            if p.is_file():
                files.append((p.relative_to(self.root).as_posix(), str(p)))
        files.sort()
        paths = [p for _, p in files]
        refuse_duplicates(paths)
        if errors == "skip":
            paths = [p for p in paths if self._utf8_or_count(p)]
        if not paths:
            raise FileNotFoundError(f"no files match {pattern!r} under {self.root}")
        self._files = paths
        self._sizes = np.array([Path(p).stat().st_size for p in paths], dtype=np.int64)
        n = len(paths)
        self._bounds = list(range(0, n, files_per_shard)) + [n]
        names = [
            f"{self.root} [files {a}..{b - 1} of {n}, {pattern}]" for a, b in zip(self._bounds[:-1], self._bounds[1:])
        ]
        self._open_shards(names, [b - a for a, b in zip(self._bounds[:-1], self._bounds[1:])])
        # a shard's identity (sources/identity.py): its files' names and sizes, cheap for thousands of small files
        self.identities = [file_set_identity([os.path.relpath(p, self.root) for p in paths[a:b]], self._sizes[a:b])
                           for a, b in zip(self._bounds[:-1], self._bounds[1:])]

    @property
    def pretokenized(self) -> bool:
        return False

    @property
    def files(self) -> list[str]:
        """Every file in the row space, in shard and row order."""
        return list(self._files)

    def _utf8_or_count(self, path: str) -> bool:
        try:
            _decode(path, Path(path).read_bytes())
            return True
        except UnicodeDecodeError:
            self.skipped.add("non-UTF-8 files", path)
            return False

    def _file(self, shard: int, raw_row: int) -> str:
        return self._files[self._bounds[shard] + raw_row]

    def _location(self, shard: int, raw_row: int) -> str:
        return self._file(shard, raw_row)

    def _read_raw(self, shard: int, raw_rows: np.ndarray) -> Iterator[RawDocument]:
        for r in raw_rows.tolist():
            path = self._file(shard, r)
            try:
                yield _decode(path, Path(path).read_bytes())
            except UnicodeDecodeError as e:
                raise NonUtf8Error(
                    f"{path}: not valid UTF-8 ({e}); open the source with errors='skip' to skip and count such files"
                ) from e

    def _empty_rows(self, shard: int) -> np.ndarray:
        a, b = self._bounds[shard], self._bounds[shard + 1]
        empty = self._sizes[a:b] == 0
        for j in np.flatnonzero((self._sizes[a:b] > 0) & (self._sizes[a:b] <= 3)).tolist():  # a lone BOM
            empty[j] = Path(self._files[a + j]).read_bytes() == b"\xef\xbb\xbf"
        return empty


def stdlib_corpus(files_per_shard: int = 64) -> DirectorySource:
    """The Python standard library's .py files (no site-packages): the demo corpus that needs no download.

    Empty files (many `__init__.py`) and the few deliberately non-UTF-8 test files are skipped and counted.
    """
    root = sysconfig.get_paths()["stdlib"]
    return DirectorySource(
        root,
        "**/*.py",
        files_per_shard=files_per_shard,
        errors="skip",
        empty="skip",
        exclude_dirs=("site-packages", "dist-packages", "__pycache__"),
    )
