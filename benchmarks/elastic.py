"""Elastic resume at random layout changes: how many tokens a run loses or repeats when its layout changes mid-step.

    .venv/bin/python benchmarks/elastic.py --runs 40 --worker-runs 4 --write docs/benchmarks.md

Each run trains one epoch over three to five layouts in turn. A layout is a DP degree (1, 2, 3, 4 or 8), a planner
(`wlb`, which queues outliers for later steps; `auto` with slicing, context twice max_tokens; `fixed`, half the
time with a pinned micro-batch count) and tokens_per_step; each layout's ranks run in one process (explicit
`dp_rank`) and stop inside a random step, each rank at a random micro-batch of it (or after its last), as ranks
of a real job stand when it is stopped. The next layout loads `merge_states` of every rank's state. Every
micro-batch's tokens are compared with the source's; a token is lost when no rank of any layout trained it,
repeated when trained more than once. The corpus: 300 long-tail documents and one of 40 steps' tokens, bytes
tokenizer.

With `--worker-runs N`, N more runs do the same through `PackedDataset` under torchdata's StatefulDataLoader:
each phase a DP degree (1 or 2: one DataLoader per rank), a number of DataLoader workers (0 to 3, spawned), a
planner and tokens_per_step; every rank takes the same random number of steps (a worker yields whole steps), and
the next phase loads `dataloader_state_for` of every rank's DataLoader state for its own worker count. The
corpus: 150 long-tail documents and one of 8 steps' tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sections import write_section  # noqa: E402  (benchmarks/, the script's own folder)

from packloader import PackedDataset, PackedLoader, ParallelConfig, PlanConfig, dataloader_state_for, merge_states  # noqa: E402
from packloader.sources.base import IterableSource  # noqa: E402

SECTION = "elastic"
CONTEXT = 256


def corpus(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.1, 300) * 60 + 1, 3000).astype(np.int64)
    docs = [rng.integers(0, 256, size=int(k)).astype(np.int32) for k in lengths]
    docs.insert(int(rng.integers(0, 300)), rng.integers(0, 256, size=40 * 1024 + 77).astype(np.int32))
    return docs


def layout(rng: random.Random) -> PlanConfig:
    dp = rng.choice([1, 2, 3, 4, 8])
    strategy = rng.choice(["wlb", "auto", "fixed"])
    cap = 128 if strategy == "auto" else CONTEXT
    tps = rng.choice([512, 1024, 2048])
    tps = max(tps, cap * dp)
    # pinned micro-batch counts (fixed planner) leave room for any layout's step: 2048 + context tokens, + 1 slack
    pinned = strategy == "fixed" and rng.random() < 0.5
    m = -(-(2048 + CONTEXT - 1) // (dp * cap)) + 1 if pinned else None
    return PlanConfig(strategy=strategy, max_tokens=cap, context=CONTEXT, tokens_per_step=tps,
                      allow_slicing=strategy == "auto", num_micro_batches=m, parallel=ParallelConfig(dp=dp))


def name(cfg: PlanConfig) -> str:
    m = f" m{cfg.num_micro_batches}" if cfg.num_micro_batches else ""
    return f"dp{cfg.parallel.dp} {cfg.strategy}{m} tps{cfg.tokens_per_step}"


def run_layout(docs, cfg, state, stop_step, rng, seen) -> tuple[list[dict], int]:
    """Every rank of `cfg`, from `state`, to a random micro-batch of step `stop_step` (None: the end)."""
    last = -1
    states = []
    for r in range(cfg.parallel.dp):
        ld = PackedLoader(IterableSource(docs), config=cfg, tokenizer="bytes", dp_rank=r, shuffle=False,
                          num_threads=0)
        if state is not None:
            ld.load_state_dict(state)
        pick = rng.random()
        for b in ld:
            last = max(last, b.step)
            if not b.dp_group or r == min(b.dp_group):
                ids, cu = b.input_ids.numpy(), b.cu_seqlens.numpy()
                for i, s in enumerate(b.segments):
                    if not np.array_equal(ids[cu[i]:cu[i + 1]], docs[s.doc][s.start:s.end]):
                        raise AssertionError(f"{name(cfg)}: step {b.step}: segment {s} differs from the source")
                    seen.append((s.doc, s.start, s.end))
            if stop_step is not None and b.step == stop_step:
                at = min(int(pick * (b.micro_batches_in_step + 1)), b.micro_batches_in_step - 1)
                if b.index_in_step == at:
                    break
        states.append(ld.state_dict())
        ld.close()
    return states, last


def one_run(seed: int) -> dict:
    rng = random.Random(seed)
    docs = corpus(seed)
    seen: list = []
    state, step, names, mid = None, -1, [], 0
    phases = rng.randint(3, 5)
    for k in range(phases):
        cfg = layout(rng)
        names.append(name(cfg))
        stop = None if k == phases - 1 else step + rng.randint(1, 12)
        states, step = run_layout(docs, cfg, state, stop, rng, seen)
        if stop is not None:
            mid += any(st["loader"]["skip"] for st in states)
            state = merge_states(states)
    cover = [np.zeros(len(d), np.int64) for d in docs]
    for d, a, b in seen:
        cover[d][a:b] += 1
    return {"layouts": " -> ".join(names), "changes": phases - 1, "mid_step": mid,
            "tokens": int(sum(len(d) for d in docs)), "lost": sum(int((c == 0).sum()) for c in cover),
            "repeated": sum(int(np.maximum(c - 1, 0).sum()) for c in cover)}


def worker_layout(rng: random.Random) -> tuple[PlanConfig, int]:
    dp, workers = rng.choice([1, 2]), rng.choice([0, 1, 2, 3])
    strategy = rng.choice(["wlb", "auto", "fixed"])
    cap = 128 if strategy == "auto" else CONTEXT
    cfg = PlanConfig(strategy=strategy, max_tokens=cap, context=CONTEXT, tokens_per_step=rng.choice([512, 1024]),
                     allow_slicing=strategy == "auto", parallel=ParallelConfig(dp=dp))
    return cfg, workers


def run_workers(docs, cfg, workers, state, count, seen) -> list[dict]:
    """Every rank's StatefulDataLoader of `workers` workers, from `state`, for `count` steps (None: the end)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    states = []
    for r in range(cfg.parallel.dp):
        ds = PackedDataset(IterableSource(docs), config=cfg, tokenizer="bytes", dp_rank=r, shuffle=False,
                           num_threads=0)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                                multiprocessing_context="spawn" if workers else None)
        if state is not None:
            dl.load_state_dict(dataloader_state_for(state, workers))
        it = iter(dl)
        for n, mbs in enumerate(it, 1):
            for b in mbs:
                if b.dp_group and r != min(b.dp_group):
                    continue
                ids, cu = b.input_ids.numpy(), b.cu_seqlens.numpy()
                for i, s in enumerate(b.segments):
                    if not np.array_equal(ids[cu[i]:cu[i + 1]], docs[s.doc][s.start:s.end]):
                        raise AssertionError(f"step {b.step}: segment {s} differs from the source")
                    seen.append((s.doc, s.start, s.end))
            if n == count:
                break
        states.append(dl.state_dict())
        del it, dl
    return states


