"""A mixture of 8 entries against one source of the same documents: loader tokens/s and planning time per step.

    .venv/bin/python benchmarks/mixture.py --write docs/benchmarks.md

Data (prepared once, not timed): 8 groups of `--docs` documents of random ids, lengths log-uniform 16..4096. Each
group is one Parquet token shard (`tokens`, `length`; zstd, row groups of 256), and the groups are also written in
other formats for the mixed-format mixture: group 3 as a Megatron `.bin`/`.idx` pair (megatron-core's builder),
group 4 as a `datasets` `save_to_disk` folder, groups 5..7 as objects on a loopback S3 server (moto_server).
Rows, each one whole epoch of `PackedLoader` (wlb plans, 2 threads), in turn, best of `--repeats`:
- one source: the 8 local Parquet shards opened as one source (the baseline);
- mixture, 8 local Parquet entries: one entry per shard, each weighted by its share of the tokens;
- mixture, 8 local entries of mixed formats: local Parquet x6, Megatron, `datasets` folder;
- mixture, 8 entries of mixed formats: local Parquet x3, Megatron, `datasets` folder, S3 Parquet x3;
- one source on S3: the 8 shards as s3:// URLs (the S3 floor the mixed row carries 3/8 of).
tokens/s = tokens yielded / the epoch's wall time from the loader's creation (opening, and a mixture's blend,
included); planning = the mean time of the planning stage's step (`StepNode._next_step`: drawing, cutting,
planning, the step's metrics; for a mixture the blend's lookups and per-entry counts too), measured in the same
runs. moto_server is a Python server on the same cores: the S3 rows are a floor.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sections import write_section  # benchmarks/, the script's own folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.s3_server import MotoServer, find_moto_server  # noqa: E402

from packloader import Mixture, MixtureEntry, PackedLoader, PlanConfig  # noqa: E402
from packloader.loader import nodes  # noqa: E402

CONFIG = PlanConfig(strategy="wlb", max_tokens=8192, context=8192, tokens_per_step=65536)


def corpus(groups: int, docs: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 30000, int(n)).astype(np.int32)
             for n in np.exp(rng.uniform(np.log(16), np.log(4096), docs))] for _ in range(groups)]


def write_parquet(docs, path) -> None:
    t = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                  "length": pa.array([len(d) for d in docs], pa.int32())})
    pq.write_table(t, path, row_group_size=256, compression="zstd", use_dictionary=False)


def write_megatron(docs, prefix: str) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in docs:
        builder.add_document(torch.from_numpy(d), [len(d)])
    builder.finalize(prefix + ".idx")


def write_hf(docs, path: str) -> None:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset(pa.table({"input_ids": pa.array([d.tolist() for d in docs], pa.list_(pa.int32()))})
                     ).save_to_disk(path)


class PlanTimer:
    """Wall time of every `StepNode._next_step` call that produced a step (planning stage only)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._orig = nodes.StepNode._next_step
        timer = self

        def timed(node):
            t = time.perf_counter()
            out = timer._orig(node)
            if out is not None:
                timer.seconds.append(time.perf_counter() - t)
            return out

        nodes.StepNode._next_step = timed

    def take(self) -> list[float]:
        out, self.seconds = self.seconds, []
        return out


def epoch(source, timer: PlanTimer) -> tuple[int, float, float]:
    """(tokens, tokens/s, mean planning seconds a step) of one epoch from the loader's creation."""
    timer.take()
    start = time.perf_counter()
    loader = PackedLoader(source, config=CONFIG, tokenizer=None, num_threads=2, check_ranks=False)
    tokens = sum(int(b.input_ids.numel()) for b in loader)
    wall = time.perf_counter() - start
    loader.close()
    plans = timer.take()
    return tokens, tokens / wall, float(np.mean(plans))


