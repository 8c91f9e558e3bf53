"""gs:// and Azure against local disk: the same Parquet shards read by PackedLoader from gcp-storage-emulator and
Azurite on the loopback and from local files (the shards and the timed epoch of `remote_read.py`), and the same
pre-tokenized documents as an MDS folder.

    .venv/bin/python benchmarks/remote_cloud_read.py --write docs/benchmarks.md

Timed: one whole epoch of `PackedLoader` (fixed plans, `--threads` threads) after an untimed warm-up epoch from
local files, then from `gs://` URLs (STORAGE_EMULATOR_HOST) and `az://` URLs (AZURE_STORAGE_CONNECTION_STRING),
4 MiB ranged reads, no disk cache: tokens/s = tokens yielded / wall time; time to first batch from the loader's
creation (listing and opening every shard). Both emulators are single-process servers written in Python
(gcp-storage-emulator) and Node.js (Azurite), so their figures are a floor for the real services' throughput.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from remote_read import corpus, epoch, shard_bytes  # benchmarks/, the script's own folder
from sections import write_section

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.cloud_emulators import (  # noqa: E402
    azurite_connection_string,
    find_azurite,
    find_gcs_emulator,
    start_azurite,
    start_gcs_emulator,
)

from packloader import Storage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--docs", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    gcs_exe, az_exe = find_gcs_emulator(), find_azurite()
    if gcs_exe is None or az_exe is None:
        raise SystemExit("gcp-storage-emulator or azurite not found: bash scripts/setup.sh dev")
    gcs, az = start_gcs_emulator(gcs_exe), start_azurite(az_exe)
    os.environ["STORAGE_EMULATOR_HOST"] = gcs.endpoint
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = azurite_connection_string(az.endpoint)
    rows = []
    try:
        from azure.storage.blob import BlobServiceClient
        from google.cloud import storage

        bucket = storage.Client(project="bench").create_bucket("bench")
        container = BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
        container = container.get_container_client("bench")
        container.create_container()
        data = corpus(args.shards, args.docs)
        with tempfile.TemporaryDirectory() as tmp:
            for kind, text in (("pre-tokenized", False), ("raw text", True)):
                for i, docs in enumerate(data):
                    body = shard_bytes(docs, text)
                    Path(tmp, f"{kind[:3]}-{i}.parquet").write_bytes(body)
                    bucket.blob(f"{kind[:3]}/{i}.parquet").upload_from_string(body)
                    container.upload_blob(f"{kind[:3]}/{i}.parquet", body, overwrite=True)
                epoch(f"{tmp}/{kind[:3]}-*.parquet", text, args.threads)  # warm-up (imports, compiled kernels)
                for where, src in (("local disk", f"{tmp}/{kind[:3]}-*.parquet"),
                                   ("gcp-storage-emulator (gs://)", Storage().paths(f"gs://bench/{kind[:3]}/*.parquet")),
                                   ("Azurite (az://)", Storage().paths(f"az://bench/{kind[:3]}/*.parquet"))):
                    tokens, wall, first = epoch(src, text, args.threads)
                    rows.append(f"| {kind} | {where} | {tokens:,} | {tokens / wall:,.0f} | {first:.2f} |")
                    print(rows[-1], flush=True)
            mds = Path(tmp, "mds")
            from streaming import MDSWriter

            with MDSWriter(out=str(mds), columns={"tokens": "ndarray:int32"}, size_limit=8 << 20) as w:
                for docs in data:
                    for d in docs:
                        w.write({"tokens": d})
            for f in sorted(os.listdir(mds)):
                bucket.blob(f"mds/{f}").upload_from_string((mds / f).read_bytes())
                container.upload_blob(f"mds/{f}", (mds / f).read_bytes(), overwrite=True)
            epoch(str(mds), False, args.threads)  # warm-up (import streaming)
            for where, src in (("local disk", str(mds)), ("gcp-storage-emulator (gs://)", "gs://bench/mds"),
                               ("Azurite (az://)", "az://bench/mds")):
                tokens, wall, first = epoch(src, False, args.threads)
                rows.append(f"| MDS, pre-tokenized | {where} | {tokens:,} | {tokens / wall:,.0f} | {first:.2f} |")
                print(rows[-1], flush=True)
    finally:
        gcs.close()
        az.close()
    cmd = "python benchmarks/remote_cloud_read.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    body = (
        f"`{cmd}` ({args.shards} shards x {args.docs} documents, lengths 16..4096 log-uniform, {args.threads} "
        f"threads; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}). The shards and the timed epoch of "
        "`remote_read.py`, one epoch each after an untimed warm-up epoch, read by 4 MiB ranged GETs with no disk "
        "cache from gcp-storage-emulator (`STORAGE_EMULATOR_HOST`) and Azurite (`AZURE_STORAGE_CONNECTION_STRING`) "
        "on the loopback. Both emulators are single-process servers (Python; Node.js): a floor for the real "
        "services' throughput, not their latency. First batch: seconds from building the loader (listing and "
        "opening every shard) to its first micro-batch. MDS: the same pre-tokenized documents written by streaming's "
        "`MDSWriter` (8 MiB shards), each shard fetched whole when first read.\n\n"
        "| shards | from | tokens | tokens/s | first batch (s) |\n| --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
    )
    if args.write:
        write_section(args.write, "remote-cloud-read", "Object storage (loopback GCS and Azure emulators) against "
                      "local disk", body)


if __name__ == "__main__":
    main()
