"""What packloader cannot read yet says so, and lists what it can: never a FileNotFoundError for a URL."""

from __future__ import annotations

import os

from packloader.sources.errors import SourceError

SUPPORTED = (
    "local paths (a file, a glob, a directory or a list of them) to Parquet, JSONL (.gz/.zst), MDS, Arrow (.arrow) "
    "files, Megatron .bin/.idx pairs, a datasets save_to_disk folder or a directory of text files; "
    "a datasets Dataset, IterableDataset or one split of a DatasetDict; a list or generator of texts, token "
    "arrays or dicts; a Source object; object storage: s3:// URLs (S3 and S3-compatible servers, through the AWS "
    "settings), gs:// and Azure (az://, abfs://) URLs with packloader[remote] installed (Parquet, JSONL, MDS), "
    "http(s):// URLs of single Parquet or JSONL files (ranged GETs), hf:// with huggingface_hub installed, "
    "and paths in any pyarrow.fs or fsspec filesystem object through "
    "packloader.Storage(filesystem=fs).paths('bucket/prefix/*.parquet') (Parquet and JSONL)"
)
READABLE_SCHEMES = {"s3": None, "s3a": None, "gs": "google.cloud.storage", "gcs": "google.cloud.storage",
                    "az": "azure.storage.blob", "abfs": "azure.storage.blob", "abfss": "azure.storage.blob",
                    "http": None, "https": None, "hf": "huggingface_hub"}
# scheme: the module it needs (None: always installed); packloader[remote] brings gs and az, packloader[hf] hf
URL_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hf", "http", "https", "ftp", "sftp", "hdfs",
               "webhdfs", "oci", "oss", "r2", "file")


def supported() -> str:
    """SUPPORTED, plus the formats registered beyond the built-in ones (`format_registry.register_format`)."""
    from packloader.sources.format_registry import added_formats

    added = "; ".join(f"{e.name} ({e.description}{': ' + ', '.join(e.suffixes) if e.suffixes else ''})"
                      for e in added_formats())
    return f"{SUPPORTED}; added formats: {added}" if added else SUPPORTED


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
        f"{path}: {scheme}:// URLs are not supported as they stand{_needs(scheme)}; supported: {supported()}. Pass the "
        "filesystem that reads them (Storage(filesystem=fs).paths(...)), copy the shards to a local or mounted "
        "filesystem, or load them with datasets and pass the Dataset"
    )


def _needs(scheme: str | None) -> str:
    package = READABLE_SCHEMES.get(scheme or "")
    extra = "hf" if package == "huggingface_hub" else "remote"
    return f" ({package} is not installed: pip install 'packloader[{extra}]')" if package else ""


def readable_url(path: str) -> bool:
    """Whether a URL is read as it stands: s3://, or a scheme whose fsspec package is installed."""
    scheme = url_scheme(path)
    if scheme not in READABLE_SCHEMES:
        return False
    package = READABLE_SCHEMES[scheme]
    if package is None:
        return True
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # its parent package (google.cloud, azure.storage) is missing
        return False


def unsupported_object(obj) -> UnsupportedSourceError:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if kind.startswith(("pyarrow._fs", "pyarrow.fs", "fsspec", "s3fs", "gcsfs", "adlfs")):
        what = (f"a filesystem object ({kind}) is not a source by itself (it names no shards): pass "
                "packloader.Storage(filesystem=fs).paths('bucket/prefix/*.parquet')")
    else:
        what = f"{kind} is not a supported source"
    return UnsupportedSourceError(f"{what}; supported: {supported()}")
