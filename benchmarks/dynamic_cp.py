"""Per-document context parallelism (issue 26) against the best fixed-CP plan, on the same lengths and memory.

    .venv/bin/python benchmarks/dynamic_cp.py --write docs/benchmarks.md
    .venv/bin/python benchmarks/dynamic_cp.py --quick            # smoke run: one data set, two steps
    .venv/bin/python benchmarks/dynamic_cp.py --cp-shard-factor 1.2 --cp-link-scale 2   # what if shards/links are slower

Layout: 16 GPUs as DP 4 x CP 4, TP 8, PP 1, 128K-token context, `--model` (default llama3-8b) priced with the
measured H100 profile (`--cost measured`) and the h100 device file's CP links (NVLink inside a node, InfiniBand
across: at TP 8 every CP group of 2 or more spans nodes). Every plan may hold at most 32K tokens per GPU in a
micro-batch (max_tokens 128K over CP 4), so all of them meet the same memory cap.

* fixed CP: the `auto` strategy (the simulator's pick among wlb, hydraulis, slimpack, fixed) at DP 4 x CP 4
  (max_tokens 128K), DP 8 x CP 2 (64K, slicing) and DP 16 x CP 1 (32K, slicing); each micro-batch also pays its
  CP group's K/V all-gather (`cost.cp_price`: in the price every planner balances, as per-document CP pays it; a SlimPack
  DP-Merge micro-batch, one piece run as CP over several DP ranks, that of all cp x its group's GPUs); the best of
  those that fit the device's memory (auto's memory check: a sliced 128K document keeps every slice's activations
  on its GPUs until its backward, so CP 2 and CP 1 do not fit at TP 8) is the baseline;
* per-document CP: `cp_mode="dynamic"` (the dynamic-cp planner, slice chains at smaller CP sizes included where
  their simulated peak fits) on the 16-GPU pool; and the same with CP sizes from lengths alone (`lifts` 0, no
  floors, no chains: the smallest size whose shard fits, megatron-core's rule) to show what the cost-driven sizing
  and the chains add;
* cp_mode "auto" at DP 4 x CP 4: each step fixed CP 4 (its traffic priced) or per-document CP, the faster;
* bound: every piece's attention at CP 1, the linear part at its lowest time per token, no CP traffic, perfectly
  balanced over the 16 GPUs: no plan of these steps, priced the way per-document CP plans are, beats it (slicing
  at smaller CP sizes included);
* megatron-core's hybrid CP (`BalancedCPScheduler`, run by `benchmarks/peers/megatron_hybrid_cp.py` on each step's
  pieces, max_seqlen_per_dp_cp_rank 32K, sequence parallelism at TP 8): its placement priced like ours
  (`priced_dynamic`: the same attention, linear part, CP traffic and waits for subgroup peers) plus its group
  barriers (`barrier_step_time`: each group lasts as long as its busiest GPU); its padding column counts the
  padding it requires (every sample to a multiple of 2 x DP x CP x TP), which is not priced (in its favour).

Data sets (`benchmarks/planner.py`'s generators, cut at the 128K context as the loader cuts): synthetic-longtail,
synthetic-cc, synthetic-github; `--steps` steps of `--tokens-per-step` tokens each. Figures: simulated tokens per
second (tokens / the sum of the slowest GPU's simulated step times), its ratio to the best fixed-CP plan's, GPU idle
share (1 - own work / (GPUs x step time): pipeline bubbles, DP waiting and, per-document, waits for subgroup
peers), padding tokens (the plans' layouts are padding-free: 0 unless a plan says otherwise), planning time per
step, and the share of tokens at each CP size.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np
from planner import synthetic  # benchmarks/, the script's own folder
from sections import write_section

from packloader.balancers.cost.cp_price import fixed_with_comm
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.offline import plan_run
from packloader.balancers.planners.doc_cp.price import DynamicCPCost, idle_share, priced_dynamic
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.verify import verify_plan
from packloader.contracts import ParallelConfig, PlanConfig, StepPlan

CONTEXT = 131072
DATASETS = ("synthetic-longtail", "synthetic-cc", "synthetic-github")
FIXED_LAYOUTS = ((4, 4), (8, 2), (16, 1))  # (dp, cp) of the 16 GPUs


def megatron_hybrid_cp_plan(lengths: np.ndarray, config: PlanConfig) -> StepPlan | tuple[StepPlan, int] | None:
    """THE PEER HOOK: one step's piece lengths (draw order, doc ids 0..n-1 within the step) and the
    per-document-CP PlanConfig in, megatron-core's BalancedCPScheduler placement as a StepPlan with cp_mode
    "dynamic" out, with the padding tokens megatron-core's hybrid CP requires (every sample to a multiple of
    2 x DP x CP x TP with sequence parallelism). Its memory cap is the same 32K tokens a GPU holds under every
    other plan (max_tokens / cp)."""
    from peers.megatron_hybrid_cp import megatron_hybrid_cp_plan as peer  # imports megatron-core: only when used

    par = config.parallel
    plan = peer([int(n) for n in lengths], dp=par.dp, cp=par.cp, max_tokens_per_gpu=config.max_tokens // par.cp,
                sequence_parallel_tp=par.tp)
    return plan, int(plan.extra["pad_tokens_required"])


def megatron_step_time(plan: StepPlan) -> float:
    """A priced megatron plan's step time: each of its groups lasts as long as its busiest GPU (the barrier over
    the DP x CP GPUs that ends it), which a plan's per-GPU sums cannot express."""
    from peers.megatron_hybrid_cp import barrier_step_time

    slots = max(len(r.micro_batches) for r in plan.ranks)
    times = [[r.micro_batches[m].fwd_cost + r.micro_batches[m].bwd_cost if m < len(r.micro_batches) else 0.0
              for r in plan.ranks] for m in range(slots)]
    return barrier_step_time(plan, times)


