"""Object storage: shards read by ranged requests from S3 (and S3-compatible servers) or from a filesystem object.

Why boto3 ranged GETs for s3:// rather than pyarrow's S3FileSystem or s3fs: every read must be tied to the object
the source indexed, and the retry loop must be ours. A GET sent with `If-Match: <ETag>` fails (412) when the object
was replaced since the source opened it, so a rewritten object is a `ShardChanged` error naming the URL instead of
other documents; pyarrow's and s3fs's readers retry inside C++ or aiobotocore, unbounded in time and without that
tie. boto3 reads the standard settings: the AWS environment variables (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` and
`AWS_ENDPOINT_URL_S3` for S3-compatible servers), `~/.aws` profiles and instance roles. Its own retries are off:
`RetryPolicy` retries transient faults (5xx, throttling, resets, timeouts) with exponential backoff, bounded in
attempts and in seconds, then raises an error naming the URL. A passed filesystem object (`pyarrow.fs.FileSystem`
or an fsspec filesystem: gcsfs, adlfs, huggingface_hub's HfFileSystem, ...) is read the same way through its
ranged reads (`FsStore`), so gs://, Azure and hf:// reach packloader as the filesystem the user already configured.

Reads are block-aligned (`block_size`, default 4 MiB): a Parquet row group costs the few requests its column chunk
spans, never the whole object; the optional `BlockCache` keeps blocks on local disk, bounded in bytes. `block_size`
0 fetches exactly the ranges the reader asks for (one request per column chunk), for shards of small row groups
that each rank reads only in part.
"""

from __future__ import annotations

import io
import os
import random
import threading
import time
from fnmatch import fnmatchcase

import msgspec

from packloader.sources.errors import SourceError
from packloader.sources.identity import ShardChanged
from packloader.sources.remote_cache import BlockCache

_COUNT_LOCK = threading.Lock()


def count_read(store, n: int) -> None:
    """A store's bytes and requests, counted under a lock: ranged reads of pages run in several threads."""
    with _COUNT_LOCK:
        store.bytes_read += n
        store.requests += 1


class RemoteError(SourceError):
    """Object storage that cannot be read: the message names the URL and why."""


class ObjectMissing(RemoteError, FileNotFoundError):
    """No object at the URL (or no bucket)."""


class AccessDenied(RemoteError, PermissionError):
    """The credentials were refused or lack permission for the URL."""


class HttpError(Exception):
    """An HTTP status of a request made here (GCS, http(s)://), classified by `classify` through `status_code`;
    0 for a protocol problem that no retry mends."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code


class RetryPolicy(msgspec.Struct, frozen=True):
    """Retries of transient faults: at most `attempts` tries per request and `deadline_s` seconds in all."""

    attempts: int = 6
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    deadline_s: float = 60.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0


class ObjectInfo(msgspec.Struct, frozen=True):
    url: str
    size: int
    etag: str  # "" where the store has none (then size and content hashes identify the object)


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of `scheme://bucket/key`."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme.lower(), bucket, key


_TRANSIENT_CODES = {"429", "500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
                    "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}
_DENIED_CODES = {"401", "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                 "InvalidToken", "AllAccessDisabled"}
_MISSING_CODES = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}


def _code(e: BaseException) -> str:
    """botocore's error code, else the HTTP status of a google-api-core (`code`) or azure-core (`status_code`) error."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    for attr in ("status_code", "code"):
        status = getattr(e, attr, None)
        if isinstance(status, int) and 400 <= status < 600:
            return str(status)
    return ""


