"""What reading shards with plain reads and identity checks costs: one shuffled epoch of raw reads.

    .venv/bin/python benchmarks/source_reads.py --repeats 5 --data /tmp/srcbench
    PYTHONPATH=<a checkout of an older packloader> .venv/bin/python benchmarks/source_reads.py ... (to compare)
    .venv/bin/python benchmarks/source_reads.py --page-rows 1 --compression zstd --data /tmp/srcbench-pages (one
    document a page in zstd, as `packloader tokenize` writes by default, without its index: what pyarrow's decoding
    costs; with pyarrow's default snappy the pages alone cost nothing, since the cost is a zstd context a page)

Data (written once into `--data`, not timed): `--shards` Parquet token shards (`tokens list<int32>`, `length`,
row groups of 1,000 rows, random ids) and as many plain JSONL text shards, seeded. Timed, each best and median of
`--repeats`:
- open: `open_source` of every shard (schema, row groups, line index; shard identities where the code takes them);
- Parquet epoch: every document once in the shuffled epoch order (`DocumentStream(shuffle=True)`), read in
  requests of 256 documents as the loader does, tokens/s;
- JSONL epoch: the same over the JSONL shards without tokenizing (`source.read`), documents/s.
Only public APIs are used, so the same script times an older checkout (memory-mapped reads) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packloader.sources.open import open_source
from packloader.sources.stream import DocumentStream


def prepare(d: Path, shards: int, docs: int, page_rows: int = 0,
            compression: str = "snappy") -> tuple[list[str], list[str]]:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pqs, jsonls = [], []
    for s in range(shards):
        p, j = d / f"tok-{s:03d}.parquet", d / f"text-{s:03d}.jsonl"
        if not p.exists():
            lengths = np.minimum(rng.pareto(1.2, size=docs) * 300 + 1, 20_000).astype(np.int64)
            offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
            values = rng.integers(0, 100_000, size=int(offsets[-1]), dtype=np.int32)
            table = pa.table({"tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                              "length": pa.array(lengths.astype(np.int32))})
            pq.write_table(table, p, row_group_size=1000, max_rows_per_page=page_rows or None,
                           compression=compression)
        if not j.exists():
            words = ["alpha", "beta", "gamma", "delta", "epsilon", "über", "日本"]
            with open(j, "w") as f:
                for i in range(docs):
                    text = " ".join(rng.choice(words, size=int(rng.integers(20, 400))))
                    f.write(json.dumps({"id": i, "text": text}, ensure_ascii=False) + "\n")
        pqs.append(str(p))
        jsonls.append(str(j))
    return pqs, jsonls


def epoch(stream: DocumentStream, raw: bool) -> int:
    """Every document of epoch 0 once, in requests of 256: tokens (raw=False) or documents (raw=True) read."""
    n, total = stream.num_docs, 0
    for a in range(0, n, 256):
        ids = stream.doc_ids(0, np.arange(a, min(n, a + 256)))
        if raw:
            shards, rows = stream.locate(ids)
            for s in np.unique(shards).tolist():
                total += sum(1 for _ in stream.source.read(s, rows[shards == s]))
        else:
            total += sum(len(t) for t in stream.read(ids))
    return total


def timed(fn, repeats: int) -> tuple[float, float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/packloader-source-bench")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--docs", type=int, default=4000, help="documents per shard")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-rows", type=int, default=0,
                    help="documents per Parquet data page (0: pyarrow's 1 MiB pages)")
    ap.add_argument("--compression", default="snappy", help="Parquet codec (snappy: pyarrow's default)")
    args = ap.parse_args()
    pqs, jsonls = prepare(Path(args.data), args.shards, args.docs, args.page_rows, args.compression)
    rows = []
    for name, paths, raw in (("Parquet tokens", pqs, False), ("JSONL text", jsonls, True)):
        best_o, med_o, src = timed(lambda p=paths: open_source(p), args.repeats)
        stream = DocumentStream(src, tokenizer=None if not raw else "bytes", shuffle=True)
        best_e, med_e, count = timed(lambda s=stream, r=raw: epoch(s, r), args.repeats)
        unit = "documents" if raw else "tokens"
        rows.append(f"| {name} | {len(paths)} | {best_o * 1e3:.0f} | {med_o * 1e3:.0f} | {count:,} {unit} | "
                    f"{count / best_e / 1e6:.2f} | {count / med_e / 1e6:.2f} |")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| shards | files | open best ms | open median ms | epoch | best M/s | median M/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