def config_for(dp: int, cp: int, args, cp_mode: str = "fixed") -> PlanConfig:
    return PlanConfig(strategy="auto", parallel=ParallelConfig(dp=dp, cp=cp, tp=args.tp), max_tokens=CONTEXT * cp // 4,
                      context=CONTEXT, tokens_per_step=args.tokens_per_step, model=args.model, cost=args.cost,
                      cp_mode=cp_mode, device=getattr(args, "device", "h100"))  # type: ignore[arg-type]


def what_if_device(shard_factor: float | None, link_scale: float | None, folder: Path, base: str = "h100") -> str:
    """The name of a device file written to `folder` and registered: `base` with every CP shard (sizes 2-16)
    `shard_factor` times slower than 1/s of its document (`Device.cp_shard`) and its CP link bandwidths divided
    by `link_scale`; `base` itself when neither is given. Fixed and per-document CP are both priced with it."""
    from packloader.balancers.cost.cp_shard_attention import uniform_overhead
    from packloader.balancers.cost.devices import load_device, register_device
    from packloader.runtime.calibrate_cp import write_device

    if shard_factor is None and link_scale is None:
        return base
    dev = load_device(base)
    name = f"{base}-shard{shard_factor or 1:g}-link{link_scale or 1:g}".replace(".", "p")
    link = dev.cp_link if link_scale is None else msgspec.structs.replace(
        dev.cp_link, intra_node_gbps=dev.cp_link.intra_node_gbps / link_scale,
        inter_node_gbps=dev.cp_link.inter_node_gbps / link_scale)
    shard = dev.cp_shard if shard_factor is None else uniform_overhead(shard_factor)
    path = folder / f"{name}.json"
    write_device(msgspec.structs.replace(dev, name=name, cp_link=link, cp_shard=shard,
                                         description=f"{base}, what-if: {shard.source if shard else 'ideal shards'}, "
                                                     f"CP links / {link_scale or 1:g}"), path)
    register_device(path)
    return name


class Row(msgspec.Struct):
    name: str
    tokens: int = 0
    time: float = 0.0
    idle: float = 0.0
    padding: int = 0
    plan_s: float = 0.0
    note: str = ""
    cp_tokens: dict = {}
    mix: str = ""  # cp_mode auto: how many steps it planned per-document

    @property
    def rate(self) -> float:
        return self.tokens / self.time if self.time else 0.0


