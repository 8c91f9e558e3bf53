"""Per-document CP batches: what cutting a micro-batch into one pool GPU's part costs on the loader's CPU.

    .venv/bin/python benchmarks/dynamic_cp_collate.py --write docs/benchmarks.md

A pool of 16 GPUs (DP 4 x CP 4). Each micro-batch slot draws long-tail documents (lengths Pareto-distributed from
512 tokens, capped at 128K) until every GPU holds about `--tokens` tokens: a document of L tokens runs on the
smallest power-of-two group whose share, L / size, fits `--tokens` (so 128K on 4 GPUs at 32K each), placed on the
least-loaded aligned block of that size. Timed per pool GPU and micro-batch: `collate` of its whole micro-batch
(what fixed CP hands every CP rank), and `plan_dynamic_cp` + `localize` on top (the shard of every CP group and
the local tensors); the median over `--slots` slots x 16 GPUs, after one warm-up slot.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sections import write_section  # noqa: E402  (benchmarks/, the script's own folder)

from packloader.collate.collate import collate  # noqa: E402
from packloader.collate.cp_document_shards import localize  # noqa: E402
from packloader.contracts import CPPlacement, MicroBatch, Segment  # noqa: E402

POOL = 16


def _slot(rng: np.random.Generator, tokens: int, first_doc: int):
    """{gpu: MicroBatch} of one slot and the documents' token arrays."""
    load = np.zeros(POOL)
    per_gpu: dict[int, tuple[list, list]] = {g: ([], []) for g in range(POOL)}
    docs: dict[int, np.ndarray] = {}
    d = first_doc
    while load.min() < 0.9 * tokens:
        n = int(min(512 * (1 + rng.pareto(1.1)), 131072))
        size = 1
        while n / size > tokens and size < POOL:
            size *= 2
        blocks = [(load[f:f + size].max(), f) for f in range(0, POOL, size)]
        _, first = min(blocks)
        load[first:first + size] += n / size
        docs[d] = rng.integers(0, 131072, n).astype(np.int32)
        for g in range(first, first + size):
            per_gpu[g][0].append(Segment(d, 0, n, 0))
            per_gpu[g][1].append(CPPlacement(size, first))
        d += 1
    return {g: MicroBatch(segments=s, cp=p) for g, (s, p) in per_gpu.items()}, docs, d


def run(slots: int, tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    whole, dynamic, local_tokens, groups = [], [], [], []
    d = 0
    for k in range(slots + 1):
        mbs, docs, d = _slot(rng, tokens, d)
        for g, mb in mbs.items():
            t0 = time.perf_counter()
            b = collate(mb.segments, docs)
            t1 = time.perf_counter()
            loc = localize(b, mb, gpu=g, pool=POOL)
            t2 = time.perf_counter()
            if k:
                whole.append(t1 - t0)
                dynamic.append(t2 - t1)
                local_tokens.append(loc.num_tokens)
                groups.append(len(loc.cp.groups))
    return {"collate_ms": 1e3 * statistics.median(whole), "dynamic_ms": 1e3 * statistics.median(dynamic),
            "local_tokens": statistics.median(local_tokens), "groups": statistics.median(groups),
            "samples": len(whole)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per GPU per micro-batch slot")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", type=Path, default=None, help="write the section into this markdown file")
    args = ap.parse_args(argv)
    r = run(args.slots, args.tokens, args.seed)
    body = (
        f"`python benchmarks/dynamic_cp_collate.py {shlex.join(sys.argv[1:])}` ({platform.python_version()}, "
        f"{platform.machine()}, the 2-core development machine shared with other jobs; medians over "
        f"{r['samples']} GPU micro-batches of a DP 4 x CP 4 pool, about {args.tokens:,} tokens per GPU):\n\n"
        "| per GPU and micro-batch | median |\n| --- | --- |\n"
        f"| collate of the whole micro-batch (what fixed CP hands each CP rank) | {r['collate_ms']:.2f} ms |\n"
        f"| per-document CP on top: plan_dynamic_cp + localize | {r['dynamic_ms']:.2f} ms |\n"
        f"| this GPU's tokens after localize | {r['local_tokens']:,.0f} |\n"
        f"| CP groups in its micro-batch | {r['groups']:.0f} |\n")
    print(body)
    if args.write is not None:
        write_section(args.write, "dynamic_cp_collate", "Per-document CP: a pool GPU's part of a micro-batch", body)


if __name__ == "__main__":
    main()
