"""`open_source(path_or_paths)`: the right reader for a file, a list of files, a glob or a directory.

Detection, in order:
- `format=` given ("parquet", "jsonl", "mds", "directory"): that reader;
- a directory with `index.json`: MDS; otherwise the files `pattern` matches in it (default: all, recursively;
  hidden files left out) decide: all Parquet, as Parquet; all JSONL (.jsonl, .jsonl.gz, .jsonl.zst, .json,
  .ndjson), as JSONL; none of either, every file, one document per file. Files that only sit beside shards
  (`_SUCCESS`, `_metadata`, README, LICENSE, *.md) do not count. Any other mix (Parquet with JSONL, shards with
  other files) is a ValueError listing the files of each kind: nothing is read in part or left out unsaid;
  `format=` reads one kind on purpose;
- files: by extension (.parquet / .pq; .jsonl, .jsonl.gz, .jsonl.zst, .json, .json.gz, .ndjson); all must agree;
- a path that does not exist but holds a glob character (`*`, `?`, `[`): its matches.
First, `special_paths.open_special` takes what these rules do not: objects in place of paths (`datasets` objects,
lists of texts or dicts, generators: `objects.py`), URLs (an error: unsupported), Megatron `.bin`/`.idx` pairs
(`format="megatron"`), Arrow files (`.arrow`, `format="arrow"`) and `datasets` `save_to_disk` folders
(`format="hf-disk"`).
A path that does not exist is a FileNotFoundError naming it. Globs and directories are walked by `paths.walk_glob`:
symlinked directories are followed, a link back into the walk (a loop) is not, and a file named twice (the same
path twice, a symlinked alias, a hard link) is refused naming both paths (`paths.refuse_duplicates`).
"""

from __future__ import annotations

import os
from typing import Sequence

from packloader.sources.format_registry import detected_by_suffix, format_names, format_of, get_format
from packloader.sources.paths import has_magic, refuse_duplicates, walk_glob
from packloader.sources.reader import ShardedSource


def _expand(paths: Sequence[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.exists(p):
            out.append(p)
        elif has_magic(p):
            matches = walk_glob(p)
            if not matches:
                raise FileNotFoundError(f"no files match {p}")
            out.extend(matches)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def _files_under(path: str, pattern: str = "**/*") -> list[str]:
    """The files `pattern` matches under `path`, hidden ones (any part starting with ".") left out."""
    return [p for p in walk_glob(pattern, root=path)
            if os.path.isfile(p) and not any(part.startswith(".") for part in os.path.relpath(p, path).split(os.sep))]


def _is_side_file(path: str) -> bool:
    """Files that sit beside data shards without being data: `_SUCCESS`, `_metadata` (the "_" prefix pyarrow's
    datasets skip too), README and LICENSE files and Markdown notes."""
    name = os.path.basename(path).lower()
    return name.startswith("_") or name.startswith(("readme", "license", "licence")) or name.endswith(".md")


def _listing(paths: list[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return f"{shown}, ... ({len(paths)} files)" if len(paths) > limit else shown


def _detect_directory(path: str, pattern: str = "**/*") -> tuple[str, list[str]]:
    """The one format of the files `pattern` matches, or a ValueError listing the files of each kind: a directory
    mixing Parquet, JSONL and other files is refused, never read in part."""
    if os.path.exists(os.path.join(path, "index.json")):
        return "mds", [path]
    files = _files_under(path, pattern)
    kinds: dict[str, list[str]] = {}
    for f in files:
        kinds.setdefault(format_of(f) or "other", []).append(f)
    data = [k for k in detected_by_suffix() if k in kinds]
    if not data:
        return "directory", [path]
    other = [f for f in kinds.get("other", []) if not _is_side_file(f)]
    if len(data) == 1 and not other:
        if data[0] == "parquet":
            from packloader.sources.tokenize_parts import check_parts

            check_parts(path)  # a split tokenize's parts: all there, one whole, before anything is read
        return data[0], kinds[data[0]]
    groups = [(k, kinds[k]) for k in data] + ([("other", other)] if other else [])
    listed = "; ".join(f"{k}: {_listing(fs)}" for k, fs in groups)
    raise ValueError(
        f"{path} mixes file formats ({listed}); nothing was read. Pass format= (--format) to read one kind and "
        "leave the rest out, or a pattern (--pattern) that matches one kind"
    )


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
    Objects in place of paths (a `datasets` object, a list of texts or dicts, a generator) are opened too.

    `empty="skip"` leaves empty documents out and counts them (`source.skipped`); `pattern` selects the files of a
    directory (format detection included); `files_per_shard` and `errors` apply to a plain directory of text files
    (see `DirectorySource`).
    """
    if format is not None:
        get_format(format)  # an unknown name: "format must be one of (...)"
    from packloader.sources.special_paths import open_special  # objects, URLs, Megatron, Arrow, save_to_disk

    special, path_or_paths = open_special(path_or_paths, column=column, format=format, empty=empty)
    if special is not None:
        return special
    if isinstance(path_or_paths, (str, os.PathLike)):
        paths = [os.fspath(path_or_paths)]
    else:
        paths = [os.fspath(p) for p in path_or_paths]
    if not paths:
        raise ValueError("open_source needs at least one path")
    paths = _expand(paths)
    refuse_duplicates(paths)

    dirs = [p for p in paths if os.path.isdir(p)]
    if dirs:
        if len(paths) > 1:
            raise ValueError(f"pass one directory or a list of files, not a mix: {paths}")
        if format is None:
            fmt, paths = _detect_directory(dirs[0], pattern)
        elif format in detected_by_suffix():
            fmt, paths = format, [f for f in _files_under(dirs[0], pattern) if format_of(f) == format]
            if not paths:
                raise FileNotFoundError(f"no {format} files under {dirs[0]} match {pattern!r}")
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
                f"pass format= one of {format_names()}"
            )

    return get_format(fmt).open(paths, column=column, empty=empty, pattern=pattern, files_per_shard=files_per_shard,
                                errors=errors)
