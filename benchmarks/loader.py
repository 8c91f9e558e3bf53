"""Tokens per second from shards to collated batches: PackedLoader against a plain torch DataLoader.

    .venv/bin/python benchmarks/loader.py --repeats 3 --write docs/benchmarks.md

Data (prepared once, not timed): the Python standard library's .py files (no download) as Parquet text shards,
repeated `--copies` times, and the same documents tokenized with cl100k into Parquet token shards
(`tokenize_to_parquet`: `tokens list<int32>`, `length int32`, EOS appended).

Four timed runs, each one whole epoch in the same shuffled epoch order (`packloader.sources.order`):
- packloader, pre-tokenized: `PackedLoader(token shards)`: lengths from the length column, fixed BFD plans of
  `--tokens-per-step` tokens into `--max-tokens` micro-batches, tokens read for the micro-batches only, collated
  (labels, positions, cu_seqlens); one process, `--threads` threads.
- plain DataLoader, pre-tokenized: a map-style Dataset returning one document's tokens (the same Parquet reader),
  `DataLoader(batch_size=--baseline-docs, num_workers=0)`, a collate that concatenates and shifts labels.
- packloader, raw text: `PackedLoader(text shards, tokenizer="cl100k")`, `--threads` threads tokenizing.
- plain DataLoader, raw text: a Dataset that reads and tokenizes one document (cl100k, EOS appended),
  `num_workers=--threads`, the same concatenating collate.

Runs alternate (packloader, baseline, packloader, ...) so load from other processes falls on both.
Tokens/s = tokens in the yielded batches / wall time of the epoch (pipeline start-up included; building the
loader object and preparing data excluded). Best and median of `--repeats` epochs. The machine's CPU count and
load average are printed, because on a shared machine other processes' load shows up in the numbers.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from sections import write_section  # benchmarks/, the script's own folder
from torch.utils.data import DataLoader, Dataset

from packloader.collate.collate import collate_concat
from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.directory import stdlib_corpus
from packloader.sources.order import epoch_stream
from packloader.sources.parquet import ParquetSource
from packloader.sources.pretokenize import tokenize_to_parquet
from packloader.sources.tokenizers import get_tokenizer

TARGETS = {"pre-tokenized": 2.0e6, "raw text": 0.5e6}


def prepare(data: Path, copies: int, shards: int) -> tuple[list[str], list[str]]:
    text_dir, tok_dir = data / "text", data / "tokens"
    if not (text_dir.exists() and any(text_dir.glob("*.parquet"))):
        src = stdlib_corpus()
        texts = [t for s, info in enumerate(src.shards) for t in src.read(s, np.arange(info.num_rows))]
        texts = texts * copies
        text_dir.mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(np.array_split(np.arange(len(texts)), shards)):
            pq.write_table(pa.table({"text": pa.array([texts[j] for j in part], pa.string())}),
                           text_dir / f"part-{i:05d}.parquet", row_group_size=256, compression="zstd")
    if not (tok_dir.exists() and any(tok_dir.glob("*.parquet"))):
        tokenize_to_parquet(ParquetSource(sorted(str(p) for p in text_dir.glob("*.parquet"))), get_tokenizer("cl100k"),
                            tok_dir, shard_tokens=4 << 20, row_group_tokens=256 << 10, progress=False)
    return sorted(str(p) for p in text_dir.glob("*.parquet")), sorted(str(p) for p in tok_dir.glob("*.parquet"))


class _Docs(Dataset):
    """One document per index, in the given (shard, row) order: tokens from Parquet, or text tokenized here."""

    def __init__(self, paths: list[str], seed: int, tokenizer: str | None) -> None:
        self.source = ParquetSource(paths)
        self.shards, self.rows = epoch_stream([s.num_rows for s in self.source.shards], seed, 0)
        self.tokenizer_name = tokenizer
        self._tok = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        doc = next(self.source.read(int(self.shards[i]), np.array([self.rows[i]])))
        if self.tokenizer_name is None:
            return doc
        if self._tok is None:
            self._tok = get_tokenizer(self.tokenizer_name, num_threads=1)
        ids = self._tok.encode(doc)
        return np.append(ids, np.int32(self._tok.eos_id))


def _concat(docs):
    return collate_concat(docs)


def run_packloader(paths: list[str], args, tokenizer: str) -> tuple[int, float, dict]:
    cfg = PlanConfig(strategy=args.strategy, max_tokens=args.max_tokens, context=args.max_tokens,
                     tokens_per_step=args.tokens_per_step, model=args.model)
    loader = PackedLoader(paths, tokenizer=tokenizer, config=cfg, num_threads=args.threads, seed=args.seed,
                          prefetch=args.prefetch, chunk_docs=args.chunk_docs)
    start = time.perf_counter()
    tokens = batches = 0
    for b in loader:
        tokens += b.num_tokens
        batches += 1
    elapsed = time.perf_counter() - start
    st = loader.stats
    loader.close()
    return tokens, elapsed, {"batches": batches, "mode": loader.lengths_mode, "steps": st.steps,
                             "split": st.split_documents}


def run_baseline(paths: list[str], args, tokenizer: str | None, workers: int) -> tuple[int, float, dict]:
    ds = _Docs(paths, args.seed, tokenizer)
    dl = DataLoader(ds, batch_size=args.baseline_docs, shuffle=False, num_workers=workers, collate_fn=_concat,
                    persistent_workers=False, prefetch_factor=4 if workers else None)
    start = time.perf_counter()
    tokens = batches = 0
    for b in dl:
        tokens += int(b["input_ids"].numel())
        batches += 1
    elapsed = time.perf_counter() - start
    return tokens, elapsed, {"batches": batches}


def measure_pair(ours, base, repeats: int) -> tuple[tuple[int, list[float], dict], tuple[int, list[float], dict]]:
    """Alternate the two runs (ours, base, ours, base, ...) so that load from other processes on a shared
    machine falls on both alike."""
    out = ([0, [], {}], [0, [], {}])
    for _ in range(repeats):
        for slot, fn in zip(out, (ours, base)):
            tokens, elapsed, info = fn()
            slot[0], slot[2] = tokens, info
            slot[1].append(tokens / elapsed)
    return tuple(out[0]), tuple(out[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="directory for the prepared shards (default: a temporary one)")
    p.add_argument("--copies", type=int, default=2, help="how many times the stdlib corpus is repeated")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--chunk-docs", type=int, default=256)
    p.add_argument("--strategy", default="fixed")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--tokens-per-step", type=int, default=1 << 20)
    p.add_argument("--baseline-docs", type=int, default=4, help="documents per batch of the plain DataLoader")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="pre-tokenized,raw text")
    p.add_argument("--write", default=None, help="markdown file whose '## Loader' section gets the results")
    args = p.parse_args()
    torch.set_num_threads(1)

    tmp = None
    if args.data is None:
        tmp = tempfile.TemporaryDirectory(prefix="packloader-bench-")
        data = Path(tmp.name)
    else:
        data = Path(args.data)
    t0 = time.perf_counter()
    text_paths, token_paths = prepare(data, args.copies, args.shards)
    n_docs = sum(pq.ParquetFile(p).metadata.num_rows for p in text_paths)
    load = os.getloadavg()[0]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"data: {n_docs} documents in {len(text_paths)} text / {len(token_paths)} token shards "
          f"(prepared in {time.perf_counter() - t0:.1f} s); {cpus} CPUs, load average {load:.2f}")

    rows = []
    only = set(args.only.split(","))
    if "pre-tokenized" in only:
        (tok, ours, info), (btok, base, binfo) = measure_pair(
            lambda: run_packloader(token_paths, args, "cl100k"), lambda: run_baseline(token_paths, args, None, 0), args.repeats)
        rows.append(("pre-tokenized", f"packloader ({args.threads} threads, lengths={info['mode']})", tok, ours, info))
        rows.append(("pre-tokenized", "plain DataLoader (num_workers=0)", btok, base, binfo))
    if "raw text" in only:
        (tok, ours, info), (btok, base, binfo) = measure_pair(
            lambda: run_packloader(text_paths, args, "cl100k"), lambda: run_baseline(text_paths, args, "cl100k", args.threads),
            args.repeats)
        rows.append(("raw text", f"packloader ({args.threads} threads, cl100k, lengths={info['mode']})", tok, ours, info))
        rows.append(("raw text", f"plain DataLoader (num_workers={args.threads}, cl100k)", btok, base, binfo))

    header = "| input | loader | tokens/epoch | best M tokens/s | median M tokens/s | target |"
    lines = [header, "| --- | --- | ---: | ---: | ---: | --- |"]
    for kind, name, tok, rates, _ in rows:
        target = f">= {TARGETS[kind] / 1e6:g}M" if name.startswith("packloader") else ""
        lines.append(f"| {kind} | {name} | {tok:,} | {max(rates) / 1e6:.2f} | {statistics.median(rates) / 1e6:.2f} | {target} |")
    table = "\n".join(lines)
    print(table)
    verdicts = []
    for kind in ("pre-tokenized", "raw text"):
        pair = [r for r in rows if r[0] == kind]
        if len(pair) == 2:
            ours, base = statistics.median(pair[0][3]), statistics.median(pair[1][3])
            verdicts.append(f"{kind}: packloader {ours / 1e6:.2f} M/s (target {TARGETS[kind] / 1e6:g} M/s: "
                            f"{'met' if ours >= TARGETS[kind] else 'NOT met'}), {ours / base:.2f}x the plain DataLoader")
    for v in verdicts:
        print(v)

    if args.write:
        argv = [a for a in sys.argv[1:]]
        cmd = ".venv/bin/python benchmarks/loader.py " + " ".join(shlex.quote(a) for a in argv)
        section = "\n".join([
            "Tokens per second from shards to collated batches, one epoch, PackedLoader against a plain",
            "`torch.utils.data.DataLoader` over the same shards, same epoch order, same tokenizer (see the docstring",
            "of `benchmarks/loader.py` for exactly what each run does).",
            "",
            "```bash",
            cmd,
            "```",
            "",
            f"Data: the Python standard library's .py files x{args.copies} ({n_docs} documents, "
            f"{rows[0][2] if rows else 0:,} cl100k tokens with EOS), {len(text_paths)} shards. Plans: `{args.strategy}`, "
            f"max_tokens = context = {args.max_tokens}, tokens_per_step = {args.tokens_per_step}. "
            f"Machine: {cpus} CPUs, load average {load:.2f} at the start (shared; numbers are noisy). "
            f"{args.repeats} epochs each.",
            "",
            table,
            "",
            *[f"- {v}" for v in verdicts],
            "",
        ])
        write_section(Path(args.write), "loader", "Loader throughput", section)
        print(f"wrote the Loader section of {args.write}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