def classify(e: BaseException) -> str:
    """"transient", "missing", "denied", "changed" or "other" for an error a store raised."""
    code = _code(e)
    name = type(e).__name__
    if code in ("412", "PreconditionFailed") or name == "ResourceModifiedError":
        return "changed"
    if code in _MISSING_CODES or isinstance(e, FileNotFoundError) or name == "ResourceNotFoundError":
        return "missing"
    if code in _DENIED_CODES or isinstance(e, PermissionError) or type(e).__name__ in (
            "NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError", "ClientAuthenticationError",
            "RefreshError") or (type(e).__module__.startswith("google.auth")  # a 401 the credentials cannot renew
                                and type(e).__name__ != "TransportError"):
        return "denied"
    if name == "OfflineModeIsEnabled":  # huggingface_hub's, a ConnectionError that no retry can end
        return "other"
    if code in _TRANSIENT_CODES or (code.isdigit() and code.startswith("5")):
        return "transient"
    names = {c.__name__ for c in type(e).__mro__}
    transient = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                 "ResponseStreamingError", "IncompleteReadError", "ProtocolError", "IncompleteRead",
                 "ConnectionError", "TimeoutError", "ChunkedEncodingError", "Timeout", "ServiceRequestError",
                 "ServiceResponseError", "TransportError"}
    return "transient" if names & transient else "other"


_HINTS = {
    "gs": "check the credentials (GOOGLE_APPLICATION_CREDENTIALS or the application default credentials) and the "
          "endpoint (STORAGE_EMULATOR_HOST for an emulator)",
    "az": "check the credentials (AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
          "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or an azure-identity login)",
    "http": "packloader sends no credentials over http(s)://: use a URL that grants access by itself (a signed or "
            "public URL), or pass a configured fsspec filesystem as Storage(filesystem=fs)",
    "hf": "hf:// reads through huggingface_hub's HfFileSystem: check HF_TOKEN (or `huggingface-cli login`), "
          "HF_ENDPOINT and HF_HUB_OFFLINE",
}


def credentials_hint(url: str) -> str:
    """Where the credentials for `url`'s store come from, for an access-denied message."""
    scheme = split_url(url)[0]
    key = {"gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az", "http": "http", "https": "http",
           "hf": "hf"}.get(scheme, "")
    return _HINTS.get(key, "check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or "
                           "the profile) and the endpoint (AWS_ENDPOINT_URL)")


def _hf_hint(url: str) -> str:
    return f"; {_HINTS['hf']}" if split_url(url)[0] == "hf" else ""


