"""http:// and https:// URLs of single shards (a file server, a signed object-store URL, a Hugging Face `resolve`
URL), read by ranged GETs with the standard library's http.client: no package needed.

The object is identified by its size (Content-Range) and ETag (else its Last-Modified date) from a first one-byte
GET (a HEAD is not served everywhere); every later read carries `If-Match` with a strong ETag and is checked
against the size and version it returns, so a file replaced under a running or saved epoch is a `ShardChanged`
error naming the URL. A server that sends neither leaves the content to identify the object (`RemoteWatch`
hashes it, and the disk cache does not keep it), so a same-size replacement is still refused on resume. A server that
ignores `Range` (answers 200 with the whole body) is refused: shards are never downloaded whole behind the
caller's back. HTTP has no listing: each URL names one shard (`.parquet`, `.jsonl`, ...), never a prefix or glob.
Redirects (a Hub `resolve` URL to its CDN) are followed, at most five.
"""

from __future__ import annotations

import http.client
from urllib.parse import urljoin, urlsplit

from packloader.sources.identity import ShardChanged
from packloader.sources.remote import HttpError, ObjectInfo, RetryPolicy, read_range, with_retries

HTTP_SCHEMES = ("http", "https")
_REDIRECTS = (301, 302, 303, 307, 308)


def version(headers: dict) -> str:
    """The object's version as the server states it: its ETag, else its Last-Modified date, else "" (none: the
    source then identifies the object by its content, `storage.RemoteWatch`)."""
    if headers.get("etag"):
        return headers["etag"]
    return f"Last-Modified {headers['last-modified']}" if headers.get("last-modified") else ""


class HttpStore:
    def __init__(self, policy: RetryPolicy | None = None) -> None:
        self.policy = policy or RetryPolicy()
        self.bytes_read = 0
        self.requests = 0

    def _get(self, url: str, start: int, end: int, etag: str = "") -> tuple[bytes, dict]:
        """Bytes [start, end) of `url` and the response's headers (lower-case names); redirects followed."""
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity", "User-Agent": "packloader"}
        if etag and not etag.startswith(("W/", "Last-Modified ")):  # If-Match takes strong ETags only
            headers["If-Match"] = etag
        for _ in range(6):
            parts = urlsplit(url)
            conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = conn_type(parts.netloc, timeout=self.policy.read_timeout_s)
            try:
                conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else "") or "/", headers=headers)
                r = conn.getresponse()
                body = r.read()
                found = {k.lower(): v for k, v in r.getheaders()}
            finally:
                conn.close()
            if r.status in _REDIRECTS and "location" in found:
                url = urljoin(url, found["location"])
                continue
            if r.status == 200:
                raise HttpError(0, f"the server ignores Range requests (answered 200 with {len(body)} bytes); "
                                     "packloader reads shards by ranged GETs")
            if r.status >= 300:
                raise HttpError(r.status, f"HTTP {r.status} {r.reason}")
            return body, found
        raise HttpError(0, "more than 5 redirects")

    def head(self, url: str) -> ObjectInfo:
        def call() -> ObjectInfo:
            _, headers = self._get(url, 0, 1)
            total = headers.get("content-range", "").rpartition("/")[2]
            if not total.isdigit():
                raise HttpError(0, f"no object size in the answer (Content-Range: {headers.get('content-range')!r})")
            return ObjectInfo(url, int(total), version(headers))

        return with_retries(call, url, self.policy, "GET bytes 0..0")

    def get_range(self, info: ObjectInfo, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file `info` describes; a replaced or deleted file is `ShardChanged`."""
        def call() -> bytes:
            data, headers = self._get(info.url, start, end, info.etag)
            total = headers.get("content-range", "").rpartition("/")[2]
            etag = version(headers)
            if (total.isdigit() and int(total) != info.size) or (info.etag and etag and etag != info.etag):
                raise ShardChanged(f"{info.url}: the file changed since the source opened it ({total} bytes, ETag "
                                   f"{etag}; opened: {info.size} bytes, ETag {info.etag}); reading on would train "
                                   "other documents than those indexed")
            return data

        return read_range(self, info, start, end, call, "file")

    def listing(self, url: str) -> list[str]:
        from packloader.sources.unsupported import UnsupportedSourceError

        raise UnsupportedSourceError(
            f"{url}: HTTP has no listing, so an http(s):// URL names one shard file (.parquet, .jsonl, .jsonl.gz, "
            "...), never a folder or a glob; pass each shard's URL (a list of URLs is fine)")
