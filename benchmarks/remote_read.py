"""Object storage against local disk: the same Parquet shards read by PackedLoader from a loopback S3 server
(moto_server) and from local files; bytes each rank fetches at dp 4.

    .venv/bin/python benchmarks/remote_read.py --write docs/benchmarks.md

Data (prepared once, not timed): `--shards` Parquet token shards (`tokens list<int32>`, `length`), documents of
random ids with lengths drawn log-uniformly from 16 to 4096, row groups of 256 documents; and text shards of the
same documents' ids written as decimal words, read with the `bytes` tokenizer (raw text: the tokenizer's cost is
the same whatever the storage, so a cheap one shows the storage's share).
Bytes per rank: the same pre-tokenized documents also written with one document a row group (as
`packloader tokenize --row-group-tokens 1` writes them), and as `packloader tokenize` writes them by default (one
row group per shard here, since a shard holds fewer than its 1M row-group tokens; one document a data page;
the length index beside each shard), read with exact ranges (`Storage(block_size=0)`) or 4 MiB blocks.
Tokens/s of the paged reads: the tokenize layout from local disk, and from S3 with exact ranges and 1 (before)
or 8 (after) ranged reads in flight (`Storage(fetch_threads=...)`).
Timed: one whole epoch of `PackedLoader` (fixed plans, `--threads` threads) from local paths, then from
`s3://` URLs through `AWS_ENDPOINT_URL` (4 MiB ranged reads, no disk cache): tokens/s = tokens yielded / wall time,
time to first batch from the loader's creation (opening shards, lengths included). Bytes per rank: four loaders
at dp 4 (`dp_rank` 0..3), each with its own storage, each running its epoch; bytes fetched by each / object bytes.
moto_server is a Python server, so the S3 figures are a floor for a real object store's throughput, not its latency.
"""

from __future__ import annotations

import argparse
import io
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

from packloader import PackedLoader, ParallelConfig, PlanConfig, Storage  # noqa: E402
from packloader.sources.length_index import index_name  # noqa: E402
from packloader.sources.pretokenize import write_index  # noqa: E402


def corpus(shards: int, docs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(shards):
        lens = np.exp(rng.uniform(np.log(16), np.log(4096), docs)).astype(int)
        out.append([rng.integers(0, 30000, n).astype(np.int32) for n in lens])
    return out


def tokenize_shard(docs, path: Path, page_rows: int = 1, index: bool = True) -> None:
    """A shard as `packloader tokenize` writes it (one row group here, `page_rows` documents a page, 0: pyarrow's
    1 MiB pages), with its length index beside it."""
    t = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                  "length": pa.array([len(d) for d in docs], pa.int32())})
    pq.write_table(t, path, row_group_size=len(docs), compression="zstd", use_dictionary=False,
                   write_page_checksum=True, max_rows_per_page=page_rows or None, write_statistics=["length"])
    if index:
        write_index(str(path))


def tokenize_layout(docs, client, key: str, tmp: str) -> int:
    """A shard as `packloader tokenize` writes it by default, uploaded with its length index; its object bytes."""
    path = Path(tmp, key.replace("/", "-"))
    tokenize_shard(docs, path)
    client.put_object(Bucket="bench", Key=key, Body=path.read_bytes())
    client.put_object(Bucket="bench", Key=index_name(key), Body=Path(index_name(str(path))).read_bytes())
    return path.stat().st_size


def shard_bytes(docs, text: bool, row_group: int = 256) -> bytes:
    if text:
        t = pa.table({"text": [" ".join(map(str, d.tolist())) for d in docs]})
    else:
        t = pa.table({"tokens": pa.array([d.tolist() for d in docs], pa.list_(pa.int32())),
                      "length": pa.array([len(d) for d in docs], pa.int32())})
    buf = io.BytesIO()
    # statistics for the length column only: a one-document row group's min == max is its length in the footer
    pq.write_table(t, buf, row_group_size=row_group, compression="zstd", use_dictionary=False,  # as tokenize writes
                   write_statistics=["length"] if not text else True)
    return buf.getvalue()