def with_retries(call, url: str, policy: RetryPolicy, what: str):
    """`call()`, retried on transient faults with jittered exponential backoff; errors name `url`."""
    start = time.monotonic()
    for attempt in range(1, policy.attempts + 1):
        try:
            return call()
        except ShardChanged:
            raise
        except Exception as e:  # noqa: BLE001 - classified below, re-raised as ours or as is
            kind = classify(e)
            if kind == "missing":
                raise ObjectMissing(f"{url}: no such object ({what}: {e})") from e
            if kind == "denied":
                raise AccessDenied(f"{url}: access denied ({what}: {e}); {credentials_hint(url)}") from e
            if kind == "changed":
                raise ShardChanged(
                    f"{url}: the object changed since the source opened it (its ETag no longer matches); it was "
                    "rewritten or replaced. Reading on would train other documents than those indexed"
                ) from e
            if kind != "transient":
                raise RemoteError(f"{url}: {what} failed ({type(e).__name__}: {e}){_hf_hint(url)}") from e
            elapsed = time.monotonic() - start
            delay = min(policy.max_delay_s, policy.base_delay_s * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            if attempt == policy.attempts or elapsed + delay > policy.deadline_s:
                raise RemoteError(
                    f"{url}: {what} failed after {attempt} attempts in {elapsed:.1f} s of transient errors (last: "
                    f"{type(e).__name__}: {e}); the storage is unavailable or overloaded{_hf_hint(url)}"
                ) from e
            time.sleep(delay)
    raise AssertionError("unreachable")


def read_range(store, info: ObjectInfo, start: int, end: int, call, what: str = "object") -> bytes:
    """Bytes [start, end) from `call()` under `store.policy`, counted on `store`.

    Every store's ranged GET shares this: a cut response is retried like a reset, and a deleted object is
    `ShardChanged` since the source indexed it.
    """
    def whole() -> bytes:
        data = call()
        if len(data) != end - start:  # a cut response: retried like a reset
            raise ConnectionError(f"short read: {len(data)} of {end - start} bytes")
        return data

    try:
        data = with_retries(whole, info.url, store.policy, f"GET bytes {start}..{end - 1}")
    except ObjectMissing as e:
        raise ShardChanged(f"{info.url}: the {what} was deleted since the source opened it ({e})") from e
    count_read(store, len(data))
    return data


class S3Store:
    """s3:// objects through boto3, configured from the standard AWS settings (endpoint included)."""

    def __init__(self, policy: RetryPolicy | None = None, endpoint_url: str | None = None) -> None:
        self.policy = policy or RetryPolicy()
        self.endpoint_url = endpoint_url
        self.bytes_read = 0
        self.requests = 0
        self._client, self._pid = None, -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None, "_pid": -1}

    def client(self):
        """One client per process (a forked DataLoader worker makes its own)."""
        if self._client is None or self._pid != os.getpid():
            import boto3
            from botocore.config import Config

            p = self.policy
            config = Config(retries={"total_max_attempts": 1}, connect_timeout=p.connect_timeout_s,
                            read_timeout=p.read_timeout_s, max_pool_connections=32)
            endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            self._client = boto3.session.Session().client("s3", endpoint_url=endpoint or None, config=config)
            self._pid = os.getpid()
        return self._client

    def head(self, url: str) -> ObjectInfo:
        _, bucket, key = split_url(url)
        r = with_retries(lambda: self.client().head_object(Bucket=bucket, Key=key), url, self.policy, "HEAD")
        return ObjectInfo(url, int(r["ContentLength"]), str(r.get("ETag", "")))

    def get_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object `info` describes; a replaced object is `ShardChanged`."""
        _, bucket, key = split_url(info.url)

        def call() -> bytes:
            kw = {"IfMatch": info.etag} if info.etag else {}
            body = self.client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **kw)["Body"]
            return body.read()

        return read_range(self, info, start, end, call)

    def listing(self, url: str) -> list[str]:
        """The object URLs under `url`'s prefix, or matching it where it holds `*`, `?` or `[` (`**`: any depth)."""
        scheme, bucket, key = split_url(url)
        magic = next((i for i, c in enumerate(key) if c in "*?["), None)
        prefix = key if magic is None else key[:magic]
        if magic is None and prefix and not prefix.endswith("/"):
            prefix += "/"

        def pages() -> list[str]:
            keys, token = [], None
            for _ in range(100_000):  # bounded: 100k pages of 1000 keys
                kw = {"ContinuationToken": token} if token else {}
                r = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix, **kw)
                keys += [o["Key"] for o in r.get("Contents", [])]
                if not r.get("IsTruncated"):
                    break
                token = r["NextContinuationToken"]
            return keys

        keys = with_retries(pages, url, self.policy, "LIST")
        if magic is not None:
            keys = [k for k in keys if _glob_match(k, key)]
        keys = [k for k in keys if not k.endswith("/")]
        return sorted(f"{scheme}://{bucket}/{k}" for k in keys)


def _glob_match(key: str, pattern: str) -> bool:
    """`*` within one path part, `**` across any number (as `paths.walk_glob`)."""
    if "**" not in pattern:
        return len(key.split("/")) == len(pattern.split("/")) and fnmatchcase(key, pattern)
    return fnmatchcase(key, pattern.replace("**/", "*").replace("**", "*"))


