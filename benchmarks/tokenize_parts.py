"""Tokens per second of `tokenize` split over workers: one machine, `--part i/N` in N processes at once, and a
Ray Data pipeline with 1 and 2 local workers, on the same text (the Python standard library's .py files, repeated
`--copies` times as JSONL shards; no download).

    .venv/bin/python benchmarks/tokenize_parts.py --write docs/benchmarks.md

Each run writes its token shards (with their length indexes) to a fresh folder; the parts' folders are then read
back and checked to hold the one-machine run's tokens in its order. Tokens/s = tokens written / wall time of the
run (for `--part`: from launching the N processes to the last one's exit, interpreter start-up included; for Ray:
`tokenize_on_ray` on a local instance already running, as a cluster in use is; its start is printed apart). The load average is printed: on a shared machine other
processes' work shows up in the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sections import write_section  # benchmarks/, the script's own folder

from packloader.sources.directory import stdlib_corpus
from packloader.sources.open import open_source
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.tokenizers import get_tokenizer


def prepare(data: Path, copies: int, shards: int) -> list[str]:
    src = stdlib_corpus()
    texts = [t for s, info in enumerate(src.shards) for t in src.read(s, np.arange(info.num_rows))] * copies
    paths = []
    for k in range(shards):
        p = data / f"text-{k:03d}.jsonl"
        with open(p, "w") as f:
            for t in texts[k::shards]:
                f.write(json.dumps({"text": t}) + "\n")
        paths.append(str(p))
    return paths


def read_all(directory: Path) -> list[list[int]]:
    src = open_source(str(directory))
    return [d.tolist() for s, info in enumerate(src.shards) for d in src.read(s, np.arange(info.num_rows))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--tokenizer", default="cl100k")
    p.add_argument("--write", default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="packloader-tokparts-"))
    inputs = prepare(work, args.copies, args.shards)
    load = os.getloadavg()[0]
    rows = []

    start = time.perf_counter()
    s = tokenize_to_parquet(open_source(inputs), get_tokenizer(args.tokenizer, num_threads=1), work / "one",
                            progress=False)
    one = s.tokens / (time.perf_counter() - start)
    rows.append(("one machine (1 tokenizer thread)", 1, s.tokens, one))
    want = read_all(work / "one")

    for n in (1, 2):
        out = work / f"part{n}"
        cmd = [sys.executable, "-m", "packloader.cli.main", "tokenize", *inputs, "--out", str(out), "--tokenizer",
               args.tokenizer, "--threads", "1", "--no-progress"]
        start = time.perf_counter()
        procs = [subprocess.Popen([*cmd, "--part", f"{i}/{n}"], stdout=subprocess.DEVNULL) for i in range(n)]
        assert all(pr.wait() == 0 for pr in procs)
        rate = s.tokens / (time.perf_counter() - start)
        assert read_all(out) == want
        rows.append((f"`--part i/{n}`, {n} processes", n, s.tokens, rate))

    import ray

    from packloader.sources.tokenize_ray import tokenize_on_ray

    start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # a running instance, as a cluster in use
    ray_start = time.perf_counter() - start
    for n in (1, 2):
        out = work / f"ray{n}"
        start = time.perf_counter()
        records = tokenize_on_ray(inputs, args.tokenizer, out, workers=n, threads=1)
        rate = sum(r.tokens for r in records) / (time.perf_counter() - start)
        assert read_all(out) == want
        rows.append((f"Ray Data, {n} local worker{'s' if n > 1 else ''}", n, s.tokens, rate))
    ray.shutdown()

    cpus = len(os.sched_getaffinity(0))
    lines = [f"{len(want):,} documents, {s.tokens:,} tokens ({args.tokenizer}); {cpus} CPUs, load average "
             f"{load:.2f} at the start; the local Ray instance took {ray_start:.1f} s to start (not in its rows)", "",
             "| run | workers | tokens | tokens/s | vs one machine |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {name} | {n} | {tok:,} | {rate:,.0f} | {rate / one:.2f}x |" for name, n, tok, rate in rows]
    table = "\n".join(lines)
    print(table)
    if args.write:
        cmd = "`.venv/bin/python benchmarks/tokenize_parts.py --write docs/benchmarks.md`"
        write_section(Path(args.write), "tokenize_parts", "Tokenize split over workers (`--part`, Ray)",
                      f"{cmd}\n\n{table}\n\nEvery split's folder was read back and holds the one-machine run's "
                      "tokens in its order.")


if __name__ == "__main__":
    main()