def epoch(source, text: bool, threads: int, dp: int = 1, rank: int = 0,
          train_s: float = 0.0) -> tuple[int, float, float]:
    """One epoch of one rank: (tokens, wall seconds, seconds to the first batch); `train_s` of sleep a micro-batch
    stands for training (the GIL released, as a GPU step releases it)."""
    cfg = PlanConfig(strategy="fixed", max_tokens=8192, context=8192, tokens_per_step=65536,
                     parallel=ParallelConfig(dp=dp))
    start = time.perf_counter()
    loader = PackedLoader(source, config=cfg, tokenizer="bytes" if text else None, num_threads=threads,
                          dp_rank=rank, check_ranks=False)
    first, tokens = None, 0
    for b in loader:
        first = first or time.perf_counter() - start
        tokens += int(b.input_ids.numel())
        time.sleep(train_s)
    return tokens, time.perf_counter() - start, first or 0.0


def rr_many(client, tmp: str, shards: int, docs: int, threads: int) -> list[str]:
    """The same number of documents in `shards` shards (tokenize layout): a step's documents spread over many
    shards, read one shard at a time (`prefetch` off) or all shards' pages in one round (`ParquetSource.prefetch`,
    what `DocumentStream.read` does); dp 4 rank 0, exact ranges, 8 in flight."""
    from packloader.sources.parquet import ParquetSource

    for i, d in enumerate(corpus(shards, docs, seed=1)):
        tokenize_layout(d, client, f"many/{i}.parquet", tmp)
    rows, real = [], ParquetSource.prefetch
    try:
        for name, pre in (("one shard at a time", None), ("all shards' pages at once", real)):
            ParquetSource.prefetch = pre
            tokens, wall, first = epoch(Storage(block_size=0).paths("s3://bench/many/*.parquet"), False, threads, dp=4)
            rows.append(f"| tokenize layout + index, {shards} shards, dp 4 rank 0 | loopback S3, exact, 8 in flight, "
                        f"{name} | {tokens:,} | {tokens / wall:,.0f} | {first:.2f} |")
            print(rows[-1], flush=True)
    finally:
        ParquetSource.prefetch = real
    return rows


LOCAL_LAYOUTS = {  # name: (writer, row of the table)
    "256 documents a row group, 1 MiB pages, no checksums (the pre-tokenized rows above)":
        lambda d, p: p.write_bytes(shard_bytes(d, False)),
    "tokenize --page-rows 0 (1 MiB pages), index beside": lambda d, p: tokenize_shard(d, p, page_rows=0),
    "tokenize default (one document a page), index beside": lambda d, p: tokenize_shard(d, p),
    "tokenize default (one document a page), no index (pyarrow decodes)":
        lambda d, p: tokenize_shard(d, p, index=False),
}


def rr_local(data, tmp: str, threads: int, repeats: int) -> list[str]:
    """Local disk, dp 1: one epoch of each layout in turn, `repeats` rounds (interleaved, so the machine's load
    falls on every layout alike); median tokens/s and the median of each round's ratio to the first layout."""
    import statistics

    globs = []
    for k, write in enumerate(LOCAL_LAYOUTS.values()):
        for i, docs in enumerate(data):
            write(docs, Path(tmp, f"local{k}-{i}.parquet"))
        globs.append(f"{tmp}/local{k}-*.parquet")
    epoch(globs[0], False, threads)  # warm-up
    rates: list[list[float]] = [[] for _ in globs]
    for _ in range(repeats):
        for k, g in enumerate(globs):
            tokens, wall, _ = epoch(g, False, threads)
            rates[k].append(tokens / wall)
    rows = []
    for k, name in enumerate(LOCAL_LAYOUTS):
        ratio = statistics.median(a / b for a, b in zip(rates[k], rates[0]))
        rows.append(f"| {name} | {statistics.median(rates[k]):,.0f} | {min(rates[k]):,.0f}..{max(rates[k]):,.0f} "
                    f"| {ratio:.2f} |")
        print(rows[-1], flush=True)
    return rows


