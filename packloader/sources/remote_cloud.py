"""gs:// (Google Cloud Storage) and Azure Blob Storage (az://, abfs://, abfss://) objects, read by ranged requests.

Why the vendors' own clients (google-cloud-storage, azure-storage-blob: the `remote` extra, which
mosaicml-streaming also depends on) rather than gcsfs / adlfs or pyarrow's GcsFileSystem / AzureFileSystem (this
pyarrow build has both): for the same reasons s3:// uses boto3 (`remote.py`). Every read must be tied to the
object the source indexed and the retry loop must be ours, bounded in attempts and seconds. Here each ranged GET
carries a precondition on the version opened (GCS `ifGenerationMatch`, Azure `If-Match: <ETag>`), so an object
replaced under a running or saved epoch is a `ShardChanged` error naming the URL. gcsfs and adlfs read whatever
version is current (unless the bucket keeps versions) and retry inside their own loops; pyarrow's filesystems retry
inside C++ and report every failure as an OSError whose text alone tells a missing object from refused
credentials. The SDKs' own retries are off (`retry=None`, `retry_total=0`): `RetryPolicy` decides.

Settings are the vendors' standard ones. GCS: the application default credentials (`GOOGLE_APPLICATION_CREDENTIALS`,
`gcloud auth application-default login`, a VM's service account; none found: anonymous, for public buckets),
`STORAGE_EMULATOR_HOST` for an emulator, `GOOGLE_CLOUD_PROJECT`. Azure: `AZURE_STORAGE_CONNECTION_STRING` (Azurite
included), else the account from the URL (`abfs://container@ACCOUNT.dfs.core.windows.net/path`) or
`AZURE_STORAGE_ACCOUNT_NAME`, with `AZURE_STORAGE_ACCOUNT_KEY`, `AZURE_STORAGE_SAS_TOKEN` or azure-identity's
`DefaultAzureCredential`. A gcsfs or adlfs filesystem the caller configured still goes through
`Storage(filesystem=fs)`.
"""

from __future__ import annotations

import os
from urllib.parse import quote

from packloader.sources.identity import ShardChanged
from packloader.sources.remote import (
    HttpError,
    ObjectInfo,
    RetryPolicy,
    _glob_match,
    read_range,
    split_url,
    with_retries,
)

GCS_SCHEMES = ("gs", "gcs")
AZURE_SCHEMES = ("az", "abfs", "abfss")


def _needs(package: str, scheme: str, e: ImportError):
    from packloader.sources.unsupported import UnsupportedSourceError

    return UnsupportedSourceError(f"{scheme}:// URLs need {package}: pip install 'packloader[remote]' ({e})")


def _split_glob(key: str) -> tuple[str, bool]:
    """The listing prefix of `key` and whether it is a glob (a bare prefix is taken as a folder)."""
    magic = next((i for i, c in enumerate(key) if c in "*?["), None)
    prefix = key if magic is None else key[:magic]
    if magic is None and prefix and not prefix.endswith("/"):
        prefix += "/"
    return prefix, magic is not None


class _Store:
    """What the GCS and Azure stores share: one client per process, counters, listing by prefix and glob."""

    def __init__(self, policy: RetryPolicy | None = None) -> None:
        self.policy = policy or RetryPolicy()
        self.bytes_read = 0
        self.requests = 0
        self._clients: dict = {}
        self._pid = -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_clients": {}, "_pid": -1}

    def _client(self, key: str, make):
        if self._pid != os.getpid():  # a forked DataLoader worker makes its own
            self._clients, self._pid = {}, os.getpid()
        if key not in self._clients:
            self._clients[key] = make()
        return self._clients[key]

    def get_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object `info` describes; a replaced or deleted object is `ShardChanged`."""
        return read_range(self, info, start, end, lambda: self._read(info, start, end))

    def listing(self, url: str) -> list[str]:
        """The object URLs under `url`'s prefix, or matching it where it holds `*`, `?` or `[` (`**`: any depth)."""
        scheme, bucket, key = split_url(url)
        prefix, magic = _split_glob(key)
        keys = with_retries(lambda: self._names(url, prefix), url, self.policy, "LIST")
        keys = [k for k in keys if not k.endswith("/") and (not magic or _glob_match(k, key))]
        return sorted(f"{scheme}://{bucket}/{k}" for k in keys)


