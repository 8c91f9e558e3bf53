"""A file server on the loopback that answers ranged GETs (206 with Content-Range) and sends no ETag: what some
file servers and proxies do. With `last_modified`, it sends the file's modification time as Last-Modified."""

from __future__ import annotations

import json
import os
import re
import threading
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np


def serve(directory: str, last_modified: bool = False) -> tuple[ThreadingHTTPServer, str]:
    """(the running server, its base URL); shut it down with server.shutdown() and server.server_close()."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = os.path.join(directory, self.path.lstrip("/"))
            data = open(path, "rb").read()
            a, b = (int(x) for x in re.match(r"bytes=(\d+)-(\d+)", self.headers["Range"]).groups())
            body = data[a:b + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{a + len(body) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            if last_modified:
                self.send_header("Last-Modified", formatdate(os.stat(path).st_mtime, usegmt=True))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def write_docs(path, seed: int, n: int = 80) -> None:
    """JSONL token rows; every seed gives the same byte count (ids of 3 digits)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"tokens": rng.integers(100, 1000, size=20 + i % 7).tolist()}) + "\n")
