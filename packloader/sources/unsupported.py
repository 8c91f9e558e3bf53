"""What packloader cannot read yet says so, and lists what it can: never a FileNotFoundError for a URL."""

from __future__ import annotations

import os

from packloader.sources.errors import SourceError

SUPPORTED = (
    "local paths (a file, a glob, a directory or a list of them) to Parquet, JSONL (.gz/.zst), MDS, Arrow (.arrow) "
    "files, Megatron .bin/.idx pairs, a datasets save_to_disk folder or a directory of text files; "
    "a datasets Dataset, IterableDataset or one split of a DatasetDict; a list or generator of texts, token "
    "arrays or dicts; a Source object"
)
URL_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hf", "http", "https", "ftp", "sftp", "hdfs",
               "webhdfs", "oci", "oss", "r2", "file")


class UnsupportedSourceError(SourceError, TypeError):
    """A source of a kind packloader does not read (remote storage, a filesystem object, an unknown object)."""


def url_scheme(path: str) -> str | None:
    """The scheme of `scheme://...` (s3, gs, hf, https, ...), or None for a local path."""
    head, sep, _ = path.partition("://")
    if sep and head and head.replace("+", "").replace("-", "").isalnum() and os.sep not in head:
        return head.lower()
    return None


def excerpt(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def unsupported_url(path: str) -> UnsupportedSourceError:
    scheme = url_scheme(path)
    return UnsupportedSourceError(
        f"{path}: {scheme}:// URLs are not supported (remote and object storage is not read yet); supported: "
        f"{SUPPORTED}. Copy the shards to a local or mounted filesystem, or load them with datasets and pass the "
        "Dataset"
    )


def unsupported_object(obj) -> UnsupportedSourceError:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if kind.startswith(("pyarrow._fs", "pyarrow.fs", "fsspec", "s3fs", "gcsfs", "adlfs")):
        what = f"a filesystem object ({kind}) is not supported (remote and object storage is not read yet)"
    else:
        what = f"{kind} is not a supported source"
    return UnsupportedSourceError(f"{what}; supported: {SUPPORTED}")
