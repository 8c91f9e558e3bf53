"""How much slower CP shards (or CP links) must be for per-document CP to reach issue 26's 1.15x the best fixed-CP
plan: `benchmarks/dynamic_cp.py`'s fixed-CP, per-document CP and cp_mode "auto" rows over a grid of what-if devices.

    .venv/bin/python benchmarks/dynamic_cp_breakeven.py --write docs/benchmarks.md
    .venv/bin/python benchmarks/dynamic_cp_breakeven.py --factors 1,1.2 --link-scales 1 --steps 2   # smoke run

Each grid point is the h100 device file with every CP shard (sizes 2-16) priced `factor` x 1/s of its document's
attention (`Device.cp_shard`: fixed CP's profile and per-document CP's shares alike) and its CP link bandwidths
divided by `link scale` (`Device.cp_link`). synthetic-longtail (`--dataset`), DP 4 x CP 4 at TP 8, 128K context,
as `dynamic_cp.py` runs it, at 4M tokens a step (`--steps`, default 8) and 512K (`--small-steps`, default 16).
The baseline is the fastest fixed-CP plan (CP 4, 2 or 1) that fits the device's memory at that point; the
crossing is where the ratio reaches 1.15, interpolated linearly between the grid's factors.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import shlex
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import dynamic_cp as bench  # benchmarks/, the script's own folder
import msgspec
from planner import synthetic
from sections import write_section

TARGET = 1.15


class Point(msgspec.Struct):
    tokens_per_step: int
    factor: float
    link_scale: float
    best_fixed: str
    fixed_rate: float
    dynamic_rate: float
    auto_rate: float

    @property
    def dynamic(self) -> float:
        return self.dynamic_rate / self.fixed_rate

    @property
    def auto(self) -> float:
        return self.auto_rate / self.fixed_rate


def run_point(lengths, tokens_per_step: int, steps: int, factor: float, scale: float, folder: Path) -> Point:
    args = Namespace(steps=steps, tokens_per_step=tokens_per_step, model="llama3-8b", tp=8, cost="measured")
    args.device = bench.what_if_device(factor, scale, folder)
    fixed = [bench.run_fixed(lengths, dp, cp, args) for dp, cp in bench.FIXED_LAYOUTS]
    fits = [r for r in fixed if not r.note] or fixed
    best = max(fits, key=lambda r: r.rate)
    dyn, auto = bench.run_dynamic(lengths, args), bench.run_auto(lengths, args)
    return Point(tokens_per_step, factor, scale, best.name.split(" (")[0], best.rate, dyn.rate, auto.rate)


def crossing(points: list[Point], ratio: str) -> str:
    """The factor where `ratio` ("dynamic" or "auto") reaches TARGET among points of one link scale and step size
    (sorted by factor), interpolated linearly; a bound when the grid does not bracket it."""
    pts = sorted(points, key=lambda p: p.factor)
    vals = [getattr(p, ratio) for p in pts]
    if vals[0] >= TARGET:
        return f"<= {pts[0].factor:.2f} (already {vals[0]:.3f}x)"
    for (p0, v0), (p1, v1) in zip(zip(pts, vals), zip(pts[1:], vals[1:])):
        if v1 >= TARGET > v0:
            return f"{p0.factor + (TARGET - v0) / (v1 - v0) * (p1.factor - p0.factor):.3f}"
    return f"> {pts[-1].factor:.2f} ({vals[-1]:.3f}x there)"


def tables(points: list[Point]) -> str:
    lines = ["| tokens a step | shard factor | link bandwidth / | best fixed plan | its tokens/s | per-document CP | "
             "vs best fixed | cp_mode auto | vs best fixed |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for p in points:
        mark = lambda r: f"**{r:.3f}x**" if r >= TARGET else f"{r:.3f}x"  # noqa: E731
        lines.append(f"| {p.tokens_per_step:,} | {p.factor:g} | {p.link_scale:g} | {p.best_fixed} | {p.fixed_rate:,.0f} | "
                     f"{p.dynamic_rate:,.0f} | {mark(p.dynamic)} | {p.auto_rate:,.0f} | {mark(p.auto)} |")
    lines += ["", f"Shard factor at which the ratio reaches {TARGET}x (linear between the grid's factors):", "",
              "| tokens a step | link bandwidth / | per-document CP | cp_mode auto |", "| ---: | ---: | --- | --- |"]
    for tps in sorted({p.tokens_per_step for p in points}, reverse=True):
        for scale in sorted({p.link_scale for p in points}):
            pts = [p for p in points if p.tokens_per_step == tps and p.link_scale == scale]
            lines.append(f"| {tps:,} | {scale:g} | {crossing(pts, 'dynamic')} | {crossing(pts, 'auto')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--factors", default="1,1.05,1.1,1.15,1.2,1.3", help="CP-shard factors (comma-separated, >= 1)")
    p.add_argument("--link-scales", default="1,2,4", help="CP link bandwidth divisors (comma-separated, >= 1)")
    p.add_argument("--steps", type=int, default=8, help="steps at 4M tokens a step")
    p.add_argument("--small-steps", type=int, default=16, help="steps at 512K tokens a step (0: leave them out)")
    p.add_argument("--docs", type=int, default=40000)
    p.add_argument("--dataset", default="synthetic-longtail", choices=bench.DATASETS)
    p.add_argument("--write", type=Path, default=None, help="write the tables into this docs/benchmarks.md")
    p.add_argument("--section", default="dynamic_cp_breakeven")
    args = p.parse_args(argv)
    factors = [float(x) for x in args.factors.split(",")]
    scales = [float(x) for x in args.link_scales.split(",")]
    if min(factors + scales) < 1.0:
        p.error("--factors and --link-scales must be >= 1")
    lengths = synthetic(args.dataset, args.docs, seed=26)
    lengths = lengths[lengths > 0]
    folder = Path(tempfile.mkdtemp(prefix="dynamic-cp-breakeven-"))
    runs = [(4 << 20, args.steps)] + ([(1 << 19, args.small_steps)] if args.small_steps else [])
    points = []
    for tps, steps in runs:
        for scale in scales:
            for f in factors:
                points.append(run_point(lengths, tps, steps, f, scale, folder))
                pt = points[-1]
                print(f"{tps:>8} x{f:<5g} link/{scale:<3g} {pt.best_fixed:<12} per-document {pt.dynamic:.3f}x  auto "
                      f"{pt.auto:.3f}x", flush=True)
    text = tables(points)
    print(text)
    if args.write:
        cmd = "python benchmarks/dynamic_cp_breakeven.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        body = (f"Command: `{cmd.strip()}` ({_dt.date.today()}, {platform.machine()}, Python "
                f"{platform.python_version()}; simulated times, so the machine does not change them).\n\n"
                f"{args.dataset}, {args.docs:,} documents; {args.steps} steps of 4,194,304 tokens"
                + (f" and {args.small_steps} of 524,288" if args.small_steps else "")
                + "; DP 4 x CP 4, TP 8, llama3-8b, measured H100 profile, context 131,072.\n\n" + text)
        write_section(args.write, args.section, "Per-document CP: how slow CP shards or links must be for 1.15x", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
