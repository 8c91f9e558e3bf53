"""Seeded corpora (token and text documents) and Parquet shard writers for the loader tests."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def token_docs(n=300, seed=0, max_len=300, vocab=256):
    """Ids below 256: inside the vocabulary of every tokenizer the tests name, "bytes" (257) included (token rows
    that record no vocabulary are checked against the tokenizer named)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.2, size=n) * 30 + 1, max_len).astype(int)
    return [rng.integers(0, vocab, size=int(k)).astype(np.int32) for k in lengths]


def tail_with_giant(n: int, scale: float, cap: int, giant_at: int, giant_len: int, seed: int = 0) -> list[np.ndarray]:
    """A long-tail corpus (Pareto 1.1 lengths, `scale` x, capped at `cap`) with one document of `giant_len` tokens
    inserted at `giant_at`, long enough to spread over several steps (delay, slices, interrupted steps)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.1, n) * scale + 1, cap).astype(np.int64)
    docs = [rng.integers(0, 256, size=int(k)).astype(np.int32) for k in lengths]
    docs.insert(giant_at, rng.integers(0, 256, size=giant_len).astype(np.int32))
    return docs


def text_docs(n=200, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "über", "naïve", "日本"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 80)))) + f" #{i}" for i in range(n)]


def write_text_shards(tmp_path, texts, shards=3, row_group_size=17):
    paths = []
    for s, part in enumerate(np.array_split(np.array(texts, dtype=object), shards)):
        p = tmp_path / f"text-{s:03d}.parquet"
        pq.write_table(pa.table({"text": pa.array(list(part), pa.string())}), p, row_group_size=row_group_size)
        paths.append(str(p))
    return paths


def write_token_shards(tmp_path, docs, shards=3, row_group_size=23, eos_appended=None):
    paths = []
    for s, part in enumerate(np.array_split(np.arange(len(docs)), shards)):
        rows = [docs[i] for i in part]
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
        values = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
        table = pa.table({"tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                          "length": pa.array([len(r) for r in rows], pa.int32())})
        if eos_appended is not None:
            table = table.replace_schema_metadata({"packloader.eos_appended": "true" if eos_appended else "false",
                                                   "packloader.eos_id": "999"})
        p = tmp_path / f"tok-{s:03d}.parquet"
        pq.write_table(table, p, row_group_size=row_group_size)
        paths.append(str(p))
    return paths
