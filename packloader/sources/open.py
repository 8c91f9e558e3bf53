"""`open_source(path_or_paths)`: the right reader for a file, a list of files, a glob or a directory.

Detection, in order:
- `format=` given ("parquet", "jsonl", "mds", "directory"): that reader;
- a directory with `index.json`: MDS; with Parquet files (recursively): those, as Parquet; with JSONL files
  (.jsonl, .jsonl.gz, .jsonl.zst, .json, .ndjson): those, as JSONL; otherwise every file in it, one document per file;
- files: by extension (.parquet / .pq; .jsonl, .jsonl.gz, .jsonl.zst, .json, .json.gz, .ndjson); all must agree;
- a path that does not exist but holds a glob character (`*`, `?`, `[`): its matches.
A path that does not exist is a FileNotFoundError naming it.
"""

from __future__ import annotations

import glob as globlib
import os
from pathlib import Path
from typing import Sequence

from packloader.sources.reader import ShardedSource

FORMATS = ("parquet", "jsonl", "mds", "directory")
_PARQUET = (".parquet", ".pq")
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".json", ".json.gz", ".json.zst", ".ndjson", ".ndjson.gz",
          ".ndjson.zst")


def format_of(path: str) -> str | None:
    name = path.lower()
    if name.endswith(_PARQUET):
        return "parquet"
    if name.endswith(_JSONL):
        return "jsonl"
    return None


def _expand(paths: Sequence[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.exists(p):
            out.append(p)
        elif any(c in p for c in "*?["):
            matches = sorted(globlib.glob(p, recursive=True))
            if not matches:
                raise FileNotFoundError(f"no files match {p}")
            out.extend(matches)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def _files_under(path: str) -> list[str]:
    return sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith("."))


def _detect_directory(path: str) -> tuple[str, list[str]]:
    if os.path.exists(os.path.join(path, "index.json")):
        return "mds", [path]
    files = _files_under(path)
    for fmt in ("parquet", "jsonl"):
        chosen = [f for f in files if format_of(f) == fmt]
        if chosen:
            return fmt, chosen
    return "directory", [path]


def open_source(
    path_or_paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    column: str | None = None,
    format: str | None = None,  # noqa: A002 - the natural name for the caller
    empty: str = "error",
    pattern: str = "**/*",
    files_per_shard: int = 256,
    errors: str = "error",
) -> ShardedSource:
    """Open shards as a `Source`. `column` is the Parquet column, JSONL field or MDS column (None: auto-detect).

    `empty="skip"` leaves empty documents out and counts them (`source.skipped`); `pattern`, `files_per_shard` and
    `errors` apply to a plain directory of text files (see `DirectorySource`).
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if isinstance(path_or_paths, (str, os.PathLike)):
        paths = [os.fspath(path_or_paths)]
    else:
        paths = [os.fspath(p) for p in path_or_paths]
    if not paths:
        raise ValueError("open_source needs at least one path")
    paths = _expand(paths)

    dirs = [p for p in paths if os.path.isdir(p)]
    if dirs:
        if len(paths) > 1:
            raise ValueError(f"pass one directory or a list of files, not a mix: {paths}")
        if format is None:
            fmt, paths = _detect_directory(dirs[0])
        elif format in ("parquet", "jsonl"):
            fmt, paths = format, [f for f in _files_under(dirs[0]) if format_of(f) == format]
            if not paths:
                raise FileNotFoundError(f"no {format} files under {dirs[0]}")
        else:
            fmt = format
    else:
        kinds = {format_of(p) for p in paths}
        if format is not None:
            fmt = format
        elif len(kinds) == 1 and None not in kinds:
            fmt = kinds.pop()
        else:
            unknown = [p for p in paths if format_of(p) is None]
            raise ValueError(
                f"cannot tell the format of {unknown or paths} from the extension (mixed or unknown); "
                f"pass format= one of {FORMATS}"
            )

    if fmt == "parquet":
        from packloader.sources.parquet import ParquetSource

        return ParquetSource(paths, column=column, empty=empty)
    if fmt == "jsonl":
        from packloader.sources.jsonl import JsonlSource

        return JsonlSource(paths, field=column, empty=empty)
    if fmt == "mds":
        from packloader.sources.mds import MdsSource

        if len(paths) != 1:
            raise ValueError(f"MDS takes one directory (the one holding index.json), got {paths}")
        return MdsSource(paths[0], column=column, empty=empty)
    from packloader.sources.directory import DirectorySource

    if len(paths) != 1 or not os.path.isdir(paths[0]):
        raise ValueError(f"format='directory' takes one directory, got {paths}")
    return DirectorySource(paths[0], pattern, files_per_shard=files_per_shard, errors=errors, empty=empty)
