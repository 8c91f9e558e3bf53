"""Shard formats by file name, shared by local (`open.py`) and remote (`remote_open.py`) opening."""

from __future__ import annotations

FORMATS = ("parquet", "jsonl", "mds", "directory", "arrow", "megatron", "hf-disk")
_PARQUET = (".parquet", ".pq")
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".json", ".json.gz", ".json.zst", ".ndjson", ".ndjson.gz",
          ".ndjson.zst")


def format_of(path: str) -> str | None:
    name = path.lower()
    if name.endswith(_PARQUET):
        return "parquet"
    if name.endswith(_JSONL):
        return "jsonl"
    return None
