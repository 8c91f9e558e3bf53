"""A real S3-compatible server on the loopback for the object-storage tests (`moto_server`), and a small fault proxy
in front of it that fails a share of requests (500/503), resets connections, answers slowly or refuses a
credential, the way a busy or misconfigured object store does. Only 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MOTO_MISSING = "moto_server not installed (`bash scripts/setup.sh dev` installs moto[server])"


def find_moto_server() -> str | None:
    """`moto_server` from $PACKLOADER_MOTO_SERVER, beside this Python, on PATH or in the repo's `.venv-moto`."""
    candidates = [os.environ.get("PACKLOADER_MOTO_SERVER"), str(Path(sys.executable).parent / "moto_server"),
                  shutil.which("moto_server"), str(REPO / ".venv-moto" / "bin" / "moto_server")]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(proc: subprocess.Popen, port: int, timeout: float, name: str) -> str | None:
    """None once `proc` accepts connections on 127.0.0.1:`port`, else why not (it exited, or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"{name} exited with {proc.returncode} at start"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return None
        except OSError:
            time.sleep(0.1)
    return f"{name} did not listen on 127.0.0.1:{port} in {timeout} s"


def stop(proc: subprocess.Popen) -> None:
    """Terminate `proc`, killing it if it does not exit in 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class MotoServer:
    """`moto_server -H 127.0.0.1 -p PORT` for the life of the object; `endpoint` is its URL."""

    def __init__(self, exe: str, timeout: float = 60.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        why = wait_listening(self.proc, self.port, timeout, "moto_server")
        if why:
            self.close()
            raise RuntimeError(why)

    def close(self) -> None:
        stop(self.proc)


class Faults:
    """What the proxy does to the next requests: every `every`-th GET fails with `status`, resets, or sleeps."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.every = 0
        self.mode = "status"  # "status", "reset", "slow"
        self.status = 503
        self.slow_s = 0.0
        self.access_key: str | None = None  # requests signed with another key get 403 InvalidAccessKeyId
        self.bearer: str | None = None  # requests without `Authorization: Bearer <bearer>` get 401 (GCS's way)
        self.injected = 0

    def pick(self, method: str) -> str | None:
        with self.lock:
            if method != "GET" or not self.every:
                return None
            self.count += 1
            if self.count % self.every:
                return None
            self.injected += 1
            return self.mode


_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access '
           b'Key Id you provided does not exist in our records.</Message></Error>')
_FAILED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code><Message>Injected '
           b'fault</Message></Error>')


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to `upstream` (host, port), with `faults` applied."""

    def __init__(self, upstream_port: int) -> None:
        self.faults = Faults()
        faults = self.faults

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                key = faults.access_key
                if key is not None and f"Credential={key}/" not in self.headers.get("Authorization", ""):
                    return self._reply(403, _DENIED)
                if faults.bearer is not None and self.headers.get("Authorization") != f"Bearer {faults.bearer}":
                    return self._reply(401, b'{"error": {"code": 401, "message": "Invalid Credentials"}}')
                fault = faults.pick(self.command)
                if fault == "status":
                    return self._reply(faults.status, _FAILED)
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return None
                if fault == "slow":
                    time.sleep(faults.slow_s)
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    r = conn.getresponse()
                    data = r.read()
                    self.send_response(r.status)
                    for k, v in r.getheaders():
                        if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(k, v)
                    length = r.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()
                return None

            def _reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
