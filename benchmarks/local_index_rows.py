"""What holding each page's rows to the length index costs a local read of the tokenize layout (issue 35, item 5):
a shard as `packloader tokenize` writes it (one document a page, zstd, CRCs, its length index beside it) read
whole through `ParquetSource`, which decodes each row group through the index (`parquet_chunk.indexed_block`).
Timed in the same run: the read as it ships (ids, CRC and the rows of every page's levels checked against the
index), the same read with the row check switched off (the decoder before issue 35), and pyarrow's own read of
the file. Token rows are seeded long-tail lengths of random ids.

    .venv/bin/python benchmarks/local_index_rows.py --docs 4000 --repeats 5 --write docs/benchmarks.md

CPU time of the process, best of `--repeats` reads each (a shared machine's load lengthens wall time)."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sections import write_section  # noqa: E402

from packloader.sources import parquet_chunk  # noqa: E402
from packloader.sources.parquet import ParquetSource  # noqa: E402
from packloader.sources.pretokenize import write_index  # noqa: E402


def shard(path: Path, docs: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(600), 1.0, docs), 1, 32768).astype(int)
    rows = [rng.integers(0, 128000, size=n).astype(np.int32) for n in lengths]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32()))}), path, max_rows_per_page=1,
                   use_dictionary=False, compression="zstd", write_page_checksum=True, row_group_size=512)
    write_index(str(path))
    return int(lengths.sum())


def best(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return min(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--write", default=None)
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tok.parquet"
        tokens = shard(path, args.docs, 0)

        def ours():
            src = ParquetSource(path)
            return sum(len(d) for d in src.read(0, np.arange(src.shards[0].num_rows)))

        checked = best(ours, args.repeats)
        keep = parquet_chunk._check_rows
        parquet_chunk._check_rows = lambda *a, **k: None
        try:
            unchecked = best(ours, args.repeats)
        finally:
            parquet_chunk._check_rows = keep
        arrow = best(lambda: pq.read_table(path), args.repeats)
    cmd = ".venv/bin/python benchmarks/local_index_rows.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = "\n".join([
        "A local shard of the tokenize layout read whole through its length index, with each page's rows held to "
        "the index (what ships since issue 35) and without (the decoder before it), beside pyarrow's read of the "
        "file; CPU time, best of the repeats (`benchmarks/local_index_rows.py`'s docstring says what a run does).",
        "", "```bash", cmd, "```", "",
        f"Measured {when} on {platform.machine()} with {cpus} CPUs (load average {load:.1f} at the start; shared). "
        f"{args.docs:,} documents, {tokens:,} tokens, one document a page.", "",
        "| read | CPU s | relative to the read without the row check |",
        "| --- | ---: | ---: |",
        f"| rows checked (ships) | {checked:.3f} | {checked / unchecked:.2f}x |",
        f"| rows not checked | {unchecked:.3f} | 1.00x |",
        f"| pyarrow.parquet.read_table | {arrow:.3f} | {arrow / unchecked:.2f}x |",
    ])
    print(body)
    if args.write:
        write_section(Path(args.write), "local_index_rows", "Local reads through the length index: the row check", body)


if __name__ == "__main__":
    main()