def rr_gaps(client, tmp: str, threads: int, gaps: list[int], repeats: int = 3) -> list[tuple]:
    """dp 4 over the tokenize-layout shards (uploaded under tok/), exact ranges with the gaps below each bound
    merged: every rank's bytes and requests, and rank 0's tokens/s (median of `repeats` epochs, after an
    untimed warm-up epoch)."""
    import statistics

    epoch(Storage(block_size=0).paths("s3://bench/tok/*.parquet"), False, threads, dp=4)  # warm-up
    rows = []
    for gap in gaps:
        got, reqs, rates = [], [], []
        for rank in [0] * (repeats - 1) + [0, 1, 2, 3]:
            store = Storage(block_size=0, merge_gap_bytes=gap)
            tokens, wall, _ = epoch(store.paths("s3://bench/tok/*.parquet"), False, threads, dp=4, rank=rank)
            if rank == 0:
                rates.append(tokens / wall)
            if rank > 0 or len(rates) == repeats:
                got.append(store.bytes_read)
                reqs.append(store.requests)
        rows.append((gap, got, reqs, statistics.median(rates)))
        print(*rows[-1], flush=True)
    return rows


def _command() -> str:
    return "python benchmarks/remote_read.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def write_local(args, rows: list[str]) -> None:
    body = (
        f"`{_command()}` ({args.shards} shards x {args.docs} documents as above, {args.threads} threads, "
        f"{args.repeats} rounds; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}). One dp-1 epoch of "
        "`PackedLoader` from local files per layout per round, the layouts in turn within each round; tokens/s "
        "median and range over the rounds, and the median of each round's ratio to the first row (the machine is "
        "shared: compare ratios, not the absolute figures).\n\n"
        "| layout | tokens/s (median) | range | ratio to 256-document row groups |\n| --- | --- | --- | --- |\n"
        + "\n".join(rows))
    write_section(args.write, "remote-read-local", "Local reads of the tokenize layout", body)


