"""`packloader plan`: plan the steps of a run from a file of document lengths and write them as JSON lines.

    packloader plan --lengths LENGTHS.npy --dp 8 --pp 4 --max-tokens 65536 --context 65536 \\
        --tokens-per-step 4194304 --steps 20 --strategy auto --out plan.jsonl

One line per step: {"step": s, "ranks": [[micro-batch, ...] per DP rank], "costs": ..., ...}, a micro-batch
being a list of [doc, start, end, attend_from] (doc = index in the lengths file, offsets within the document).
"actions" gives, per DP rank and pipeline rank, the [op, micro_batch, stage] lists in the order the simulator
scored (`packloader.balancers.sim.actions`; op "F" or "B", stage the model chunk). Empty documents (length 0)
are skipped, keeping the other documents' ids, and counted in the summary.
Every token of every drawn document appears exactly once (the last step flushes what was delayed); no
micro-batch holds more than --max-tokens tokens. A short score summary goes to stderr. Bad input (missing file,
wrong column, negative or non-integer lengths, invalid configuration) exits with status 2 and a message naming it.
The work is `packloader.balancers.offline`; this module only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import sys

from packloader.cli import numbers
from packloader.cli.layout_options import add_layout_arguments, config_from_args

EXIT_BAD_INPUT = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, help="document lengths: .npy (1-D integers), .parquet (see --column) "
                   "or a text file with one length per line")
    p.add_argument("--column", default="length", help="the Parquet column holding the lengths (default: length)")
    p.add_argument("--steps", type=numbers.steps, default=1, help="steps to plan (fewer if the documents run out)")
    p.add_argument("--strategy", default="auto", help="planner: auto (default), fixed, wlb, hydraulis, slimpack, ...")
    add_layout_arguments(p.add_argument_group("layout and model"))
    p.add_argument("--out", default="-", help="where to write the JSON lines (default: stdout)")
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")


def _fail(msg: str) -> int:
    print(f"packloader plan: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def build_config(args: argparse.Namespace):
    """The PlanConfig from the arguments; msgspec validates it and names the offending flag."""
    return config_from_args(args, strategy=args.strategy)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from packloader.balancers.offline import plan_record, plan_run
    from packloader.balancers.planners.packing import cost_model_for
    from packloader.balancers.planners.registry import make_planner
    from packloader.balancers.sim.actions import step_actions
    from packloader.balancers.sim.metrics import drawn_steps, score_plans
    from packloader.sources.lengths_file import LengthsError, check_pieces, read_lengths

    try:
        config = build_config(args)
    except ValueError as e:
        return _fail(str(e))
    if not config.allow_slicing and config.context > config.max_tokens:
        return _fail(f"--context {config.context} exceeds --max-tokens {config.max_tokens} with --no-slicing: a piece "
                     f"that long fits no micro-batch; lower --context or allow slicing")
    try:
        model = cost_model_for(config)
    except (ValueError, FileNotFoundError, KeyError) as e:
        return _fail(f"--model {config.model!r}: {e}")
    try:
        # document ids are positions in the file: empty documents stay in place (skipped when drawn) and counted
        read = read_lengths(args.lengths, args.column, empty="keep", column_flag="--column")
        lengths = read.lengths
        check_pieces(lengths, config.context, args.lengths)
    except LengthsError as e:
        return _fail(str(e))
    try:
        planner = make_planner(config)
        result = plan_run(lengths, config, args.steps, planner)
    except ValueError as e:  # e.g. a piece over the cap for a strategy that cannot slice
        return _fail(f"strategy {config.strategy!r}: {e}")

    enc = msgspec.json.Encoder()
    try:
        out = sys.stdout.buffer if args.out == "-" else open(args.out, "wb")
    except OSError as e:
        return _fail(f"--out {args.out}: cannot write ({e.strerror})")
    try:
        for plan in result.plans:
            actions = step_actions(plan, model, config.parallel, schedule=config.schedule)
            out.write(enc.encode(plan_record(plan, actions)) + b"\n")
    finally:
        if out is not sys.stdout.buffer:
            out.close()
        else:
            out.flush()
    if not args.quiet:
        _, run_scores = score_plans(
            result.plans, model, config.parallel, max_tokens=config.max_tokens, schedule=config.schedule,
            drawn=drawn_steps(result.windows), pieces=result.windows, final_state=result.final_state,
        )
        s = run_scores
        docs = sum(len(set(w.doc.tolist())) for w in result.windows)
        print(
            f"packloader plan: {s.steps} steps, {docs} documents, {s.tokens} tokens, strategy {config.strategy}; "
            f"imbalance {s.imbalance_mean:.3f} (max {s.imbalance_max:.3f}), DP spread {s.dp_spread_mean:.4f}, "
            f"simulated efficiency {s.efficiency:.3f} against the no-bubble ideal ({s.efficiency_fill:.3f} fill-credited), packing {s.packing_efficiency:.3f}, "
            f"delay mean {s.delay_mean:.3f} / max {s.delay_max} steps (share {s.delay_share:.3f}), split {s.split_share:.3f}, "
            f"dropped {s.tokens_dropped}, duplicated {s.tokens_duplicated}",
            file=sys.stderr,
        )
        if read.empty:
            print(f"packloader plan: {args.lengths} holds {read.empty} empty documents (length 0), skipped", file=sys.stderr)
        dropped = getattr(planner, "memory_summary", lambda: "")()
        if dropped:
            print(f"packloader plan: {dropped}", file=sys.stderr)
    return 0
