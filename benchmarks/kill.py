"""Exactly once under SIGKILL, at random points: how many tokens a killed and resumed loader loses or repeats.

    .venv/bin/python benchmarks/kill.py --points 1000 --write docs/benchmarks.md
    .venv/bin/python benchmarks/kill.py --corpus giant --points 60 --write docs/benchmarks.md

(`--corpus giant`: six layouts over token shards holding two documents of 1,000 x tokens_per_step each, so that
steps end inside documents and kills land there; its own section of the file.)

The harness is tests/helpers/kill_harness.py (its docstring says exactly what a child does and what is compared). For
every configuration of the matrix (Parquet token shards / gzipped JSON Lines text; `auto` / `wlb`; slicing on /
off; one rank, two ranks in one process, two gloo ranks; PackedLoader / StatefulDataLoader with two workers),
on its own long-tail corpus:

- one uninterrupted epoch (the reference, itself checked against the source: tokens, exactly-once), and a second
  one (must be identical; its wall time bounds the random kill delays);
- kill runs of `--kills-per-run` random kill points each: rounds drawn uniformly over the epoch, the last one
  included, each killed after logging, mid-save or after saving, or (a `--timer-share` of them) by the parent
  after a random delay (start-up, mid-write, mid-save); the child saves every k-th round (k random, 1..6) and, in
  half of the runs, at the last round;
- one edge run: killed right after saving at the round before the last, then right after saving at the last
  round (the state a trainer saves when the epoch's last micro-batch is done).

The `--points` kill points are shared evenly between the configurations (the edge runs' two points count). A
token is lost when no rank trained it, repeated when trained more than once (an extra epoch's tokens count as
repeated); every micro-batch is also compared with the source's tokens and, in order, with the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers import kill_harness as kh  # noqa: E402
from sections import write_section  # noqa: E402  (benchmarks/, the script's own folder)

SECTIONS = {"small": ("kill", "Exactly once under SIGKILL"),
            "giant": ("kill-giant", "Exactly once under SIGKILL, with documents of 1,000 steps")}
CORPORA = {
    "small": "Corpora: 240 token documents in 4 Parquet shards, or 200 text documents in 3 gzipped JSON Lines "
             "shards (bytes tokenizer), long-tail lengths; max_tokens 512, context 512 (1024 for `auto` with "
             "slicing), 2048 tokens per step per rank (768 with workers, whose items are whole steps).",
    "giant": f"Corpus: 60 long-tail token documents and two of {kh.GIANT_FACTOR:,} x tokens_per_step (+37 and +101 "
             f"tokens) in 3 Parquet shards; tokens_per_step {kh.GIANT_TOKENS_PER_STEP} (all ranks), max_tokens 64, "
             "context 64 (128 for `auto` with slicing): each giant document spreads over about 1,000 steps, and "
             "kills land inside them.",
}


def giant_matrix() -> list[kh.KillConfig]:
    """The corpus with two documents of 1,000 steps' tokens each: a subset of the layouts (each epoch is thousands
    of rounds)."""
    return [kh.KillConfig(source="giant", **kw) for kw in (
        dict(strategy="auto"), dict(strategy="auto", slicing=True, dp=2),
        dict(strategy="auto", slicing=True, dp=2, ranks="gloo"), dict(strategy="wlb", dp=2, ranks="gloo"),
        dict(strategy="wlb", workers=2), dict(strategy="auto", dp=2, workers=2))]


def matrix() -> list[kh.KillConfig]:
    out = []
    for source, strategy, slicing, (dp, ranks), workers in itertools.product(
            ("parquet", "jsonl.gz"), ("auto", "wlb"), (False, True), ((1, "local"), (2, "local"), (2, "gloo")), (0, 2)):
        out.append(kh.KillConfig(source=source, strategy=strategy, slicing=slicing, dp=dp, ranks=ranks, workers=workers))
    return out


def run_one(cfg: kh.KillConfig, wd: Path, points: int, per_run: int, rng: random.Random, timer_share: float) -> dict:
    start = time.monotonic()
    paths, docs = kh.write_corpus(cfg.source, wd / "corpus", seed=cfg.seed)
    h = kh.Harness(cfg, paths, docs, wd)
    h.run_reference()
    same = h.run_again()
    R = h.rounds
    runs = [h.run_kills([{"at": R - 1, "phase": "saved"}, {"at": R, "phase": "saved"}], [R - 1, R])]
    made = runs[0].kills
    for _ in range(4 * points):  # a timer that comes after the child finished makes no kill: run again
        if made >= points:
            break
        k = min(per_run, points - made)
        r = h.run_kills(kh.random_kills(rng, R, k, h.reference_seconds, timer_share), kh.random_saves(rng, R))
        runs.append(r)
        made += r.kills
    last = [r for r in runs if any(c.resume == R for c in r.children)]
    other = [r for r in runs if r not in last]
    row = {
        "config": cfg.name, "rounds": R, "records": len(h.reference), "tokens": runs[0].tokens,
        "uninterrupted_runs_equal": same, "kills": sum(r.kills for r in runs), "runs": len(runs),
        "by_phase": {p: sum(r.kinds.get(p, 0) for r in runs) for p in (*kh.PHASES, "timer")},
        "lost": sum(r.lost for r in runs), "repeated": sum(r.repeated for r in runs),
        "extra_epoch_tokens": sum(r.extra_epoch_tokens for r in runs),
        "token_errors": sum(r.token_errors for r in runs), "order_errors": sum(r.order_errors for r in runs),
        "problems": [p for r in runs for p in r.problems],
        "last_round_resumes": len(last),
        "failed_runs": sum(not r.ok for r in runs),
        "failed_runs_not_last_round": sum(not r.ok for r in other),
        "lost_not_last_round": sum(r.lost for r in other), "repeated_not_last_round": sum(r.repeated for r in other),
        "seconds": time.monotonic() - start,
        "child_seconds_mean": (sum(c.seconds for r in runs for c in r.children)
                               / max(1, sum(len(r.children) for r in runs))),
        "failures": [dataclasses.asdict(r) | {"children": [dataclasses.asdict(c) for c in r.children]}
                     for r in runs if not r.ok][:3],
    }
    return row


def table(rows: list[dict]) -> str:
    lines = ["| configuration | rounds | kill points | lost | repeated (extra epoch) | token / order errors "
             "| runs failed | of them not resuming at the last round |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['rounds']} | {r['kills']} | {r['lost']:,} | {r['repeated']:,} "
                     f"({r['extra_epoch_tokens']:,}) | {r['token_errors']} / {r['order_errors']} "
                     f"| {r['failed_runs']} / {r['runs']} | {r['failed_runs_not_last_round']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", type=int, default=1000, help="kill points in all, shared between the configurations")
    p.add_argument("--kills-per-run", type=int, default=5)
    p.add_argument("--timer-share", type=float, default=0.2, help="share of kills made by the parent after a delay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help="run only configurations whose name contains this")
    p.add_argument("--corpus", choices=("small", "giant"), default="small",
                   help="small: the long-tail corpora (section 'kill'); giant: token shards with two documents of "
                        "1,000 steps' tokens each (section 'kill-giant')")
    p.add_argument("--workdir", default=None, help="keep the logs and states here (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the per-configuration rows here")
    p.add_argument("--write", default=None, help="markdown file whose kill section gets the results")
    args = p.parse_args(argv)

    configs = [c for c in (matrix() if args.corpus == "small" else giant_matrix())
               if args.only is None or args.only in c.name]
    kh.prepare_parent()
    tmp = tempfile.TemporaryDirectory(prefix="packloader-kill-") if args.workdir is None else None
    base = Path(args.workdir or tmp.name)
    rng = random.Random(args.seed)
    share = [args.points // len(configs) + (1 if i < args.points % len(configs) else 0) for i in range(len(configs))]
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    rows, errors = [], []
    for i, (cfg, pts) in enumerate(zip(configs, share)):
        try:
            row = run_one(cfg, base / f"config-{i:03d}", pts, args.kills_per_run, rng, args.timer_share)
        except Exception as e:  # noqa: BLE001 - a child that failed is a finding: record it, go on
            errors.append(f"{cfg.name}: {type(e).__name__}: {str(e)[-2000:]}")
            print(errors[-1], flush=True)
            continue
        rows.append(row)
        print(f"{cfg.name}: {row['kills']} kills, lost {row['lost']}, repeated {row['repeated']} "
              f"(extra epoch {row['extra_epoch_tokens']}), token/order errors {row['token_errors']}/{row['order_errors']}, "
              f"failed runs {row['failed_runs']}/{row['runs']} ({row['failed_runs_not_last_round']} not resuming at "
              f"the last round), {row['seconds']:.0f} s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    elapsed = time.monotonic() - t0
    kills = sum(r["kills"] for r in rows)
    lost, repeated = sum(r["lost"] for r in rows), sum(r["repeated"] for r in rows)
    lost_o, rep_o = sum(r["lost_not_last_round"] for r in rows), sum(r["repeated_not_last_round"] for r in rows)
    last_runs = sum(r["last_round_resumes"] for r in rows)
    last_failed = sum(r["failed_runs"] - r["failed_runs_not_last_round"] for r in rows)
    by_kind = []
    for kind, suffix in (("PackedLoader", "workers0"), ("StatefulDataLoader with workers", "workers2")):
        rs = [r for r in rows if r["config"].endswith(suffix)]
        by_kind.append(f"{kind} {sum(r['failed_runs'] - r['failed_runs_not_last_round'] for r in rs)} of "
                       f"{sum(r['last_round_resumes'] for r in rs)}")
    phases = {ph: sum(r["by_phase"][ph] for r in rows) for ph in (*kh.PHASES, "timer")}
    unequal = [r["config"] for r in rows if not r["uninterrupted_runs_equal"]]
    summary = [
        f"{kills} kill points in {len(rows)} configurations: {lost:,} tokens lost, {repeated:,} repeated.",
        f"Runs that never resumed from a state saved after the epoch's last micro-batch: {lost_o:,} lost, "
        f"{rep_o:,} repeated.",
        f"Runs that resumed from a state saved after the last micro-batch: {last_runs}, of which {last_failed} "
        f"trained tokens again ({', '.join(by_kind)}).",
        f"Kills by phase: after logging {phases['log']}, between writing and renaming the state {phases['save']}, "
        f"after saving {phases['saved']}, by the parent after a random delay {phases['timer']}.",
        f"Uninterrupted runs that differed from the first: {', '.join(unequal) if unequal else 'none'}.",
        f"{elapsed:.0f} s in all, {elapsed / max(1, kills):.2f} s per kill point.",
        *[f"Configuration not completed (a child failed): {e.splitlines()[0]}" for e in errors],
    ]
    for line in summary:
        print(line)
    if args.write:
        cmd = ".venv/bin/python benchmarks/kill.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        body = "\n".join([
            "A loader process killed with SIGKILL at random points and resumed in a new process from its last "
            "saved state, compared token by token with one uninterrupted epoch and with the source (harness: "
            "`tests/helpers/kill_harness.py`; what each run does: the docstring of `benchmarks/kill.py`; CI runs a fixed "
            "subset in `tests/test_loader_kill.py`).",
            "",
            "```bash",
            cmd,
            "```",
            "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()} with {cpus} CPUs "
            f"(load average {load0:.1f} at the start; shared). {CORPORA[args.corpus]} A round is one item from "
            "every rank: a micro-batch, or a step with workers.",
            "",
            *[f"- {line}" for line in summary],
            "",
            table(rows),
            "",
        ])
        section, heading = SECTIONS[args.corpus]
        write_section(Path(args.write), section, heading, body)
        print(f"wrote the {section} section of {args.write}")
    if tmp is not None:
        tmp.cleanup()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
