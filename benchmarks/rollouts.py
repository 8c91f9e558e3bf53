"""Rollouts in memory (issue 37): planning time per call of the verl adapter and `balance_rollouts` against verl's
own functions (vendored under tests/reference, verl commit 80eb57e) in the same run, on the same lengths, for 1K,
8K and 32K sequences a step over 8 DP ranks, micro-batches of at most 32K tokens; with the plans' quality.

    .venv/bin/python benchmarks/rollouts.py --write docs/benchmarks.md

Lengths: RL rollouts, a prompt of 200..1,500 tokens and a log-normal response (median ~1,100 tokens) cut at the
generation limit of 16,000 (about 4 % reach it), seeded. Rows, per size:

* `get_seqlen_balanced_partitions`: the step's `calculate_workload` values over 8 ranks, equal_size=True (verl's
  `_balance_batch`).
* micro-batch planning of one rank (the step's first eighth): verl's `get_seqlen_balanced_partitions` over its
  micro-batch count, as its `rearrange_micro_batches` calls it, against the adapter's `plan_micro_batches` (the same
  function without the tensor copies).
* `rearrange_micro_batches`, the whole call on a jagged TensorDict of that rank's rows (tensor copies included).
* the whole step: verl's trainer (the first row, then every rank's micro-batches at the DP group's count) against
  `balance_rollouts(..., dp=8, equal_sizes=True)`.

Each call runs after an untimed warm-up (numba compilation), `--reps` times (verl's slowest calls fewer), the two
sides alternated; the median CPU time of the process is reported (the machine is shared: wall time follows the
load, CPU time of these single-threaded calls hardly does), and the ratio verl / packloader."""

from __future__ import annotations

import argparse
import gc
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from reference import verl_seqlen_balancing as verl  # noqa: E402
from sections import write_section  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from packloader import balance_rollouts  # noqa: E402
from packloader.balancers.planners.rollouts import resolve_cost  # noqa: E402
from packloader_integrations import verl as adapter  # noqa: E402

SECTION = "rollouts"
DP, CAP = 8, 32768


def rollout_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    response = np.minimum(rng.lognormal(7.0, 1.1, n).astype(np.int64) + 1, 16000)
    return rng.integers(200, 1500, n) + response