def run_fixed(lengths: np.ndarray, dp: int, cp: int, args) -> Row:
    config = config_for(dp, cp, args)
    model = cost_model_for(config)
    comm = DynamicCPCost.for_config(msgspec.structs.replace(config, cp_mode="dynamic")).comm
    t0 = time.perf_counter()
    run = plan_run(lengths, config, args.steps)
    row = Row(f"fixed CP {cp} (DP {dp})", plan_s=(time.perf_counter() - t0) / len(run.plans))
    verify_plan(run.plans, run.windows, final_state=run.final_state)
    busy = 0.0
    over = max(p.memory_over for p in run.plans)
    if over > 0:
        row.note = f"over memory: peak up to {over:.2f}x the H100's usable memory (no candidate fit)"
    for plan in run.plans:
        s = score_plan(fixed_with_comm(_priced(plan, model), comm, cp, model.profile.cp_traffic), model, config.parallel, use_plan_costs=True)
        row.tokens += s.tokens
        row.time += s.step_time
        busy += (1 - s.bubble_share) * s.step_time
    row.idle = 1 - busy / row.time if row.time else 0.0
    return row


def run_auto(lengths: np.ndarray, args) -> Row:
    """cp_mode "auto" at DP 4 x CP 4: per step, fixed CP (its traffic priced) or per-document CP, the faster."""
    config = config_for(4, 4, args, cp_mode="auto")
    cost = DynamicCPCost.for_config(msgspec.structs.replace(config, cp_mode="dynamic"))
    model = cost_model_for(config)
    t0 = time.perf_counter()
    run = plan_run(lengths, config, args.steps)
    row = Row("cp_mode auto (DP 4 x CP 4: fixed or per-document, per step)",
              plan_s=(time.perf_counter() - t0) / len(run.plans))
    verify_plan(run.plans, run.windows, final_state=run.final_state)
    busy = 0.0
    for plan in run.plans:
        s = score_plan(_priced(plan, model), model, config.parallel, use_plan_costs=True)
        row.tokens += s.tokens
        row.time += s.step_time
        idle = idle_share(plan, cost, s.step_time) if plan.cp_mode == "dynamic" else s.bubble_share
        busy += (1 - idle) * s.step_time
    row.idle = 1 - busy / row.time if row.time else 0.0
    row.mix = f"{sum(p.cp_mode == 'dynamic' for p in run.plans)} of {len(run.plans)} steps per-document"
    return row


def _priced(plan: StepPlan, model) -> StepPlan:
    from packloader.balancers.cost.model import annotate_costs

    if all(mb.fwd_cost > 0 or not mb.segments for r in plan.ranks for mb in r.micro_batches):
        return plan
    return annotate_costs(msgspec.structs.replace(plan), model)


