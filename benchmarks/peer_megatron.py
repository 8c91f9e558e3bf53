"""megatron-core's hybrid context parallelism on the planner benchmark's data: CP sizes, idle GPUs and padding.

    .venv/bin/python benchmarks/peer_megatron.py --write docs/megatron-hybrid-cp.md

Each step's pieces (documents cut at the context, drawn as `benchmarks/planner.py` draws them) go through megatron-core's
own `BalancedCPScheduler` (`benchmarks/peers/megatron_hybrid_cp.py`) at issue 26's layout: DP 4 x CP 4, 128K context,
`max_seqlen_per_dp_cp_rank` = 128K / 4 = 32K (megatron's suggested start: the context over the CP size), TP 8 with
sequence parallelism. Figures are megatron's alone, by its own workload estimate (length^2 / CP size): the
time comparison with packloader's planners, under packloader's cost model, is issue 26's `benchmarks/dynamic_cp.py`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
from peers.megatron_hybrid_cp import (  # benchmarks/, this folder
    megatron_hybrid_cp_window_plan,
    megatron_slots,
    megatron_wrapper,
)
from planner import Setup, draw_stream, synthetic, windows_for
from sections import write_section

DATASETS = ["synthetic-cc", "synthetic-github", "synthetic-longtail"]
SECTION = "megatron-hybrid-cp"


class Row(msgspec.Struct):
    dataset: str
    steps: int
    pieces: float  # per step
    groups: float  # megatron's groups (barrier phases) per step
    cp_share: dict[int, float]  # share of tokens run at each CP size
    widened: float  # share of tokens run at a CP size above the one their length needs (idle GPUs filled)
    idle: float  # share of GPU time waiting at group barriers, by megatron's workload estimate (step mean)
    pad_required: float  # padding its hybrid CP requires (2 x DP x CP x TP with SP), share of tokens
    pad_min: float  # padding its CP split alone needs (2 x the sample's CP size), share of tokens
    token_spread: float  # per group, the most tokens on one GPU over the mean (the linear work megatron ignores)
    outside: int  # placements on GPUs that are not one of megatron's CP groups
    ms_mean: float
    ms_max: float


def run(dataset: str, setup: Setup, cp: int, tp: int, seed: int) -> Row:
    lengths = synthetic(dataset, 200_000, seed)
    windows = windows_for(draw_stream(lengths, setup.tokens_per_step * (setup.steps + 1), seed), setup, setup.cap)
    cap = setup.cap // cp
    needed = megatron_wrapper(dp=setup.dp, cp=cp, max_tokens_per_gpu=cap).cp_balancing_scheduler.gpus_needed
    tokens = pad_req = pad_min = widened = idle = 0.0
    by_size: dict[int, float] = {}
    groups = pieces = outside = 0
    times, spreads = [], []
    for step, window in enumerate(windows):
        t0 = time.perf_counter()
        plan = megatron_hybrid_cp_window_plan(window, step=step, dp=setup.dp, cp=cp, max_tokens_per_gpu=cap,
                                              sequence_parallel_tp=tp)
        times.append(time.perf_counter() - t0)
        spreads += token_spreads(plan)
        first = {}  # (slot, doc, start) -> placement, once per piece
        for rank in plan.ranks:
            for m, mb in enumerate(rank.micro_batches):
                for s, place in zip(mb.segments, mb.cp):
                    first.setdefault((m, s.doc, s.start), (s.end - s.start, place.size))
        for n, size in first.values():
            by_size[size] = by_size.get(size, 0.0) + n
            widened += n * (size > needed(n))
        step_tokens = float(window.length.sum())
        tokens += step_tokens
        pad_req += plan.extra["pad_tokens_required"]
        pad_min += plan.extra["pad_tokens_min"]
        idle += plan.extra["megatron_idle_share"]
        groups += int(plan.extra["megatron_groups"])
        outside += int(plan.extra["placements_outside_megatron_groups"])
        pieces += len(window.length)
    n = len(windows)
    return Row(dataset, n, pieces / n, groups / n, {k: v / tokens for k, v in sorted(by_size.items())},
               widened / tokens, idle / n, pad_req / tokens, pad_min / tokens, float(np.mean(spreads)), outside,
               1e3 * float(np.mean(times)), 1e3 * float(np.max(times)))


def token_spreads(plan) -> list[float]:
    """Per megatron group: the most tokens one GPU processes (its shares of its sub-samples) over the mean."""
    out = []
    for slots in megatron_slots(plan):
        per_gpu = [sum((s.end - s.start) / c.size for m in slots
                       for s, c in zip(r.micro_batches[m].segments, r.micro_batches[m].cp)) for r in plan.ranks]
        out.append(max(per_gpu) / float(np.mean(per_gpu)))
    return out


def report(rows: list[Row], argv: list[str], setup: Setup, cp: int, tp: int) -> str:
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    sizes = sorted({k for r in rows for k in r.cp_share})
    lines = [f"Measured {when} on {platform.machine()} ({os.cpu_count()} CPUs, load {load:.1f}), megatron-core "
             f"{_megatron_version()}: DP {setup.dp} x CP {cp}, context {setup.cap}, max_seqlen_per_dp_cp_rank "
             f"{setup.cap // cp}, TP {tp} with sequence parallelism, {setup.tokens_per_step} tokens per step, "
             f"{setup.steps} steps per data set. Reproduce: `.venv/bin/python benchmarks/peer_megatron.py "
             f"{shlex.join(argv)}`.", "",
             "| data | pieces/step | groups/step | " + " | ".join(f"tokens at CP {s}" for s in sizes)
             + " | widened | idle (its estimate) | padding required | padding min | GPU tokens max/mean "
             "| outside its groups "
             "| schedule ms/step (mean, max) |",
             "| --- " * (10 + len(sizes)) + "|"]
    for r in rows:
        lines.append(f"| {r.dataset} | {r.pieces:.0f} | {r.groups:.1f} | "
                     + " | ".join(f"{100 * r.cp_share.get(s, 0.0):.1f} %" for s in sizes)
                     + f" | {100 * r.widened:.1f} % | {100 * r.idle:.1f} % | {100 * r.pad_required:.3f} % | "
                     f"{100 * r.pad_min:.4f} % | {r.token_spread:.2f} | {r.outside} | {r.ms_mean:.0f}, {r.ms_max:.0f} |")
    lines += ["", "Tokens at CP s: share of the steps' tokens megatron runs at each CP size; widened: those above the "
              "size their length needs (its way of leaving no GPU empty); idle: GPU time waiting at the barrier "
              "that ends each group, by its own L^2 / s estimate (mean over steps); padding required: every piece "
              f"to a multiple of 2 x DP x CP x TP = {2 * setup.dp * cp * tp} tokens, its stated rule, as a share of "
              "the tokens; padding min: to multiples of 2s for the pieces at CP s > 1 only; GPU tokens max/mean: "
              "per group, the most tokens one GPU holds over the mean (the linear work its estimate leaves out, "
              "mean over groups); outside its groups: placements on GPUs that form none of megatron's subgroups."]
    return "\n".join(lines)


def _megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--datasets", nargs="+", default=DATASETS)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--tokens-per-step", type=int, default=4 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", type=Path, default=None, help="replace this section of a markdown file")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    setup = Setup(f"dp{args.dp}-cp{args.cp}", args.dp, 1, args.context, args.tokens_per_step, args.steps)
    rows = []
    for ds in args.datasets:
        rows.append(run(ds, setup, args.cp, args.tp, args.seed))
        print(msgspec.json.encode(rows[-1]).decode(), file=sys.stderr)
    text = report(rows, argv, setup, args.cp, args.tp)
    print(text)
    if args.write:
        write_section(args.write, SECTION, "Measured on the planner benchmark's data", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
