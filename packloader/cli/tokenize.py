"""`packloader tokenize INPUT... --out DIR`: text shards to Parquet token shards (tokens, length), in order."""

from __future__ import annotations

import argparse
import sys
import time

from packloader.cli import numbers
from packloader.cli.exit_codes import EXIT_BAD_INPUT
from packloader.sources.format_registry import format_names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="Parquet/JSONL files, a glob, an MDS directory or a directory of text files; 'stdlib' for "
                        "the Python standard library's .py files")
    p.add_argument("--out", required=True, help="directory for part-NNNNN.parquet token shards")
    p.add_argument("--tokenizer", default="tekken", help="tekken (default), cl100k, bytes or hf:PATH/tokenizer.json")
    p.add_argument("--column", default=None, help="text column / JSONL field (default: text, content)")
    p.add_argument("--format", default=None, choices=format_names(),
                   help="input format (default: from the extension or the directory's contents)")
    p.add_argument("--pattern", default="**/*", help="glob of the files to read in a directory; it also decides the format (default **/*)")
    p.add_argument("--shard-tokens", type=numbers.tokens, default=1 << 27, help="start a new file after this many tokens")
    p.add_argument("--row-group-tokens", type=numbers.tokens, default=1 << 20, help="tokens per Parquet row group")
    p.add_argument("--page-rows", type=int, default=1,
                   help="documents per Parquet data page (default 1: a rank reading from object storage fetches only "
                        "its own documents' pages, through the length index written beside each shard, which local "
                        "reads decode through too; 0: pyarrow's 1 MiB pages, about 9 %% fewer bytes)")
    p.add_argument("--no-eos", action="store_true", help="do not append the tokenizer's EOS to each document")
    p.add_argument("--skip-empty", action="store_true", help="skip and count empty documents instead of failing")
    p.add_argument("--skip-bad-files", action="store_true",
                   help="in a plain directory, skip and count files that are not UTF-8 instead of failing")
    p.add_argument("--threads", type=numbers.threads, default=None, help="tokenizer threads (default: usable CPUs, at most 8)")
    p.add_argument("--eos", default=None, help="EOS token of an hf: tokenizer whose files do not name one")
    p.add_argument("--overwrite", action="store_true", help="replace token shards already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--part", default=None, metavar="I/N",
                       help="tokenize part I of N (0 <= I < N) into --out, for a SLURM array or torchrun ranks: the N "
                            "parts, read as one directory, equal one machine's tokenize of the same input")
    split.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="tokenize as a Ray Data pipeline of --ray-workers parts: a local Ray instance, or a cluster "
                            "ADDRESS (e.g. ray://head:10001) whose workers share --out (needs packloader[ray])")
    p.add_argument("--ray-workers", type=int, default=2, help="parts (and Ray tasks at once) with --ray (default 2)")


def run(args: argparse.Namespace) -> int:
    from packloader.sources.errors import SourceError

    try:
        return _run(args)
    except (SourceError, FileNotFoundError, FileExistsError, ValueError, ImportError) as e:
        print(f"packloader tokenize: error: {e}", file=sys.stderr)  # the message names the file, row or field
        return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    from packloader.sources.pretokenize import tokenize_to_parquet
    from packloader.sources.tokenize_input import open_input
    from packloader.sources.tokenize_parts import parse_part, tokenize_part
    from packloader.sources.tokenizers import get_tokenizer

    open_options = {"column": args.column, "format": args.format, "empty": "skip" if args.skip_empty else "error",
                    "pattern": args.pattern, "errors": "skip" if args.skip_bad_files else "error"}
    options = {"append_eos": not args.no_eos, "shard_tokens": args.shard_tokens,
               "row_group_tokens": args.row_group_tokens, "page_rows": args.page_rows, "overwrite": args.overwrite}
    eos = int(args.eos) if args.eos is not None and args.eos.isdigit() else args.eos
    if args.ray is not None:
        return _on_ray(args, open_options, options, eos)
    source = open_input(args.inputs, open_options)
    tokenizer = get_tokenizer(args.tokenizer, num_threads=args.threads, eos=eos)
    if args.part is not None:
        part, parts = parse_part(args.part)
        start = time.perf_counter()
        r = tokenize_part(source, tokenizer, args.out, part, parts, progress=not args.no_progress, **options)
        rate = r.tokens / max(time.perf_counter() - start, 1e-9)
        print(f"part {part}/{parts}: documents {r.first:,}..{r.end - 1:,} of {r.input_documents:,}, {r.tokens:,} "
              f"tokens in {len(r.files)} files under {args.out} ({rate:,.0f} tokens/s)")
        return 0
    summary = tokenize_to_parquet(source, tokenizer, args.out, progress=not args.no_progress, **options)
    rate = summary.tokens / summary.seconds if summary.seconds > 0 else float("nan")
    print(
        f"{summary.documents:,} documents, {summary.tokens:,} tokens ({summary.tokenizer}, "
        f"EOS {'appended' if summary.eos_appended else 'not appended'}) in {len(summary.files)} files under "
        f"{args.out}, {summary.seconds:.1f} s ({rate:,.0f} tokens/s)"
    )
    if summary.skipped:
        print("skipped: " + ", ".join(f"{n:,} {why}" for why, n in sorted(summary.skipped.items())), file=sys.stderr)
    return 0


def _on_ray(args: argparse.Namespace, open_options: dict, options: dict, eos) -> int:
    from packloader.sources.tokenize_ray import tokenize_on_ray

    start = time.perf_counter()
    records = tokenize_on_ray(args.inputs, args.tokenizer, args.out, workers=args.ray_workers,
                              address=None if args.ray == "local" else args.ray, open_options=open_options,
                              options=options, threads=args.threads, eos=eos)
    seconds = time.perf_counter() - start
    tokens = sum(r.tokens for r in records)
    print(f"{sum(r.documents for r in records):,} documents, {tokens:,} tokens in {len(records)} parts "
          f"({sum(len(r.files) for r in records)} files) under {args.out} on Ray, {seconds:.1f} s "
          f"({tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    return 0