def run_dynamic(lengths: np.ndarray, args, hook: Callable | None = None, by_length: bool = False) -> Row:
    config = config_for(4, 4, args, cp_mode="dynamic")
    cost = DynamicCPCost.for_config(config)
    if hook is not None:
        hook(np.array([CONTEXT // 4]), config)  # megatron-core imported before the clock starts
    t0 = time.perf_counter()
    if hook is None:
        name = "per-document CP (packloader dynamic-cp, slice chains included)"
        if by_length:  # CP sizes from lengths alone, as megatron-core sizes them; packloader's placement
            config = msgspec.structs.replace(config, planner_options={"dynamic-cp": {"lifts": [0.0], "floors": False,
                                                                                      "chains": False}})
            name = "per-document CP, sizes by length only (dynamic-cp lifts 0, no floors, no chains)"
        run = plan_run(lengths, config, args.steps)
        plans, windows, state = run.plans, run.windows, run.final_state
        row = Row(name)
    else:
        from packloader.balancers.draw import draw_windows

        windows, plans, state = draw_windows(lengths, config.tokens_per_step, config.context, args.steps).windows, [], None
        row = Row("megatron-core hybrid CP (BalancedCPScheduler)")
        for k, w in enumerate(windows):
            got = hook(np.asarray(w.length), config)
            if got is None:
                return Row(row.name, note="not wired: benchmarks/peers/megatron_hybrid_cp.py")
            plan, pad = got if isinstance(got, tuple) else (got, 0)
            plan = _renamed(plan, np.asarray(w.doc), np.asarray(w.offset), k)
            plans.append(plan)
            row.padding += pad
    row.plan_s = (time.perf_counter() - t0) / max(1, len(plans))
    verify_plan(plans, windows, final_state=state)
    busy = 0.0
    for plan in plans:
        plan = priced_dynamic(plan, cost)
        s = score_plan(plan, cost.model, config.parallel, use_plan_costs=True)
        step_time = megatron_step_time(plan) if hook is not None else s.step_time
        row.tokens += s.tokens
        row.time += step_time
        busy += (1 - idle_share(plan, cost, step_time)) * step_time
        for r, rank in enumerate(plan.ranks):
            for mb in rank.micro_batches:
                for seg, c in zip(mb.segments, mb.cp or []):
                    if c.first == r:
                        row.cp_tokens[c.size] = row.cp_tokens.get(c.size, 0) + seg.end - seg.start
    row.idle = 1 - busy / row.time if row.time else 0.0
    return row


def run_bound(lengths: np.ndarray, args) -> Row:
    """What no plan of these steps can beat under this cost model: every piece's attention at CP 1 (a CP shard
    costs each of its s GPUs at least 1 / s of it; slices of a piece at least the piece), the linear part at the
    lowest per-token time of any micro-batch a GPU may hold (1 to max_tokens / cp tokens), no CP traffic, spread
    evenly over the 16 GPUs. The ceiling of any plan priced the way per-document CP plans are, slicing at smaller
    CP sizes included (issue 26's open question)."""
    from packloader.balancers.cost.coeffs import lin_times
    from packloader.balancers.draw import draw_windows

    config = config_for(4, 4, args, cp_mode="dynamic")
    cost = DynamicCPCost.for_config(config)
    n = np.arange(1, cost.cap + 1, dtype=np.float64)  # lin is piecewise linear: its time per token is lowest at a knot
    rate = float(((lin_times(cost.model.coeffs, n, False) + lin_times(cost.model.coeffs, n, True)) / n).min())
    row = Row("bound: attention at CP 1, linear at its lowest per-token time, no CP traffic, perfect balance")
    for w in draw_windows(lengths, config.tokens_per_step, config.context, args.steps).windows:
        q = np.asarray(w.length, dtype=np.int64)
        fa, ba = cost.model.segment_times(q, np.zeros_like(q))
        row.tokens += int(q.sum())
        row.time += float(fa.sum() + ba.sum() + rate * q.sum()) / cost.pool
    return row


def _renamed(plan: StepPlan, doc: np.ndarray, offset: np.ndarray, step: int) -> StepPlan:
    """A hook's plan (doc = position in the step's lengths, offsets from 0) in the run's doc ids and offsets."""
    ranks = []
    for rank in plan.ranks:
        mbs = []
        for mb in rank.micro_batches:
            segs = [msgspec.structs.replace(s, doc=int(doc[s.doc]), start=s.start + int(offset[s.doc]),
                                            end=s.end + int(offset[s.doc]), attend_from=s.attend_from + int(offset[s.doc]))
                    for s in mb.segments]
            mbs.append(msgspec.structs.replace(mb, segments=segs))
        ranks.append(msgspec.structs.replace(rank, micro_batches=mbs))
    return msgspec.structs.replace(plan, ranks=ranks, step=step)


def table(results: dict[str, list[Row]]) -> str:
    lines = ["| data set | plan | tokens/s (simulated) | vs best fixed CP | GPU idle | padding | planning s/step | tokens at CP 1 / 2 / 4 / 8 / 16 (auto: steps) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for ds, rows in results.items():
        fixed = [r for r in rows if r.name.startswith("fixed") and r.time and not r.note]
        best = max(r.rate for r in fixed or [r for r in rows if r.name.startswith("fixed") and r.time])
        for r in rows:
            if r.note and not r.time:
                lines.append(f"| {ds} | {r.name} | {r.note} | | | | | |")
                continue
            if r.note:  # over memory: shown, never the baseline
                lines.append(f"| {ds} | {r.name}: {r.note} | {r.rate:,.0f} | ({r.rate / best:.3f}x) | {r.idle:.1%} | "
                             f"{r.padding} | {r.plan_s:.2f} | |")
                continue
            if r.name.startswith("bound"):
                lines.append(f"| {ds} | {r.name} | {r.rate:,.0f} | {r.rate / best:.3f}x | 0.0% | 0 | | |")
                continue
            share = r.mix
            if r.cp_tokens:
                tot = sum(r.cp_tokens.values())
                share = " / ".join(f"{r.cp_tokens.get(s, 0) / tot:.0%}" for s in (1, 2, 4, 8, 16))
            mark = " (best fixed)" if r.rate == best and r.name.startswith("fixed") else ""
            lines.append(f"| {ds} | {r.name}{mark} | {r.rate:,.0f} | {r.rate / best:.3f}x | {r.idle:.1%} | {r.padding} | "
                         f"{r.plan_s:.2f} | {share} |")
    return "\n".join(lines)


def what_if_note(args) -> str:
    parts = ([f"every CP shard priced {args.cp_shard_factor:g}x 1/s of its document"] if args.cp_shard_factor else []) + \
        ([f"CP link bandwidths / {args.cp_link_scale:g}"] if args.cp_link_scale else [])
    return f"; what-if: {', '.join(parts)}" if parts else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tokens-per-step", type=int, default=4 << 20)
    p.add_argument("--docs", type=int, default=40000, help="documents generated per data set")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--cost", default="measured", choices=("measured", "analytic"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--write", type=Path, default=None, help="write the table into this docs/benchmarks.md")
    p.add_argument("--section", default="dynamic_cp", help="the docs/benchmarks.md section it writes (default dynamic_cp)")
    p.add_argument("--cp-shard-factor", type=float, default=None, metavar="F", help="price every CP shard (sizes 2-16) "
                   "F times 1/s of its document's attention, fixed and per-document CP alike (a what-if device file "
                   "from h100 with cp_shard set; `packloader calibrate --cp-shards` measures it)")
    p.add_argument("--cp-link-scale", type=float, default=None, metavar="X", help="divide the h100 file's CP link "
                   "bandwidths by X (`packloader calibrate --cp` measures them)")
    args = p.parse_args(argv)
    for name in ("cp_shard_factor", "cp_link_scale"):
        if getattr(args, name) is not None and getattr(args, name) < 1.0:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (a shard no faster than 1/s, a link no faster), got "
                    f"{getattr(args, name)}")
    args.device = what_if_device(args.cp_shard_factor, args.cp_link_scale, Path(tempfile.mkdtemp(prefix="dynamic-cp-")))
    datasets = DATASETS[:1] if args.quick else DATASETS
    if args.quick:
        args.steps, args.docs = 2, 6000
    results: dict[str, list[Row]] = {}
    for ds in datasets:
        lengths = synthetic(ds, args.docs, seed=26)
        lengths = lengths[lengths > 0]
        rows = [run_fixed(lengths, dp, cp, args) for dp, cp in FIXED_LAYOUTS]
        rows.append(run_dynamic(lengths, args))
        rows.append(run_dynamic(lengths, args, by_length=True))
        rows.append(run_auto(lengths, args))
        rows.append(run_dynamic(lengths, args, hook=megatron_hybrid_cp_plan))
        rows.append(run_bound(lengths, args))
        results[ds] = rows
        print(table({ds: rows}).splitlines()[-len(rows):] and table({ds: rows}), flush=True)
    text = table(results)
    if args.write:
        cmd = "python benchmarks/dynamic_cp.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        body = (f"Command: `{cmd.strip()}` ({_dt.date.today()}, {platform.machine()}, Python "
                f"{platform.python_version()}; simulated times, so the machine does not change them).\n\n"
                f"{args.steps} steps of {args.tokens_per_step:,} tokens, context {CONTEXT:,}, {args.model} at TP "
                f"{args.tp}, {args.cost} H100 profile, 16 GPUs, at most 32K tokens per GPU per micro-batch"
                f"{what_if_note(args)}.\n\n{text}")
        write_section(args.write, args.section, "Per-document context parallelism (issue 26)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
