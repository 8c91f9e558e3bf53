"""`packloader report INPUT... | --lengths FILE | --demo`: what a data set's document lengths do to a parallel
layout under today's packers and under every packloader strategy, with advice. Writes report.json, PNGs and a
self-contained report.html under --out; prints the table."""

from __future__ import annotations

import argparse
import sys

from packloader.cli import numbers
from packloader.cli.exit_codes import EXIT_BAD_INPUT
from packloader.cli.layout_options import add_layout_arguments, config_from_args
from packloader.cli.mixture_option import add_mixture_argument
from packloader.cli.plugins import add_plugin_argument, load
from packloader.contracts import PlanConfig
from packloader.sources.format_registry import format_names

# --demo: the Python standard library's .py files, tokenized with the default tokenizer, on a layout where a
# 32K-token micro-batch of Llama-3-8B fits an H100 (tp=2, pp=2), 4 DP ranks: 16 GPUs. These override the
# layout flags' defaults (the PlanConfig's, shared with `packloader plan`) for flags not given with --demo.
DEMO = dict(dp=4, pp=2, cp=1, tp=2, max_tokens=32768, context=32768, tokens_per_step=4 * 4 * 32768, model="llama3-8b")
DEMO_STEPS = 8
# The report's own derived default when --tokens-per-step is not given: dp x max-tokens x max(4, 2 pp), enough
# micro-batches per rank for a pipeline's fill and drain to show (`_config`; the help says so, not PlanConfig's).
DERIVED_TOKENS_PER_STEP = "dp x max-tokens x max(4, 2 pp)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT",
                   help="Parquet/JSONL files, a glob, an MDS directory or a directory of text files")
    p.add_argument("--demo", action="store_true",
                   help="report on the Python standard library's .py files (no download), 16 GPUs of Llama-3-8B")
    p.add_argument("--lengths", metavar="FILE", help="document lengths instead of a source: .npy, Parquet length column, or text with one per line")
    add_mixture_argument(p)
    p.add_argument("--lengths-column", default=None, help="the Parquet column of --lengths (default length, or tokens' list sizes)")
    p.add_argument("--column", default=None, help="text/tokens column or JSONL field of the input (default: auto)")
    p.add_argument("--format", default=None, choices=format_names(), help="input format (default: detected)")
    p.add_argument("--pattern", default="**/*", help="glob of the files to read in a directory; it also decides the format (default **/*)")
    p.add_argument("--tokenizer", default="tekken", help="tekken (default), cl100k, bytes or hf:PATH/tokenizer.json")
    p.add_argument("--no-shuffle", action="store_true", help="read the source in file order instead of the loader's shuffled epoch order")
    g = p.add_argument_group("layout and model (the same flags and defaults as `packloader plan` but "
                             "--tokens-per-step's; demo: " +
                             ", ".join(f"{k} {v}" for k, v in DEMO.items()) + ")")
    add_layout_arguments(g, defaults=DEMO, mode="demo", default_texts={"tokens_per_step": DERIVED_TOKENS_PER_STEP})
    g.add_argument("--global-batch", type=numbers.tokens, default=None,
                   help="instead of --tokens-per-step: sequences of --max-tokens tokens per step (Megatron's global batch size)")
    g.add_argument("--steps", type=numbers.steps, default=None, help=f"optimizer steps to draw and plan (default {DEMO_STEPS})")
    o = p.add_argument_group("output")
    o.add_argument("--strategies", default=None,
                   help="comma-separated strategies (default: every registered planner the registry shows in "
                   "reports: concat,fixed,multipack,karmarkar_karp,wlb,hydraulis,slimpack,auto and --plugin ones)")
    add_plugin_argument(p)
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
        return EXIT_BAD_INPUT


def _config(args: argparse.Namespace):
    """The PlanConfig of the flags (demo defaults under --demo); tokens per step derived when not given."""
    defaults = DEMO if args.demo else {}
    # the strategy is a placeholder, PlanConfig's own default: each strategy is run on its own, so no planner's
    # rules are the whole run's
    placeholder = PlanConfig().strategy
    config = config_from_args(args, strategy=placeholder, defaults=defaults, check=False)  # tokens per step not final
    given = "layout_tokens_per_step" in args.layout_given or (args.demo and "tokens_per_step" in defaults)
    if args.global_batch is not None:
        if "layout_tokens_per_step" in args.layout_given:
            raise ValueError("give --tokens-per-step or --global-batch, not both")
        tps = args.global_batch * config.max_tokens
    elif given:
        tps = config.tokens_per_step
    else:
        tps = config.parallel.dp * config.max_tokens * max(4, 2 * config.parallel.pp)
    return config_from_args(args, strategy=placeholder, defaults=defaults, strategy_rules=False, tokens_per_step=tps)


