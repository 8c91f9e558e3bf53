"""Tokens per second of each tokenizer's `encode_batch` on the stdlib demo corpus (no asserts: a measurement).

    .venv/bin/python benchmarks/tokenizer_speed.py --threads 2 --repeats 3

The corpus is read into memory first; the time covers `encode_batch` on batches of `--batch` documents (the
int32 conversion included), best of `--repeats` passes. Machine load is printed alongside: on a shared machine
other processes' CPU time shows up in the numbers.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from packloader.sources.directory import stdlib_corpus
from packloader.sources.tokenizers import get_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizers", default="tekken,cl100k,bytes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    src = stdlib_corpus()
    texts = [t for shard, info in enumerate(src.shards) for t in src.read(shard, np.arange(info.num_rows))]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"stdlib corpus: {len(texts)} files, {mb:.1f} MB ({src.skipped.summary()}); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    for name in args.tokenizers.split(","):
        try:
            tok = get_tokenizer(name, num_threads=args.threads)
        except ImportError as e:
            print(f"{name}: unavailable ({e})")
            continue
        tok.encode_batch(texts[:32])  # warm up
        times, tokens = [], 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = 0
            for i in range(0, len(texts), args.batch):
                tokens += sum(len(ids) for ids in tok.encode_batch(texts[i : i + args.batch]))
            times.append(time.perf_counter() - start)
        best = min(times)
        print(f"{name:>7}: {tokens:,} tokens, best {best:.2f} s of {args.repeats} -> "
              f"{tokens / best / 1e6:.2f} M tokens/s ({mb / best:.1f} MB/s, {args.threads} threads)")


if __name__ == "__main__":
    main()
