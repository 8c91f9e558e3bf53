"""`packloader plan`: plan the steps of a run from a file of document lengths and write them as JSON lines.

The work is `packloader.balancers.offline`; this module only parses arguments and prints. The output format
is the command's `--help` epilog (FORMAT below), also in docs/plan.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from packloader.cli import numbers
from packloader.cli.exit_codes import EXIT_BAD_INPUT
from packloader.cli.exit_codes import EXIT_DOES_NOT_FIT as EXIT_MEMORY  # --require-fit and a step that does not fit
from packloader.cli.layout_options import add_layout_arguments, config_from_args
from packloader.cli.mixture_option import add_mixture_argument
from packloader.cli.plugins import add_plugin_argument, load

FORMAT = """example:
  packloader plan --lengths LENGTHS.npy --dp 8 --pp 4 --tp 4 --max-tokens 65536 --context 65536 \\
      --tokens-per-step 4194304 --strategy auto --out plan.jsonl

output: one JSON line per step (the whole file by default; --steps N for the first N):
  {"step": s,
   "ranks": [[micro-batch, ...] per DP rank], a micro-batch being a list of [doc, start, end, attend_from]
            (doc = the document's index in the lengths file; start, end: token offsets within it; attend_from <
            start marks a slice that attends to its document's earlier tokens),
   "costs": [[[fwd, bwd] seconds per micro-batch] per DP rank], predicted by the cost model (--model; 0 under
            --strategy fixed, which packs by token counts alone: the summary prices its plans all the same),
   "memory_over": the simulated peak memory of one GPU over the device's usable memory (> 1) when no
            candidate plan fits, else 0 (auto checks memory; the other strategies write 0),
   "actions": [per DP rank: [per pipeline rank: [[op, micro_batch, stage], ...]]] in the order the simulator
            scored (op "F", "B", or "W" for weight gradients under --schedule zb-h1 and zb-v; stage the
            model chunk in model order, 0..pp*vpp-1: pipeline rank s holds s, s + pp, ..., or s and 2*pp-1-s
            under zb-v; packloader.balancers.sim.actions),
   and, when present: "dp_groups" [[rank, position, [ranks]]] (micro-batches run by several DP ranks
   together), "backward_order" (per rank), "delayed" (documents held back for a later step), "schedule" (the
   one --schedule auto chose for the step: "1f1b", "zb-h1", "interleaved", ...);
   with --cp-mode dynamic (or auto, on the steps it plans so): "cp_mode": "dynamic", "ranks" and "costs" per GPU
   of the DP x CP pool (index dp_rank x cp + cp_rank), and "cp": [[[size, first] per segment] per micro-batch]
   per GPU, each segment run by GPUs first .. first + size - 1 (size a power of two, first a multiple of it),
   listed in the same micro-batch of each}

Every token of every drawn document appears exactly once (the last step flushes what was delayed); no
micro-batch holds more than --max-tokens tokens. Empty documents (length 0) are skipped, keeping the other
documents' ids, and counted in the summary. A short score summary goes to stderr (--quiet: none).

bad input (exit status 2): a missing file, a wrong column, negative or non-integer lengths, an invalid
configuration; with --require-fit a step that does not fit in memory exits 3."""


# `plan` reads lengths; a corpus goes through `tokenize` first (or straight to `report`), said in --help and errors
CORPUS_HINT = ("`packloader tokenize CORPUS --out DIR` turns a corpus (Parquet, JSONL, MDS, a directory of text) into "
               "Parquet token shards whose `length` column --lengths reads, one shard at a time "
               "(--lengths DIR/<shard>.parquet); `packloader report CORPUS` reads a corpus itself")


DEFAULT_MODEL_NOTE = " (the default --model: --model PRESET or a `packloader calibrate` profile prices your own)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("corpus", nargs="*", metavar="CORPUS", help="not read here: a corpus goes through "
                   "`packloader tokenize` first (see --lengths)")
    p.add_argument("--lengths", default=None, help="document lengths: .npy (1-D integers), .parquet (see --column) "
                   "or a text file with one length per line (or --mixture). " + CORPUS_HINT)
    add_mixture_argument(p)
    p.add_argument("--tokenizer", default="tekken", help="with --mixture: the tokenizer of entries that name none "
                   "(tekken default, cl100k, bytes or hf:PATH/tokenizer.json)")
    p.add_argument("--column", default="length", help="the Parquet column holding the lengths (default: length)")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = FORMAT
    p.add_argument("--steps", type=numbers.steps, default=None,
                   help="plan only the first N steps (default: every step of the file)")
    p.add_argument("--strategy", default="auto", help="planner: auto (default), fixed, wlb, hydraulis, slimpack, ...")
    add_plugin_argument(p)
    add_layout_arguments(p.add_argument_group("layout and model"))
    p.add_argument("--out", default="-", help="where to write the JSON lines (default: stdout)")
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")
    p.add_argument("--require-fit", action="store_true", help="exit with status 3 when a step does not fit in "
                   "memory (its memory_over > 0); without it such steps are written and warned about")


def _fail(msg: str) -> int:
    print(f"packloader plan: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def build_config(args: argparse.Namespace):
    """The PlanConfig from the arguments, validated as the library validates it; a refusal names the flags."""
    return config_from_args(args, strategy=args.strategy)


def _write_plans(args: argparse.Namespace, plans, model, config) -> int:
    """Each plan with its pipeline action lists as a JSON line on --out; 0, or the exit status of a failure."""
    import msgspec

    from packloader.balancers.offline import plan_record
    from packloader.balancers.sim.actions import step_actions

    enc = msgspec.json.Encoder()
    try:
        out = sys.stdout.buffer if args.out == "-" else open(args.out, "wb")
    except OSError as e:
        return _fail(f"--out {args.out}: cannot write ({e.strerror})")
    try:
        for plan in plans:
            actions = step_actions(plan, model, config.parallel, schedule=config.schedule)
            out.write(enc.encode(plan_record(plan, actions)) + b"\n")
    finally:
        if out is not sys.stdout.buffer:
            out.close()
        else:
            out.flush()
    return 0


def _entry_shares(stream, windows) -> str:
    """Each mixture entry's share of the planned tokens against its target."""
    import numpy as np

    from packloader.cli.mixture_option import target_shares

    docs = np.concatenate([w.doc for w in windows])
    tokens = np.concatenate([w.length for w in windows])
    entries = stream.entry_of(stream.doc_ids(0, docs))
    per = np.bincount(entries, weights=tokens, minlength=len(stream.names))
    share = per / max(1.0, per.sum())
    listed = ", ".join(f"{n} {s:.3f} (target {t:.3f})" for n, s, t in zip(stream.names, share, target_shares(stream)))
    return f"mixture token shares: {listed}"


def run(args: argparse.Namespace) -> int:
    from packloader.balancers.cost.lookup import cost_model_for
    from packloader.balancers.factory import make_planner
    from packloader.balancers.offline import plan_run
    from packloader.balancers.sim.metrics import drawn_steps, score_plans
    from packloader.cli.kernel_cache import COMMON, KERNELS, say_if_compiling

    if args.corpus or (not args.lengths and args.mixture is None):
        given = f"got {' '.join(args.corpus)!r} and " if args.corpus else ""
        return _fail(f"{given}{'--lengths ' + args.lengths if args.lengths else 'no --lengths'}: plan reads a file of "
                     f"document lengths (--lengths FILE), not a corpus. {CORPUS_HINT}")
    try:
        load(args)
        config = build_config(args)
    except ValueError as e:
        return _fail(str(e))
    model = cost_model_for(config)  # loaded by the validation already (`validate_config`)
    if (args.lengths is None) == (args.mixture is None):
        return _fail("give --lengths FILE or --mixture FILE (one of them)")
    read = _read_lengths(args, config)
    if isinstance(read, int):
        return read
    lengths, empty, stream = read
    say_if_compiling("plan", KERNELS if config.strategy == "auto" else COMMON)
    try:
        planner = make_planner(config)
        result = plan_run(lengths, config, args.steps, planner)
    except ValueError as e:  # e.g. a piece over the cap for a strategy that cannot slice
        return _fail(f"strategy {config.strategy!r}: {e}")

    failed = _write_plans(args, result.plans, model, config)
    if failed:
        return failed
    if not args.quiet:
        _, run_scores = score_plans(
            result.plans, model, config.parallel, max_tokens=config.max_tokens, schedule=config.schedule,
            drawn=drawn_steps(result.windows), pieces=result.windows, final_state=result.final_state,
        )
        s = run_scores
        # each document once, though its pieces may run in several steps' windows
        docs = len(set().union(*(w.doc.tolist() for w in result.windows)))
        print(
            f"packloader plan: {s.steps} steps, {docs} documents, {s.tokens} tokens, strategy {config.strategy}, "
            f"priced by {model.name}{DEFAULT_MODEL_NOTE if 'layout_model' not in args.layout_given else ''}; "
            f"imbalance {s.imbalance_mean:.3f} (max {s.imbalance_max:.3f}), DP spread {s.dp_spread_mean:.4f}, "
            f"simulated efficiency {s.efficiency:.3f} against the no-bubble ideal, packing {s.packing_efficiency:.3f}, "
            f"delay mean {s.delay_mean:.3f} / max {s.delay_max} steps (share {s.delay_share:.3f}), split {s.split_share:.3f}, "
            f"dropped {s.tokens_dropped}, duplicated {s.tokens_duplicated}",
            file=sys.stderr,
        )
        if empty:
            print(f"packloader plan: {args.lengths or args.mixture} holds {empty} empty documents (length 0), skipped",
                  file=sys.stderr)
        if stream is not None:
            print(f"packloader plan: {_entry_shares(stream, result.windows)}", file=sys.stderr)
        dropped = getattr(planner, "memory_summary", lambda: "")()
        if dropped:
            print(f"packloader plan: {dropped}", file=sys.stderr)
    over = [p.memory_over for p in result.plans if p.memory_over > 0]
    if over:
        print(f"packloader plan: {len(over)} of {len(result.plans)} steps do not fit in memory (peak up to "
              f"{max(over):.2f}x the device's usable memory; the warning above says what to change)", file=sys.stderr)
        if args.require_fit:
            return EXIT_MEMORY
    return 0


def _read_lengths(args: argparse.Namespace, config) -> tuple | int:
    """(lengths, empty documents, the mixture's stream or None) from --lengths or --mixture, or the exit code of a
    refusal (printed)."""
    from packloader.sources.lengths_file import LengthsError, check_pieces, read_lengths

    stream = None
    try:
        if args.mixture is not None:  # document ids are positions in the blend's first epoch
            from packloader.cli.mixture_option import mixture_stream

            stream, lengths = mixture_stream(args, config.seed)
            empty = int((lengths == 0).sum())
            check_pieces(lengths, config.context, "--mixture")
        else:
            # document ids are positions in the file: empty documents stay in place (skipped when drawn), counted
            read = read_lengths(args.lengths, args.column, empty="keep", column_flag="--column")
            lengths, empty = read.lengths, read.empty
            check_pieces(lengths, config.context, args.lengths)
    except LengthsError as e:
        if args.lengths is None:
            return _fail(str(e))
        corpus = Path(args.lengths).suffix.lower() not in (".npy", ".parquet", ".pq", ".txt", "")
        return _fail(f"{e}" + (f". Is it a corpus? {CORPUS_HINT}" if corpus or os.path.isdir(args.lengths) else ""))
    except (OSError, ValueError) as e:  # ValueError: a mixture refused, naming the entry
        return _fail(str(e))
    return lengths, empty, stream