def write_gaps(args, gaps: list, corpus_bytes: int) -> None:
    lines = "\n".join(
        f"| {gap >> 10} KiB | {', '.join(f'{b:,}' for b in got)} | {max(got) / corpus_bytes:.0%} | "
        f"{', '.join(f'{r:,}' for r in reqs)} | {rate:,.0f} |" for gap, got, reqs, rate in gaps)
    body = (
        f"`{_command()}` ({args.shards} shards x {args.docs} documents, tokenize layout with the length index, "
        f"{args.threads} threads; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}). dp 4, each rank's epoch "
        "from moto_server on the loopback with exact ranges (`Storage(block_size=0, merge_gap_bytes=...)`, 8 reads "
        f"in flight): bytes and requests per rank (footers, indexes and the probes for them included) against "
        f"the corpus's {corpus_bytes:,} object bytes (target: at most 1/dp + 10 % = 35 %), and rank 0's "
        "tokens/s (median of 3 epochs).\n\n"
        "| merge gap | bytes per rank 0..3 | largest share | requests per rank 0..3 | rank 0 tokens/s |\n"
        "| --- | --- | --- | --- | --- |\n" + lines)
    write_section(args.write, "remote-read-gaps", "Exact reads: merging the gaps between a rank's pages", body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--docs", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--many", type=int, default=16, help="shards of the many-shards rows (as many documents in all)")
    ap.add_argument("--train-ms", type=float, default=50.0, help="simulated training time a micro-batch")
    ap.add_argument("--write", type=Path)
    ap.add_argument("--part", choices=["all", "local", "gaps"], default="all",
                    help="local: the local-disk layouts alone; gaps: the gap-merging rows alone (both: their own "
                         "sections)")
    ap.add_argument("--repeats", type=int, default=7, help="rounds of the local-disk layouts")
    ap.add_argument("--gaps", default="0,4096,16384,65536,262144,1048576", help="merge_gap_bytes of the gap rows")
    args = ap.parse_args()
    if args.part == "local":
        with tempfile.TemporaryDirectory() as tmp:
            rows = rr_local(corpus(args.shards, args.docs), tmp, args.threads, args.repeats)
        if args.write:
            write_local(args, rows)
        return
    exe = find_moto_server()
    if exe is None:
        raise SystemExit("moto_server not found: bash scripts/setup.sh dev")
    server = MotoServer(exe)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=server.endpoint)
    rows, sizes = [], {}
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        data = corpus(args.shards, args.docs)
        with tempfile.TemporaryDirectory() as tmp:
            if args.part == "gaps":
                sizes = sum(tokenize_layout(d, client, f"tok/{i}.parquet", tmp) for i, d in enumerate(data))
                gaps = rr_gaps(client, tmp, args.threads, [int(g) for g in args.gaps.split(",")])
                if args.write:
                    write_gaps(args, gaps, sizes)
                return
            for kind, text in (("pre-tokenized", False), ("raw text", True)):
                sizes[kind] = 0
                for i, docs in enumerate(data):
                    body = shard_bytes(docs, text)
                    sizes[kind] += len(body)
                    Path(tmp, f"{kind[:3]}-{i}.parquet").write_bytes(body)
                    client.put_object(Bucket="bench", Key=f"{kind[:3]}/{i}.parquet", Body=body)
                epoch(f"{tmp}/{kind[:3]}-*.parquet", text, args.threads)  # warm-up (imports, compiled kernels)
                for where, src in (("local disk", f"{tmp}/{kind[:3]}-*.parquet"),
                                   ("loopback S3", Storage().paths(f"s3://bench/{kind[:3]}/*.parquet"))):
                    tokens, wall, first = epoch(src, text, args.threads)
                    rows.append(f"| {kind} | {where} | {tokens:,} | {tokens / wall:,.0f} | {first:.2f} |")
                    print(rows[-1], flush=True)
            sizes["tokenize"] = sum(tokenize_layout(d, client, f"tok/{i}.parquet", tmp) for i, d in enumerate(data))
            for dp, where, src in (
                    (1, "local disk", None), (1, "loopback S3, 4 MiB blocks", Storage()),
                    (1, "loopback S3, exact, 1 in flight", Storage(block_size=0, fetch_threads=1)),
                    (1, "loopback S3, exact, 8 in flight", Storage(block_size=0, fetch_threads=8)),
                    (4, "loopback S3, 4 MiB blocks", Storage()),
                    (4, "loopback S3, exact, 1 in flight", Storage(block_size=0, fetch_threads=1)),
                    (4, "loopback S3, exact, 8 in flight", Storage(block_size=0, fetch_threads=8))):
                src = f"{tmp}/tok-*.parquet" if src is None else src.paths("s3://bench/tok/*.parquet")
                tokens, wall, first = epoch(src, False, args.threads, dp=dp)
                rows.append(f"| tokenize layout + index, dp {dp} rank 0 | {where} | {tokens:,} | "
                            f"{tokens / wall:,.0f} | "
                            f"{first:.2f} |")
                print(rows[-1], flush=True)
            for where, src, threads in (
                    ("local disk", None, 2),
                    ("loopback S3, exact, reads in the training thread", Storage(block_size=0), 0),
                    ("loopback S3, exact, reads ahead in their own thread", Storage(block_size=0), 2)):
                src = f"{tmp}/tok-*.parquet" if src is None else src.paths("s3://bench/tok/*.parquet")
                tokens, wall, first = epoch(src, False, threads, dp=4, train_s=args.train_ms / 1e3)
                rows.append(f"| tokenize layout + index, dp 4 rank 0, {args.train_ms:g} ms training a micro-batch | "
                            f"{where} | {tokens:,} | {tokens / wall:,.0f} | {first:.2f} |")
                print(rows[-1], flush=True)
            many = rr_many(client, tmp, args.many, args.docs * args.shards // args.many, args.threads)
            rows += many
            per_rank, totals = {}, {}
            for group in (256, 1, "tokenize"):  # 256 documents a row group; one; `tokenize` defaults (paged)
                totals[group] = 0 if group != "tokenize" else sizes["tokenize"]
                for i, docs in enumerate(data if group != "tokenize" else []):
                    body = shard_bytes(docs, False, group)
                    totals[group] += len(body)
                    client.put_object(Bucket="bench", Key=f"rg{group}/{i}.parquet", Body=body)
                for block in ((4 << 20, 64 << 10, 0) if group != "tokenize" else (4 << 20, 0)):
                    prefix = f"rg{group}" if group != "tokenize" else "tok"
                    got = per_rank[group, block] = []
                    for rank in range(4):
                        store = Storage(block_size=block)
                        epoch(store.paths(f"s3://bench/{prefix}/*.parquet"), False, args.threads, dp=4, rank=rank)
                        got.append(store.bytes_read)
                    print(group, block, got, totals[group], flush=True)
    finally:
        server.close()
    fetched = "\n".join(
        f"| {group if group != 'tokenize' else 'all, one a page, length index (tokenize)'} | {totals[group]:,} | "
        f"{f'{block >> 10} KiB' if block else 'exact'} | {', '.join(f'{b:,}' for b in got)} | "
        f"{', '.join(f'{b / totals[group]:.0%}' for b in got)} | {max(got) / totals[group]:.0%} |"
        for (group, block), got in per_rank.items())
    cmd = _command()
    body = (
        f"`{cmd}` ({args.shards} shards x {args.docs} documents, lengths 16..4096 log-uniform, {args.threads} "
        f"threads; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}). One epoch each after an untimed warm-up epoch; S3 is moto_server on the "
        "loopback through `AWS_ENDPOINT_URL`, read by 4 MiB ranged GETs (moto is a Python server: a floor for a real "
        "store's throughput). Raw text is the same documents' ids written as decimal words, read with the `bytes` "
        "tokenizer (hence more tokens). First batch: seconds from building the loader (opening every shard) to its "
        "first micro-batch.\n\n"
        "| shards | from | tokens | tokens/s | first batch (s) |\n| --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n\nThe `tokenize layout + index` rows read the shards as `packloader tokenize` writes them by default (one "
        "row group a shard here, one document a data page, the length index beside each shard), through the index: "
        "with exact ranges (`Storage(block_size=0)`) a request fetches only its documents' pages, one ranged GET per "
        "run of adjacent pages (small gaps merged: `merge_gap_bytes`, last section), `fetch_threads` of them in "
        "flight at once (1: before, 8: the default); with 4 MiB "
        "blocks the pages come out of whole blocks, which the memory cache keeps. dp 4 rank 0 is one rank's epoch "
        "(its quarter of the documents). Exact ranges cost a request per document on a one-rank epoch, so they pay "
        "where a rank reads a small share; on moto, a Python server on the same 2 busy cores, a request costs "
        "milliseconds of CPU, and the 8 threads gain what the server's CPU allows. Local disk decodes whole row "
        "groups through the index beside each shard (`parquet_chunk.py`; pyarrow spends a zstd context per page "
        "on one document a page: next section). The last rows sleep a fixed time per micro-batch, standing for training: with "
        "`num_threads=0` the pages are fetched in the training thread, so reading and training add up; with 2 the "
        "loader's reading thread fetches the next steps' pages (`prefetch` steps ahead, default 2) while the trainer "
        "sleeps, and the epoch takes about the longer of the two. The many-shards rows hold the same number of "
        "documents in more shards, so a step's documents come from many shards: read shard by shard, each shard's "
        "few pages are a round of reads of their own; `DocumentStream.read` first asks the source to fetch every "
        "shard's pages in one round (`ParquetSource.prefetch`).\n\n"
        "Bytes each rank fetched at dp 4 over one epoch (pre-tokenized, ranged GETs of `block` bytes, no disk "
        "cache), against the corpus's object bytes; the target is at most 1/dp + 10 % = 35 %. Every rank reads every "
        "footer (once per shard: reopened files reuse the parsed footer) and plans from the lengths; it then reads "
        "only the row groups holding its documents, or with a length index only their pages. The shuffle spreads a "
        "rank's documents over every row group, so with 256 documents a group every rank fetches every group; with "
        "one document a group (`packloader tokenize --row-group-tokens 1`, or `row_group_size=1` with statistics on "
        "`length`) the footer's length statistics give the lengths and a rank fetches its own documents' row groups: "
        "exactly (`Storage(block_size=0)`), or rounded up to whole blocks, which at this corpus's 2-3 KB documents "
        "is most of the object (above 100 % at 64 KiB: some blocks are fetched twice, not investigated). One-document "
        "row groups make the corpus larger (a footer entry and page header per document: 17 % here). `tokenize`'s "
        "default layout (row groups of 1M tokens, one document a page, a length index) meets the target with exact "
        "ranges at any row-group size, for 9 % more bytes than pyarrow's 1 MiB pages (page headers, a zstd frame "
        "per page); the footers and indexes every rank reads are counted (the indexes are not in the corpus bytes: "
        "what the 4 MiB row fetched above them, about 18 bytes a document with the page bodies' table). A rank's share also follows its share of "
        "the tokens, which the fixed planner leaves uneven by a few percent.\n\n"
        "| documents per row group | corpus bytes | block | bytes per rank 0..3 | share per rank | largest share |\n"
        "| --- | --- | --- | --- | --- | --- |\n" + fetched
    )
    if args.write:
        write_section(args.write, "remote-read", "Object storage (loopback S3) against local disk", body)


if __name__ == "__main__":
    main()
