"""Real Google Cloud Storage and Azure Blob Storage emulators on the loopback for the object-storage tests:
gcp-storage-emulator (PyPI, in the dev extra) and Azurite (npm; `scripts/setup.sh dev` installs it under
`.tools/azurite`). Only 127.0.0.1, in memory, Azurite's telemetry off; every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers.s3_server import free_port, stop, wait_listening

REPO = Path(__file__).resolve().parents[2]
# Azurite's well-known development account (public, in Azure's documentation)
AZURITE_ACCOUNT = "devstoreaccount1"
GCS_MISSING = "gcp-storage-emulator not installed (`bash scripts/setup.sh dev` installs it)"
AZURITE_MISSING = "Azurite or node not installed (`bash scripts/setup.sh dev` installs azurite with npm)"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _first_executable(candidates) -> str | None:
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def find_gcs_emulator() -> str | None:
    """`gcp-storage-emulator` from $PACKLOADER_GCS_EMULATOR, beside this Python or on PATH."""
    return _first_executable([os.environ.get("PACKLOADER_GCS_EMULATOR"),
                              str(Path(sys.executable).parent / "gcp-storage-emulator"),
                              shutil.which("gcp-storage-emulator")])


def find_azurite() -> str | None:
    """`azurite-blob` from $PACKLOADER_AZURITE, the repo's `.tools/azurite` or PATH (it needs `node` on PATH)."""
    if shutil.which("node") is None:
        return None
    return _first_executable([os.environ.get("PACKLOADER_AZURITE"),
                              str(REPO / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"),
                              shutil.which("azurite-blob")])


class EmulatorDown(RuntimeError):
    pass


class Emulator:
    """A server process listening on 127.0.0.1:`port` for the life of the object (`EmulatorDown` if it cannot
    start: the tests skip naming why)."""

    def __init__(self, argv: list[str], port: int, name: str, timeout: float = 60.0) -> None:
        self.port, self.name = port, name
        self.endpoint = f"http://127.0.0.1:{port}"
        self.workdir = tempfile.mkdtemp(prefix=f"packloader-{name}-")
        self.proc = subprocess.Popen(argv, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        why = wait_listening(self.proc, port, timeout, name)
        if why:
            self.close()
            raise EmulatorDown(f"{why} ({' '.join(argv)})")

    def close(self) -> None:
        stop(self.proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_gcs_emulator(exe: str) -> Emulator:
    port = free_port()
    return Emulator([exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"], port,
                    "gcp-storage-emulator")


def start_azurite(exe: str) -> Emulator:
    port = free_port()
    return Emulator([exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                     "--disableTelemetry", "--skipApiVersionCheck", "--loose", "--silent"],
                    port, "azurite")


def azurite_connection_string(endpoint: str, key: str = AZURITE_KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")


@contextlib.contextmanager
def server_or_skip(exe: str | None, start, missing: str, name: str):
    """`start(exe)`'s server, closed on exit; the test skipped with `missing` where `exe` is None, or naming why
    where the server cannot start (`EmulatorDown`). Shared by the object-storage tests' module fixtures."""
    if exe is None:
        pytest.skip(missing)
    try:
        server = start(exe)
    except EmulatorDown as e:
        pytest.skip(f"{name} cannot start: {e}")
    try:
        yield server
    finally:
        server.close()
