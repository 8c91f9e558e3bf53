"""Sliced plans in a pipeline on CPU (gloo): the carried KV per stage against the simulator's memory model, and the
step time of a sliced plan against the unsliced plan of the same documents.

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python benchmarks/pipeline_slices.py --steps 5

Model: tests/helpers/pipeline_model.py's small Llama-like model (hidden 16, 4 query / 2 key-value heads of 4, SwiGLU 32,
`--layers` layers split evenly over the stages), float64, one process per pipeline stage over gloo, 1 thread each.
Plans: the slimpack planner on one fixed window of document lengths (`--scale` multiplies them), one DP rank,
`--micro-batches` micro-batches, `max_tokens` a quarter of the longest document (so the long ones are sliced), and
the same window planned with allow_slicing=False and max_tokens = the longest document (unsliced); plus a
hand-made plan (tests/test_pipeline_slices.py's HAND).

Memory: after each forward/backward a stage records its KV cache's bytes: the carried keys/values (views of the
storing micro-batch's own key/value tensors, which its forward keeps for its backward anyway) and their gradient
accumulators (the only new memory). The simulator's model of the same thing: `simulator.simulate` with each slice
edge's key/value-gradient bytes (`MemoryModel.kv_grad_bytes_per_token` of this model's shape, bf16 there, scaled
to float64 here) and no other bytes, on the same plan and schedule; its per-stage peak is compared with the
measured peak of the accumulators. Time: wall time of `step_plan` per step (median over `--steps` after one
warm-up step; the slowest stage's), and the plan preparation alone (actions from the simulator, the engine's
send/receive lowering, buffer sizing) per step. The machine's load average is printed: on a shared machine
other processes' load shows up in the times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.distributed import run_ranks  # noqa: E402
from helpers.pipeline_model import (  # noqa: E402
    FF,
    HAND,
    HAND_LENGTHS,
    HD,
    HKV,
    HQ,
    VOCAB,
    H,
    Llama,
    StageModule,
    documents,
    loss_fn,
    loss_tokens,
    micro_batch_inputs,
    stage_layers,
)

from packloader.balancers.cost.memory import MemoryModel
from packloader.balancers.cost.presets import ModelShape
from packloader.balancers.sim.simulator import simulate, slice_edges_of
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState, RankPlan  # noqa: E402

LENGTHS = [70, 9, 14, 22, 5, 31, 12, 8, 17, 40, 6, 11, 26, 19]


def plans(scale: int, m: int, pp: int) -> dict[str, tuple[RankPlan, dict[int, int]]]:
    from packloader.balancers.factory import make_planner
    from packloader.balancers.planners.registry import Window


    lens = [l * scale for l in LENGTHS]
    w = Window(np.arange(len(lens), dtype=np.int64), np.zeros(len(lens), np.int64), np.array(lens, np.int64))
    out = {"hand-made (8 mbs)": (HAND, HAND_LENGTHS)}
    for name, cap, sl in (("slimpack sliced", max(lens) // 4, True), ("slimpack unsliced", max(lens), False)):
        cfg = PlanConfig(strategy="slimpack", parallel=ParallelConfig(pp=pp), max_tokens=cap, context=max(lens),
                         tokens_per_step=sum(lens), num_micro_batches=m, model="llama3-8b", allow_slicing=sl)
        plan, _ = make_planner(cfg).plan(w, PlannerState(), 0)
        out[name] = (plan.ranks[0], dict(enumerate(lens)))
    return out


def _rank(rank, world, cases, layers, steps):
    import torch.distributed as dist

    from packloader.runtime.pipeline import PlanPipelineSchedule, SlicedPipelineStage, simulated_actions

    torch.set_num_threads(1)
    out = {}
    for name, (rp, lengths) in cases.items():
        model = Llama(layers)
        docs = documents(lengths)
        n_loss = loss_tokens(docs)
        lo, hi = stage_layers(layers, world)[rank]
        first, last = rank == 0, rank == world - 1
        stage = SlicedPipelineStage(
            StageModule(model, lo, hi, first, last), rank, world, "cpu",
            input_example=torch.zeros(1, dtype=torch.long) if first else torch.zeros(1, H, dtype=torch.float64),
            output_example=torch.zeros(1, VOCAB if last else H, dtype=torch.float64))
        sched = PlanPipelineSchedule([stage], loss_fn)
        busy = [0.0]
        for meth in ("forward_one_chunk", "backward_one_chunk"):  # compute time of the stage (idle = step - busy)
            def timed(*a, _f=getattr(stage, meth), **k):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    busy[0] += time.perf_counter() - t0
            setattr(stage, meth, timed)
        inputs = [micro_batch_inputs(mb, docs) for mb in rp.micro_batches]
        kw = dict(arg_mbs=[(i,) for i, _, _ in inputs], kwarg_mbs=[{"positions": p} for _, p, _ in inputs],
                  target_mbs=[(lab, n_loss) for _, _, lab in inputs], losses=[])
        times, busies = [], []
        for i in range(steps + 1):
            dist.barrier()
            busy[0] = 0.0
            t = time.perf_counter()
            sched.step_plan(rp, **kw)
            if i:
                times.append(time.perf_counter() - t)
                busies.append(busy[0])
        t = time.perf_counter()
        for _ in range(20):
            acts = simulated_actions(rp.micro_batches, world)
            sched._prepare_schedule_with_comms({r: list(a) for r, a in acts.items()})
            stage.size_buffers([mb.num_tokens for mb in rp.micro_batches])
        prep = (time.perf_counter() - t) / 20
        out[name] = dict(times=times, busy=statistics.median(busies), prep=prep,
                         kv=max((s.kv_bytes for s in stage.kv_trace), default=0),
                         grad=max((s.grad_bytes for s in stage.kv_trace), default=0))
    return out


def simulated_kv_peaks(rp: RankPlan, pp: int, layers: int) -> list[float]:
    shape = ModelShape(name="bench", hidden=H, layers=layers, heads=HQ, kv_heads=HKV, ffn=FF, vocab=VOCAB)
    assert shape.head_dim == HD
    mem = MemoryModel(shape, ParallelConfig(pp=pp))
    edges, prefix = slice_edges_of(rp.micro_batches)
    if not len(edges):
        return [0.0] * pp
    per_tok = np.array([mem.kv_grad_bytes_per_token(s) * 8 / 2 for s in range(pp)])  # bf16 -> float64
    kv = per_tok[:, None] * prefix[None, :]
    tok = np.array([mb.num_tokens for mb in rp.micro_batches], dtype=np.float64)
    res = simulate(tok, 2 * tok, pp, slice_edges=edges, backward_order=rp.backward_order, kv_bytes=kv)
    return [float(x) for x in res.peak_bytes]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"CPUs {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    for pp in args.pp:
        cases = plans(args.scale, args.micro_batches, pp)
        res = run_ranks(_rank, pp, cases, args.layers, args.steps, timeout=1200)
        print(f"\n### {pp} stages, {args.layers} layers, 1F1B\n")
        print("| plan | tokens | sliced docs | stage | carried K/V peak (B) | KV-grad accumulators peak (B) | "
              "simulator KV-grad peak (B) | step ms (median) | stage compute ms | preparation ms |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, (rp, _) in cases.items():
            sim = simulated_kv_peaks(rp, pp, args.layers)
            toks = sum(mb.num_tokens for mb in rp.micro_batches)
            sliced = len({s.doc for mb in rp.micro_batches for s in mb.segments if s.attend_from < s.start})
            step = max(statistics.median(res[r][name]["times"]) for r in range(pp)) * 1e3
            for s in range(pp):
                r = res[s][name]
                print(f"| {name if s == 0 else ''} | {toks if s == 0 else ''} | {sliced if s == 0 else ''} | {s} | "
                      f"{r['kv']} | {r['grad']} | {sim[s]:.0f} | {f'{step:.0f}' if s == 0 else ''} | "
                      f"{r['busy'] * 1e3:.0f} | {r['prep'] * 1e3:.1f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
