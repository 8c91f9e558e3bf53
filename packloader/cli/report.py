"""`packloader report INPUT... | --lengths FILE | --demo`: what a data set's document lengths do to a parallel
layout under today's packers and under every packloader strategy, with advice. Writes report.json, PNGs and a
self-contained report.html under --out; prints the table."""

from __future__ import annotations

import argparse
import sys

from packloader.cli import numbers

# --demo: the Python standard library's .py files, tokenized with the default tokenizer, on a layout where a
# 32K-token micro-batch of Llama-3-8B fits an H100 (tp=2, pp=2), 4 DP ranks: 16 GPUs.
DEMO = dict(dp=4, pp=2, cp=1, tp=2, max_tokens=32768, context=32768, tokens_per_step=4 * 4 * 32768, steps=8, model="llama3-8b")
DEFAULTS = dict(dp=8, pp=1, cp=1, tp=2, max_tokens=8192, context=None, tokens_per_step=None, steps=8, model="llama3-8b")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="Parquet/JSONL files, a glob, an MDS directory or a directory of text files")
    p.add_argument("--demo", action="store_true",
                   help="report on the Python standard library's .py files (no download), 16 GPUs of Llama-3-8B")
    p.add_argument("--lengths", metavar="FILE", help="document lengths instead of a source: .npy, Parquet length column, or text with one per line")
    p.add_argument("--lengths-column", default=None, help="the Parquet column of --lengths (default length, or tokens' list sizes)")
    p.add_argument("--column", default=None, help="text/tokens column or JSONL field of the input (default: auto)")
    p.add_argument("--format", default=None, choices=["parquet", "jsonl", "mds", "directory"], help="input format (default: detected)")
    p.add_argument("--tokenizer", default="tekken", help="tekken (default), cl100k, bytes or hf:PATH/tokenizer.json")
    p.add_argument("--no-shuffle", action="store_true", help="read the source in file order instead of the loader's shuffled epoch order")
    g = p.add_argument_group("layout and batch")
    for name, what in (("dp", "data-parallel ranks"), ("pp", "pipeline stages"), ("cp", "context-parallel ranks"), ("tp", "tensor-parallel ranks")):
        g.add_argument(f"--{name}", type=numbers.dp if name == "dp" else numbers.ranks, default=None, help=f"{what} (default {DEFAULTS[name]}; demo {DEMO[name]})")
    g.add_argument("--vpp", type=numbers.vpp, default=1, help="virtual pipeline stages per rank (with --schedule interleaved)")
    g.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"], help="pipeline schedule (default 1f1b)")
    g.add_argument("--tokens-per-step", type=numbers.tokens, default=None,
                   help="global tokens drawn per optimizer step (default dp x max-tokens x max(4, 2 pp))")
    g.add_argument("--global-batch", type=numbers.tokens, default=None,
                   help="instead of --tokens-per-step: sequences of --max-tokens tokens per step (Megatron's global batch size)")
    g.add_argument("--max-tokens", type=numbers.tokens, default=None, help=f"tokens one micro-batch may hold per DP rank (default {DEFAULTS['max_tokens']})")
    g.add_argument("--context", type=numbers.tokens, default=None, help="documents longer than this are cut into pieces (default: max-tokens)")
    g.add_argument("--model", default=None, help="model preset (llama3-8b, llama2-7b, llama3-70b, ...) or a cost profile JSON from `packloader calibrate`")
    g.add_argument("--device", default="h100", choices=["h100", "h200"], help="device of the analytic cost and memory model")
    g.add_argument("--steps", type=numbers.steps, default=None, help="optimizer steps to draw and plan (default 8)")
    g.add_argument("--seed", type=numbers.seed, default=0, help="seed of the loader's order and of the planners")
    o = p.add_argument_group("output")
    o.add_argument("--strategies", default=None,
                   help="comma-separated strategies (default: concat,fixed,multipack,karmarkar_karp,wlb,hydraulis,slimpack,auto)")
    o.add_argument("--out", default="packloader-report", help="directory for report.json, the PNGs and report.html (default packloader-report)")
    o.add_argument("--plans", action="store_true", help="also write each strategy's plans as JSON lines under OUT/plans/")
    o.add_argument("--no-plots", action="store_true", help="only report.json and the table (no PNGs, no HTML)")
    o.add_argument("--no-advice", action="store_true", help="skip the advice (cap grid and grouping simulations)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from packloader.report.lengths import LengthsError
    from packloader.sources.errors import SourceError

    try:
        return _run(args)
    except (LengthsError, SourceError, FileNotFoundError, ValueError, KeyError, ImportError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"packloader report: error: {msg}", file=sys.stderr)
        return 1


def _settings(args: argparse.Namespace) -> dict:
    base = DEMO if args.demo else DEFAULTS
    out = {k: getattr(args, k) if getattr(args, k, None) is not None else base[k]
           for k in ("dp", "pp", "cp", "tp", "max_tokens", "context", "tokens_per_step", "steps", "model")}
    for k in ("dp", "pp", "cp", "tp", "max_tokens", "steps"):
        if out[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {out[k]}")
    if out["context"] is None:
        out["context"] = out["max_tokens"]
    if args.global_batch is not None:
        if args.tokens_per_step is not None:
            raise ValueError("give --tokens-per-step or --global-batch, not both")
        if args.global_batch < 1:
            raise ValueError(f"--global-batch must be >= 1, got {args.global_batch}")
        out["tokens_per_step"] = args.global_batch * out["max_tokens"]
    if out["tokens_per_step"] is None:
        out["tokens_per_step"] = out["dp"] * out["max_tokens"] * max(4, 2 * out["pp"])
    if out["context"] < 1 or out["tokens_per_step"] < 1:
        raise ValueError("--context and --tokens-per-step must be >= 1")
    return out


def _run(args: argparse.Namespace) -> int:
    import msgspec

    from packloader.contracts import ParallelConfig, PlanConfig
    from packloader.report.build import ReportOptions, build_report
    from packloader.report.draw import StepCounter
    from packloader.report.lengths import read_lengths, source_lengths
    from packloader.sources.lengths_file import check_pieces
    from packloader.report.run import BASELINES, PACKLOADER
    from packloader.report.table import render_text

    given = [bool(args.inputs), bool(args.lengths), bool(args.demo)]
    if sum(given) != 1:
        raise ValueError("give exactly one of: INPUT paths, --lengths FILE, or --demo")
    s = _settings(args)
    try:
        config = PlanConfig(
            strategy="fixed",
            parallel=ParallelConfig(dp=s["dp"], pp=s["pp"], cp=s["cp"], tp=s["tp"], vpp=args.vpp),
            max_tokens=s["max_tokens"], context=s["context"], tokens_per_step=s["tokens_per_step"],
            schedule=args.schedule, model=s["model"], seed=args.seed,
        )
        config = msgspec.convert(msgspec.to_builtins(config), PlanConfig)  # validates every field
    except msgspec.ValidationError as e:
        raise ValueError(f"bad setting: {e}") from None
    from packloader.balancers.cost import load_cost_model

    load_cost_model(config.model, config.parallel, device=args.device)  # a bad --model fails here, before tokenizing
    strategies = tuple(x.strip() for x in args.strategies.split(",") if x.strip()) if args.strategies else BASELINES + PACKLOADER
    if not strategies:
        raise ValueError("--strategies names no strategy")
    progress = not args.no_progress
    tokenizer = None
    notes: list[str] = []
    if args.lengths:
        lengths = read_lengths(args.lengths, args.lengths_column)
        check_pieces(lengths.lengths, config.context, args.lengths)
        label = f"lengths file {args.lengths}"
    else:
        from packloader.sources.stream import DocumentStream

        if args.demo:
            from packloader.sources.directory import stdlib_corpus

            source = stdlib_corpus()
            label = "demo: the Python standard library's .py files"
        else:
            from packloader.sources.open import open_source

            source = open_source(args.inputs, column=args.column, format=args.format)
        stream = DocumentStream(source, args.tokenizer, seed=args.seed, shuffle=not args.no_shuffle)
        tokenizer = None if stream.pretokenized else args.tokenizer
        lengths = source_lengths(stream, StepCounter(config.tokens_per_step, s["steps"]), progress=progress)
        if not args.demo:
            label = lengths.origin
        skipped = getattr(source, "skipped", None)
        if skipped is not None and skipped.counts:
            notes.append(f"the source skipped {skipped.summary()}")
        label += f", {'pre-tokenized' if tokenizer is None else 'tokenized with ' + tokenizer}"
    opts = ReportOptions(
        steps=s["steps"], strategies=strategies, device=args.device, out_dir=args.out, plots=not args.no_plots,
        advice=not args.no_advice, progress=progress, plans_dir=f"{args.out}/plans" if args.plans else None,
        input=label, tokenizer=tokenizer, notes=notes,
    )
    report, _ = build_report(lengths, config, opts)
    print(render_text(report))
    if not any(f.status == "ok" for f in report.strategies):
        print("packloader report: error: no strategy could plan these steps (see the skipped lines above)", file=sys.stderr)
        return 1
    return 0