class FsStore:
    """Objects of a filesystem object the caller configured: `pyarrow.fs.FileSystem` or an fsspec filesystem."""

    def __init__(self, filesystem, policy: RetryPolicy | None = None) -> None:
        self.fs = filesystem
        self.policy = policy or RetryPolicy()
        self.bytes_read = 0
        self.requests = 0
        self._arrow = type(filesystem).__module__.startswith("pyarrow")

    def head(self, url: str) -> ObjectInfo:
        def call() -> ObjectInfo:
            if self._arrow:
                import pyarrow.fs as pafs

                fi = self.fs.get_file_info(url)
                if fi.type == pafs.FileType.NotFound:
                    raise FileNotFoundError(url)
                mtime = fi.mtime_ns or 0
                return ObjectInfo(url, int(fi.size), f"mtime:{mtime}")
            info = self.fs.info(url)
            tag = (info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("blob_id")
                   or info.get("mtime") or "")
            return ObjectInfo(url, int(info["size"]), str(tag))

        return with_retries(call, url, self.policy, "stat")

    def get_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        def call() -> bytes:
            if self._arrow:
                with self.fs.open_input_file(info.url) as f:
                    data = f.read_at(end - start, start)
            else:
                data = self.fs.cat_file(info.url, start=start, end=end)
            if len(data) != end - start:
                raise ShardChanged(f"{info.url}: the object is shorter than when the source opened it")
            return bytes(data)

        data = with_retries(call, info.url, self.policy, f"read bytes {start}..{end - 1}")
        count_read(self, len(data))
        return data

    def listing(self, url: str) -> list[str]:
        """The files under a folder or matching a glob; a store that cannot be reached is an error naming `url`
        (retried as a stat is), not the filesystem's own exception."""
        return with_retries(lambda: self._listing(url), url, self.policy, "list")

    def _listing(self, url: str) -> list[str]:
        if self._arrow:
            import pyarrow.fs as pafs

            if any(c in url for c in "*?["):
                base = url[: next(i for i, c in enumerate(url) if c in "*?[")].rsplit("/", 1)[0]
                infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True))
                return sorted(i.path for i in infos if i.type == pafs.FileType.File and _glob_match(i.path, url))
            infos = self.fs.get_file_info(pafs.FileSelector(url, recursive=True))
            return sorted(i.path for i in infos if i.type == pafs.FileType.File)
        found = self.fs.glob(url) if any(c in url for c in "*?[") else self.fs.find(url)
        scheme = url.partition("://")[0] if "://" in url else ""
        return sorted(p if not scheme or "://" in p else f"{scheme}://{p}" for p in found)  # fsspec drops it


class RemoteFile(io.RawIOBase):
    """A seekable read-only file over one object, read in aligned blocks (each block one ranged request, or the
    local cache's copy), every request tied to the object the source indexed."""

    def __init__(self, store, info: ObjectInfo, block_size: int = 4 << 20, cache: BlockCache | None = None) -> None:
        super().__init__()
        self.store, self.info, self.block_size, self.cache = store, info, int(block_size), cache
        self.name = info.url
        self._pos = 0
        self._last: tuple[int, bytes] = (-1, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self.info.size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.info.size}[whence]
        self._pos = max(0, base + int(offset))
        return self._pos

    def _block(self, k: int) -> bytes:
        if self._last[0] == k:
            return self._last[1]
        a = k * self.block_size
        b = min(self.info.size, a + self.block_size)
        data = self._fetch(a, b, f"{a}-{b}")  # keyed by its range: a block of another block_size is another key
        self._last = (k, data)
        return data

    def _fetch(self, a: int, b: int, where: str) -> bytes:
        key = f"{self.info.url}\0{self.info.etag}\0{self.info.size}\0{where}"
        disk = bool(self.info.etag)  # an object without a version: its name and size could key another's bytes
        data = self.cache.get(key, disk) if self.cache is not None else None
        if data is None or len(data) != b - a:  # a cached copy of other bytes is refetched, never served
            data = self.store.get_range(self.info, a, b)
            if self.cache is not None:
                self.cache.put(key, data, disk)
        return data

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (fewer only at the object's end), without moving the position. With
        `block_size` 0 the request fetches exactly these bytes (a rank reading its own small row groups pays no
        rounding to blocks); the same range asked again comes from the caches."""
        end = min(self.info.size, offset + max(0, n))
        if offset >= end:
            return b""
        if self.block_size <= 0:
            return self._fetch(offset, end, f"{offset}-{end}")
        parts = []
        for k in range(offset // self.block_size, (end - 1) // self.block_size + 1):
            block = self._block(k)
            a = k * self.block_size
            parts.append(block[max(offset, a) - a: min(end, a + len(block)) - a])
        return b"".join(parts)

    def readinto(self, buffer) -> int:
        data = self.pread(len(buffer), self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read(self, n: int = -1) -> bytes:
        n = self.info.size - self._pos if n is None or n < 0 else n
        data = self.pread(n, self._pos)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)