class GcsStore(_Store):
    """gs:// objects through google-cloud-storage; each read pinned to the generation the source opened."""

    def client(self):
        def make():
            try:
                from google.cloud import storage
            except ImportError as e:
                raise _needs("google-cloud-storage", "gs", e) from e
            project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT")
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                return storage.Client(project=project or "packloader")  # the SDK signs nothing for an emulator
            try:
                return storage.Client(project=project)
            except Exception as e:  # noqa: BLE001 - no default credentials: public buckets still read
                if type(e).__name__ != "DefaultCredentialsError":
                    raise
                return storage.Client.create_anonymous_client()

        return self._client("", make)

    def _timeout(self) -> tuple[float, float]:
        return (self.policy.connect_timeout_s, self.policy.read_timeout_s)

    def head(self, url: str) -> ObjectInfo:
        _, bucket, key = split_url(url)

        def call() -> ObjectInfo:
            blob = self.client().bucket(bucket).blob(key)
            blob.reload(retry=None, timeout=self._timeout())
            return ObjectInfo(url, int(blob.size), str(blob.generation or ""))

        return with_retries(call, url, self.policy, "HEAD")

    def _read(self, info: ObjectInfo, start: int, end: int) -> bytes:
        """One ranged media GET through the client's authorized session (the SDK's download hides the response
        headers): the generation it serves and the object size in Content-Range are checked against those opened,
        so a replaced object is refused even by a server that ignores `ifGenerationMatch`."""
        _, bucket, key = split_url(info.url)
        client = self.client()
        base = client._connection.API_BASE_URL  # the endpoint the client resolved (STORAGE_EMULATOR_HOST included)
        url = f"{base}/download/storage/v1/b/{quote(bucket, safe='')}/o/{quote(key, safe='')}"
        params = {"alt": "media", **({"ifGenerationMatch": info.etag} if info.etag.isdigit() else {})}
        r = client._http.get(url, params=params, headers={"Range": f"bytes={start}-{end - 1}",
                                                          "Accept-Encoding": "identity"}, timeout=self._timeout())
        if r.status_code >= 400:
            raise HttpError(r.status_code, f"HTTP {r.status_code}: {r.text[:200]}")
        served = r.headers.get("x-goog-generation")
        total = r.headers.get("Content-Range", "").rpartition("/")[2]
        if (served and info.etag.isdigit() and served != info.etag) or (total.isdigit() and int(total) != info.size):
            raise ShardChanged(f"{info.url}: the object changed since the source opened it (generation {served}, "
                               f"{total} bytes; opened: generation {info.etag}, {info.size} bytes); reading on would "
                               "train other documents than those indexed")
        return r.content

    def _names(self, url: str, prefix: str) -> list[str]:
        _, bucket, _ = split_url(url)
        blobs = self.client().list_blobs(bucket, prefix=prefix, retry=None, timeout=self._timeout())
        return [b.name for b in blobs]


def azure_parts(url: str) -> tuple[str, str | None, str]:
    """(container, account or None, blob) of az://container/blob or abfs[s]://container[@account.host]/blob."""
    _, where, key = split_url(url)
    container, _, host = where.partition("@")
    return container, (host.split(".", 1)[0] or None) if host else None, key


class AzureStore(_Store):
    """Azure Blob Storage through azure-storage-blob; each read conditioned on the ETag the source opened."""

    def service(self, url: str):
        _, account, _ = azure_parts(url)

        def make():
            try:
                from azure.storage.blob import BlobServiceClient
            except ImportError as e:
                raise _needs("azure-storage-blob", split_url(url)[0], e) from e
            p = self.policy
            kw = {"retry_total": 0, "connection_timeout": p.connect_timeout_s, "read_timeout": p.read_timeout_s}
            conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
            name = account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
            if conn and (account is None or f"AccountName={account};" in conn + ";"):
                return BlobServiceClient.from_connection_string(conn, **kw)
            if not name:
                raise PermissionError("no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING or "
                                      "AZURE_STORAGE_ACCOUNT_NAME, or name it in the URL (abfs://container@ACCOUNT"
                                      ".dfs.core.windows.net/path)")
            return BlobServiceClient(f"https://{name}.blob.core.windows.net", credential=_azure_credential(name), **kw)

        return self._client(account or "", make)

    def _blob(self, url: str):
        container, _, key = azure_parts(url)
        return self.service(url).get_blob_client(container, key)

    def head(self, url: str) -> ObjectInfo:
        def call() -> ObjectInfo:
            props = self._blob(url).get_blob_properties()
            return ObjectInfo(url, int(props.size), str(props.etag or ""))

        return with_retries(call, url, self.policy, "HEAD")

    def _read(self, info: ObjectInfo, start: int, end: int) -> bytes:
        from azure.core import MatchConditions

        kw = {"etag": info.etag, "match_condition": MatchConditions.IfNotModified} if info.etag else {}
        return self._blob(info.url).download_blob(offset=start, length=end - start, max_concurrency=1, **kw).readall()

    def _names(self, url: str, prefix: str) -> list[str]:
        container, _, _ = azure_parts(url)
        return [b.name for b in self.service(url).get_container_client(container).list_blobs(name_starts_with=prefix)]


def _azure_credential(account: str):
    """The account key, a SAS token, or azure-identity's default credential (None: anonymous, public containers)."""
    key = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    if key:
        return {"account_name": account, "account_key": key}
    sas = os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    if sas:
        return sas
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        return None
    return DefaultAzureCredential()