def cpu(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        gc.collect()
        t = time.process_time()
        out = fn()
        times.append(time.process_time() - t)
    return statistics.median(times), out


def verl_rank_plan(lengths: np.ndarray, m: int | None = None) -> list[list[int]]:
    """verl's rearrange_micro_batches planning: its count, then LDM over calculate_workload."""
    w = verl.calculate_workload(torch.as_tensor(lengths)).tolist()
    if m is None:
        m = min(len(lengths), -(-int(lengths.sum()) // CAP))
    return verl.get_seqlen_balanced_partitions(w, m, equal_size=False)


def verl_step(lengths: np.ndarray) -> list[list[list[int]]]:
    parts = verl.get_seqlen_balanced_partitions(verl.calculate_workload(torch.as_tensor(lengths)).tolist(), DP, True)
    m = max(min(len(p), -(-int(lengths[p].sum()) // CAP)) for p in parts)
    return [[[p[i] for i in mb] for mb in verl_rank_plan(lengths[p], m)] for p in parts]


def jagged(lengths: np.ndarray) -> TensorDict:
    rows = [torch.zeros(int(n), dtype=torch.int32) for n in lengths]
    return TensorDict({"input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=[len(lengths)])


def quality(lengths: np.ndarray, ranks: list[list[list[int]]], model) -> dict:
    costs = [[sum(model.microbatch_time_of(lengths[mb])) for mb in rank] for rank in ranks]
    flat = np.array([c for r in costs for c in r])
    return {"step_s": max(sum(r) for r in costs), "mb_max_mean": float(flat.max() / flat.mean()),
            "max_tokens": int(max(lengths[mb].sum() for r in ranks for mb in r)), "micro_batches": len(ranks[0])}


def run(sizes: list[int], reps: int) -> tuple[list[dict], list[dict]]:
    model = resolve_cost(None)
    small = rollout_lengths(64)
    adapter.get_seqlen_balanced_partitions(small.tolist(), 8, True)  # warm-up: numba compiles
    balance_rollouts(small, CAP, DP, equal_sizes=True)
    adapter.rearrange_micro_batches(jagged(small), CAP)
    rows, quals = [], []
    for n in sizes:
        lengths = rollout_lengths(n, seed=n)
        w = verl.calculate_workload(torch.as_tensor(lengths)).tolist()
        rank = lengths[: n // DP]
        slow = 1 if n > 8192 else reps
        cases = [
            ("get_seqlen_balanced_partitions (8 ranks, equal_size)",
             lambda: verl.get_seqlen_balanced_partitions(w, DP, True),
             lambda: adapter.get_seqlen_balanced_partitions(w, DP, True), reps),
            (f"micro-batch planning, one rank ({len(rank):,} sequences)",
             lambda: verl_rank_plan(rank), lambda: adapter.plan_micro_batches(rank, CAP), slow),
            ("rearrange_micro_batches, one rank (jagged TensorDict)",
             lambda: verl.rearrange_micro_batches(jagged(rank), CAP),
             lambda: adapter.rearrange_micro_batches(jagged(rank), CAP), slow),
            ("whole step: verl's trainer vs balance_rollouts", lambda: verl_step(lengths),
             lambda: balance_rollouts(lengths, CAP, DP, equal_sizes=True), slow),
        ]
        for name, theirs, ours, r in cases:
            t_ours, got = cpu(ours, reps)
            t_verl, ref = cpu(theirs, r)
            rows.append({"n": n, "call": name, "verl_s": t_verl, "ours_s": t_ours, "ratio": t_verl / t_ours})
            print(f"{n:>6} {name:55s} verl {t_verl:9.4f}s  packloader {t_ours:8.4f}s  {t_verl / t_ours:7.1f}x", flush=True)
        quals.append({"n": n, "verl": quality(lengths, ref, model), "ours": quality(lengths, got.micro_batches, model)})
    return rows, quals


def render(rows: list[dict], quals: list[dict], argv: list[str]) -> str:
    lines = [
        f"Command: `.venv/bin/python benchmarks/rollouts.py {shlex.join(argv)}` ({platform.processor() or platform.machine()}, "
        f"shared machine; CPU seconds per call, median). verl: its `seqlen_balancing.py` functions as vendored under "
        "`tests/reference` (commit 80eb57e); packloader: `packloader_integrations.verl` and `balance_rollouts`. "
        f"{DP} DP ranks, micro-batches of at most {CAP:,} tokens, llama3-8b on the measured H100 profile.",
        "",
        "| sequences | call | verl (s) | packloader (s) | verl / packloader |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['n']:,} | {r['call']} | {r['verl_s']:.4f} | {r['ours_s']:.4f} | {r['ratio']:.1f}x |")
    lines += ["", "The whole step's plans (slowest rank: the sum of its micro-batches' predicted forward + backward "
              "seconds; micro-batch max / mean of that time over all ranks; the most tokens in one micro-batch):", "",
              "| sequences | plan | micro-batches per rank | slowest rank (s) | micro-batch max / mean | most tokens |",
              "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for q in quals:
        for who in ("verl", "ours"):
            s = q[who]
            lines.append(f"| {q['n']:,} | {'verl' if who == 'verl' else 'balance_rollouts'} | {s['micro_batches']} | "
                         f"{s['step_s']:.3f} | {s['mb_max_mean']:.3f} | {s['max_tokens']:,} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", type=Path, help="docs/benchmarks.md: replace (or add) this benchmark's section")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows, quals = run(args.sizes, args.reps)
    text = render(rows, quals, sys.argv[1:])
    print(text)
    if args.write:
        write_section(args.write, SECTION, "Rollouts in memory: the verl adapter and balance_rollouts (issue 37)", text)


if __name__ == "__main__":
    main()
