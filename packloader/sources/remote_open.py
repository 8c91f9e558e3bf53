"""Remote shards for `open_source`: s3:// (and other schemes' object) URLs, or paths inside a filesystem object
(`Storage(filesystem=fs).paths(...)`), expanded by listing and opened as Parquet or JSONL over ranged reads."""

from __future__ import annotations

from urllib.parse import urlsplit

from packloader.sources.errors import SourceError
from packloader.sources.format_registry import format_names, format_of, get_format, remote_formats
from packloader.sources.remote_http import HTTP_SCHEMES
from packloader.sources.storage import Storage, default_storage
from packloader.sources.unsupported import UnsupportedSourceError, url_scheme


def _format(url: str) -> str | None:
    """The format an object URL's name says; an http(s) URL's query (a signed URL's signature) is not its name."""
    return format_of(urlsplit(url).path if url_scheme(url) in HTTP_SCHEMES else url)


def _expand(paths: list[str], storage: Storage) -> list[str]:
    out = []
    for p in paths:
        name = urlsplit(p).path if url_scheme(p) in HTTP_SCHEMES else p  # an http query ("?") is not a glob
        if _format(p) is not None and not any(c in name for c in "*?["):
            out.append(p)
            continue
        found = storage.listing(p)
        if not found:
            raise FileNotFoundError(f"no objects match {p}")
        out.extend(found)
    return out


def _mds_directory(paths: list[str], storage: Storage, format: str | None) -> str | None:  # noqa: A002
    """The one prefix of `paths` that holds an MDS index.json (format "mds", or a folder whose listing has one)."""
    p = paths[0]
    index = p.endswith("/index.json")  # an MDS index, not a JSON Lines shard
    if len(paths) != 1 or format not in (None, "mds") or any(c in p for c in "*?[") or (
            _format(p) is not None and not index):
        if format == "mds":
            raise ValueError(f"format 'mds' reads one folder holding index.json; got {paths}")
        return None
    base = p[: -len("index.json")] if index else p
    base = base.rstrip("/")
    if format == "mds" or f"{base}/index.json" in storage.listing(base + "/"):
        return base
    return None


def open_remote(paths: list[str], *, storage: Storage | None, column: str | None, format: str | None,  # noqa: A002
                empty: str):
    """A ParquetSource or JsonlSource over the objects `paths` name (listing prefixes and globs), or an MdsSource
    for one prefix holding an MDS index.json."""
    storage = storage if storage is not None else default_storage()
    if format is not None and format not in remote_formats():
        raise _not_remote(paths[0], format)
    mds = _mds_directory(paths, storage, format)
    if mds is not None:
        return get_format("mds").open([mds], column=column, empty=empty, storage=storage)
    files = _expand(paths, storage)
    if len(set(files)) != len(files):
        dup = next(f for f in files if files.count(f) > 1)
        raise SourceError(f"{dup} is named twice; its documents would be read twice an epoch. Name each shard once")
    files = [f for f in files if not urlsplit(f).path.rsplit("/", 1)[-1].startswith((".", "_"))]
    kinds: dict[str | None, list[str]] = {}
    for f in files:
        kinds.setdefault(format if format is not None else _format(f), []).append(f)
    if format is None and (None in kinds or len(kinds) != 1):
        listed = "; ".join(f"{k or 'other'}: {', '.join(v[:5])}" for k, v in kinds.items())
        raise ValueError(f"cannot tell one format of the objects ({listed}); pass format= 'parquet' or 'jsonl' "
                         "or a glob that matches one kind")
    fmt, chosen = next(iter(kinds.items()))
    if fmt not in remote_formats():
        raise _not_remote(chosen[0], fmt)
    return get_format(fmt).open(chosen, column=column, empty=empty, storage=storage)


def _not_remote(path: str, format: str) -> UnsupportedSourceError:  # noqa: A002
    return UnsupportedSourceError(
        f"{path}: format {format!r} is not read from object storage; Parquet, JSONL (.gz/.zst) and MDS "
        f"are (of {format_names()}). Copy Arrow or Megatron shards to a local or mounted filesystem"
    )