def one_worker_run(seed: int) -> dict:
    rng = random.Random(seed)
    docs = corpus(seed)[:150] + [np.arange(8 * 1024 + 5, dtype=np.int32) % 256]
    seen: list = []
    state, names = None, []
    phases = rng.randint(3, 4)
    for k in range(phases):
        cfg, workers = worker_layout(rng)
        names.append(f"{name(cfg)} w{workers}")
        state = run_workers(docs, cfg, workers, state, None if k == phases - 1 else rng.randint(1, 6), seen)
    return {"layouts": " -> ".join(names), "changes": phases - 1, **coverage(docs, seen)}


def coverage(docs, seen) -> dict:
    cover = [np.zeros(len(d), np.int64) for d in docs]
    for d, a, b in seen:
        cover[d][a:b] += 1
    return {"tokens": int(sum(len(d) for d in docs)), "lost": sum(int((c == 0).sum()) for c in cover),
            "repeated": sum(int(np.maximum(c - 1, 0).sum()) for c in cover)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker-runs", type=int, default=0, help="runs through PackedDataset with DataLoader workers")
    p.add_argument("--write", default=None, help="markdown file whose elastic section gets the results")
    args = p.parse_args(argv)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    rows = []
    for i in range(args.runs):
        rows.append(one_run(args.seed * 100_000 + i))
        r = rows[-1]
        print(f"{r['layouts']}: lost {r['lost']}, repeated {r['repeated']}", flush=True)
    elapsed = time.monotonic() - t0
    changes, mid = sum(r["changes"] for r in rows), sum(r["mid_step"] for r in rows)
    lost, repeated = sum(r["lost"] for r in rows), sum(r["repeated"] for r in rows)
    summary = (f"{len(rows)} runs, {changes} layout changes ({mid} of them mid-step), "
               f"{sum(r['tokens'] for r in rows):,} tokens: {lost:,} lost, {repeated:,} repeated; {elapsed:.0f} s.")
    print(summary)
    t1, wrows = time.monotonic(), []
    for i in range(args.worker_runs):
        wrows.append(one_worker_run(args.seed * 100_000 + 50_000 + i))
        r = wrows[-1]
        print(f"{r['layouts']}: lost {r['lost']}, repeated {r['repeated']}", flush=True)
        lost, repeated = lost + r["lost"], repeated + r["repeated"]
    wsummary = (f"{len(wrows)} runs through PackedDataset, {sum(r['changes'] for r in wrows)} changes of worker "
                f"count and layout, {sum(r['tokens'] for r in wrows):,} tokens: {sum(r['lost'] for r in wrows):,} "
                f"lost, {sum(r['repeated'] for r in wrows):,} repeated; {time.monotonic() - t1:.0f} s.")
    if wrows:
        print(wsummary)
    if args.write:
        cmd = ".venv/bin/python benchmarks/elastic.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        table = ["| layouts in turn | mid-step changes | tokens | lost | repeated |", "| --- | ---: | ---: | ---: | ---: |"]
        table += [f"| {r['layouts']} | {r['mid_step']} / {r['changes']} | {r['tokens']:,} | {r['lost']} | {r['repeated']} |"
                  for r in rows[:12]]
        body = "\n".join([
            "One epoch trained over several layouts in turn, each stopped inside a random step (every rank at a random "
            "micro-batch of it) and resumed at the next layout from `merge_states` of every rank's state "
            "(`benchmarks/elastic.py`'s docstring says what a run does; CI runs dp 2 -> 4 -> 1 over gloo in "
            "`tests/test_elastic_resume.py`, worker counts in `tests/test_elastic_workers.py`).", "", "```bash", cmd, "```", "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()} with {cpus} CPUs "
            f"(load average {load0:.1f} at the start; shared).", "", f"- {summary}",
            *([f"- {wsummary}"] if wrows else []), "",
            f"The first {min(12, len(rows))} runs:", "", *table, ""])
        if wrows:
            body += "\n".join([
                "", "DataLoader workers (`PackedDataset` under StatefulDataLoader; `wN`: N workers, 0 the main process; "
                "each phase's state goes to the next through `dataloader_state_for`):", "",
                "| layouts and workers in turn | tokens | lost | repeated |", "| --- | ---: | ---: | ---: |",
                *[f"| {r['layouts']} | {r['tokens']:,} | {r['lost']} | {r['repeated']} |" for r in wrows], ""])
        write_section(Path(args.write), SECTION, "Elastic resume: layout changes", body)
        print(f"wrote the {SECTION} section of {args.write}")
    return 0 if lost == repeated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