def mixture(names_sources, token_counts) -> Mixture:
    total = sum(token_counts)
    return Mixture(entries=[MixtureEntry(name=n, source=s, weight=t / total)
                            for (n, s), t in zip(names_sources, token_counts)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=2048, help="documents per entry (512 makes an epoch of 0.15 s: mostly opening)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    exe = find_moto_server()
    if exe is None:
        raise SystemExit("moto_server not found: bash scripts/setup.sh dev")
    server = MotoServer(exe)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=server.endpoint)
    timer = PlanTimer()
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        data = corpus(8, args.docs)
        tokens = [sum(len(d) for d in g) for g in data]
        with tempfile.TemporaryDirectory() as tmp:
            local = []
            for i, g in enumerate(data):
                p = f"{tmp}/g{i}.parquet"
                write_parquet(g, p)
                local.append(p)
                client.upload_file(p, "bench", f"g{i}.parquet")
            write_megatron(data[3], f"{tmp}/g3m")
            write_hf(data[4], f"{tmp}/g4hf")
            s3 = [f"s3://bench/g{i}.parquet" for i in range(8)]
            mixed = [local[0], local[1], local[2], f"{tmp}/g3m", f"{tmp}/g4hf", s3[5], s3[6], s3[7]]
            kinds = ["parquet", "parquet", "parquet", "megatron", "datasets", "s3 parquet", "s3 parquet",
                     "s3 parquet"]
            mixed_local = local[:3] + [f"{tmp}/g3m", f"{tmp}/g4hf"] + local[5:]
            kinds_local = ["parquet"] * 3 + ["megatron", "datasets"] + ["parquet"] * 3
            rows = {
                "one source: 8 local Parquet shards": lambda: local,
                "mixture: 8 local Parquet entries": lambda: mixture([(f"g{i}", p) for i, p in enumerate(local)],
                                                                    tokens),
                "mixture: 8 local entries, Parquet x6, Megatron, datasets": lambda: mixture(
                    [(f"g{i}-{k}", p) for i, (k, p) in enumerate(zip(kinds_local, mixed_local))], tokens),
                "mixture: 8 entries of mixed formats (3 on S3)": lambda: mixture(
                    [(f"g{i}-{k.replace(' ', '-')}", p) for i, (k, p) in enumerate(zip(kinds, mixed))], tokens),
                "one source: 8 Parquet shards on S3": lambda: s3,
            }
            got: dict[str, list[tuple[int, float, float]]] = {k: [] for k in rows}
            epoch(local, timer)  # warm-up: numba kernels compiled, files in the page cache
            for _ in range(args.repeats):
                for name, make in rows.items():
                    got[name].append(epoch(make(), timer))
    finally:
        server.close()
    base = max(r[1] for r in got["one source: 8 local Parquet shards"])
    base_plan = min(r[2] for r in got["one source: 8 local Parquet shards"])
    lines = [f"| loader | tokens | tokens/s (best of {args.repeats}) | vs one local source | planning ms/step | "
             "vs one local source |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, runs in got.items():
        tps, plan = max(r[1] for r in runs), min(r[2] for r in runs)
        lines.append(f"| {name} | {runs[0][0]:,} | {tps:,.0f} | {tps / base:.2f}x | {plan * 1e3:.2f} | "
                     f"{plan / base_plan:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        cmd = "python benchmarks/mixture.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        body = (f"`{cmd}` ({8 * args.docs:,} documents in 8 groups of {args.docs}, lengths 16..4096 log-uniform, "
                f"{sum(tokens):,} tokens; wlb, 64K tokens a step, 2 threads; {os.cpu_count()} CPUs, load "
                f"{os.getloadavg()[0]:.1f}). Each row one epoch from the loader's creation, the rows in turn, "
                "best of the rounds; the mixtures weight each entry by its share of the tokens, so an epoch draws "
                "the same documents as the one source (the blend's order, not the shuffle's). Planning: the mean "
                "time of the planning stage's step in the same runs.\n\n" + table)
        write_section(args.write, "mixture", "Mixtures: 8 entries against one source", body)


if __name__ == "__main__":
    main()