def _check_out(out: str) -> None:
    """--out is made (or found writable) before any data is read, so a bad one fails at once, named."""
    import os
    from pathlib import Path

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create the directory ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ValueError(f"--out {out}: the directory is not writable")


def _warn_unknown(strategies: tuple[str, ...]) -> None:
    """Say at once which --strategies names no planner has (a misspelling), with the closest known name: the
    report still runs the rest and lists those as skipped, but only after reading and planning everything."""
    import difflib

    from packloader.balancers.planners.registry import available_strategies

    known = available_strategies()
    for name in strategies:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            print(f"packloader report: warning: --strategies: no planner is named '{name}'{hint}; it will be listed as "
                  f"skipped (known: {', '.join(known)})", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from packloader.balancers.planners.registry import report_strategies
    from packloader.cli.kernel_cache import say_if_compiling
    from packloader.report.build import ReportOptions, build_report
    from packloader.report.draw import StepCounter
    from packloader.report.lengths import read_lengths, source_lengths
    from packloader.report.table import render_text
    from packloader.sources.lengths_file import check_pieces

    load(args)
    given = [bool(args.inputs), bool(args.lengths), bool(args.demo), args.mixture is not None]
    if sum(given) != 1:
        raise ValueError("give exactly one of: INPUT paths, --lengths FILE, --mixture FILE, or --demo")
    config = _config(args)
    _check_out(args.out)
    steps = args.steps or DEMO_STEPS
    device = config.device
    from packloader.balancers.cost.resolve import load_cost_model

    load_cost_model(config.model, config.parallel, device=device)  # a bad --model or --device fails here, before tokenizing
    strategies = tuple(x.strip() for x in args.strategies.split(",") if x.strip()) if args.strategies else report_strategies()
    if not strategies:
        raise ValueError("--strategies names no strategy")
    _warn_unknown(strategies)
    progress = not args.no_progress
    tokenizer = None
    notes: list[str] = []
    if not args.demo and "layout_model" not in args.layout_given:
        notes.append(f"priced as {config.model}, the default --model: for your own model pass --model with a preset "
                     "or a `packloader calibrate` profile")
    mixed = None
    if args.mixture is not None:
        mixed, lengths, tokenizer = _mixture_lengths(args, config)
        label = lengths.origin
    elif args.lengths:
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

            source = open_source(args.inputs, column=args.column, format=args.format, pattern=args.pattern)
        stream = DocumentStream(source, args.tokenizer, seed=config.seed, shuffle=not args.no_shuffle)
        tokenizer = None if stream.pretokenized else args.tokenizer
        lengths = source_lengths(stream, StepCounter(config.tokens_per_step, steps, config.context), progress=progress)
        if not args.demo:
            label = lengths.origin
        skipped = getattr(source, "skipped", None)
        if skipped is not None and skipped.counts:
            notes.append(f"the source skipped {skipped.summary()}")
        label += f", {'pre-tokenized' if tokenizer is None else 'tokenized with ' + tokenizer}"
    opts = ReportOptions(
        steps=steps, strategies=strategies, device=device, out_dir=args.out, plots=not args.no_plots,
        advice=not args.no_advice, progress=progress, plans_dir=f"{args.out}/plans" if args.plans else None,
        input=label, tokenizer=tokenizer, notes=notes,
    )
    say_if_compiling("report")
    report, _ = build_report(lengths, config, opts)
    print(render_text(report))
    if mixed is not None:
        from msgspec.structs import replace as msgspec_replace

        from packloader.cli.mixture_report import print_entries

        strategy = "auto" if "auto" in strategies else strategies[0]
        print_entries(mixed, lengths.lengths, msgspec_replace(config, strategy=strategy), steps, args.out)
    if not any(f.status == "ok" for f in report.strategies):
        print("packloader report: error: no strategy could plan these steps (see the skipped lines above)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _mixture_lengths(args: argparse.Namespace, config):
    """The mixture's stream, its blend's document lengths (ids: positions in its first epoch) and the tokenizer its
    text entries need."""
    from packloader.cli.mixture_option import mixture_stream
    from packloader.report.lengths import Lengths
    from packloader.sources.lengths_file import check_pieces

    mixed, blend_lengths = mixture_stream(args, config.seed, shuffle=not args.no_shuffle)
    check_pieces(blend_lengths, config.context, "--mixture")
    lengths = Lengths(blend_lengths, origin=f"mixture {args.mixture if isinstance(args.mixture, str) else ''}"
                      f"({', '.join(mixed.names)})")
    return mixed, lengths, None if mixed.pretokenized else args.tokenizer
