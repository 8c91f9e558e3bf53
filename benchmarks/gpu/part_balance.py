"""Part 5, balance on real time: one long-tail corpus planned for DP 8 / PP 4 by `fixed`, `auto` and today's
packers (`concat`, `multipack`, `karmarkar_karp`); every micro-batch of every DP rank is timed (forward +
backward of a few Llama layers, gpu_model.py; each rank's slowest twice, see `_time_plan`). Every strategy times the same steps of the corpus: one step
each first, then as many more as the part's budget allows at the speed each showed (at least 2 in all), so
tokens/s compare like with like. Reported per strategy: the measured imbalance degree of rank 0 (max
micro-batch time x micro-batches / total, per step) against the cost model's, and the DP 8 / PP 4 step time
simulated from the measured times (the plan's pipeline schedule, `simulate_step` with the measured costs; times
scaled from the timed layers to a stage's layers), against the same simulation priced by the cost model (LM
head left out as in the timed layers). Plans and predictions use the profile calibrated in part 2 when it ran,
as a user would after `packloader calibrate`, else the shipped H100 one (gpu_plan.py); the report names it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
from gpu_common import Budget, Ctx, long_tail_lengths, time_fwd_bwd
from gpu_model import Layers, Pack, pack_runner
from gpu_plan import PlanProfile, plan_profile, planner_warnings

from packloader.balancers.cost import presets
from packloader.balancers.draw import draw_windows
from packloader.balancers.factory import make_planner
from packloader.balancers.sim.simulator import simulate_step
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

STRATEGIES = ("fixed", "auto", "concat", "multipack", "karmarkar_karp")
LAYERS_TIMED = 2
MIN_STEPS = 2  # every strategy times at least this many steps, whatever the budget
SAFETY = 0.85  # share of the budget left after the first steps that the step count is chosen to fill


def setup(dry: bool, quick: bool = False) -> dict:
    if dry:
        return {"dp": 2, "pp": 2, "cap": 64, "tokens_per_step": 512, "max_steps": 3, "scale": 1 / 256,
                "strategies": ("fixed", "auto", "concat")}
    return {"dp": 8, "pp": 4, "cap": 16384, "tokens_per_step": 524288, "max_steps": 6 if quick else 20, "scale": 1.0,
            "strategies": STRATEGIES}


def steps_for_budget(left_s: float, step_s: list[float], max_steps: int, minimum: int = MIN_STEPS) -> int:
    """Steps per strategy, the first (already timed, `step_s` seconds each) included: as many as `SAFETY` of
    the seconds left allow when every strategy times one more step per round, within [minimum, max_steps]."""
    per_round = sum(step_s)
    more = int(max(left_s, 0.0) * SAFETY // per_round) if per_round > 0 else max_steps
    return max(minimum, min(max_steps, 1 + more))


def _imbalance(t: np.ndarray) -> float:
    return float(t.max() * len(t) / t.sum()) if len(t) and t.sum() > 0 else 1.0


def _time_mb(ctx: Ctx, model: Layers, mb, shape) -> tuple[float, float]:
    q = [s.end - s.start for s in mb.segments]
    p = [s.start - s.attend_from for s in mb.segments]
    f, b = time_fwd_bwd(ctx, pack_runner(model, Pack(q, p, ctx.device, ctx.backend), shape, ctx.dtype),
                        repeats=1, warmup=1)
    g = len(mb.dp_group) if mb.dp_group else 1
    return f / g, b / g


def _time_plan(ctx: Ctx, model: Layers, plan, shape) -> tuple[dict[int, tuple[float, float]], list[float]]:
    """Measured (fwd, bwd) of every micro-batch of the step, by id(); a DP-Merge micro-batch is timed once and
    each of its g ranks is charged 1/g (its share when run as context parallelism). Each micro-batch is timed
    once after one untimed run (a training step reuses the allocator's blocks; the first H200 proof timed them
    cold, and auto's micro-batches whose slice prefix first grew ran up to 14 ms over their price, 2 layers);
    each rank's slowest is timed again and keeps the faster run: one first-run cost (the allocator
    growing, a kernel loaded) would otherwise set the rank's imbalance and pipeline time alone. Also returns,
    per rank, how much slower the first run of its slowest micro-batch was (1.0: no first-run cost)."""
    out: dict[int, tuple[float, float]] = {}
    for rank in plan.ranks:
        for mb in rank.micro_batches:
            if id(mb) not in out:
                out[id(mb)] = _time_mb(ctx, model, mb, shape) if mb.segments else (0.0, 0.0)
    first_run = []
    for rank in plan.ranks:
        timed = [mb for mb in rank.micro_batches if mb.segments]
        if not timed:
            continue
        slow = max(timed, key=lambda mb: sum(out[id(mb)]))
        again = _time_mb(ctx, model, slow, shape)
        first_run.append(sum(out[id(slow)]) / max(sum(again), 1e-12))
        if sum(again) < sum(out[id(slow)]):
            out[id(slow)] = again
    return out, first_run


@dataclass
class _Strategy:
    """One strategy's planner, its state across steps and what each timed step gave."""

    name: str
    cfg: PlanConfig
    planner: object = None
    state: PlannerState = field(default_factory=PlannerState)
    steps: list[dict] = field(default_factory=list)
    step_s: float = 0.0  # wall seconds of timing its last step (planning left out: numba compiles on first use)
    error: str | None = None
    rank0: dict = field(default_factory=dict)


def _one_step(ctx, model, shape, run: _Strategy, window, s: int, cm, factor: float) -> None:
    par = run.cfg.parallel
    plan, run.state = run.planner.plan(window, run.state, s)
    t0 = time.perf_counter()
    times, first_run = _time_plan(ctx, model, plan, shape)
    run.step_s = time.perf_counter() - t0
    r0 = plan.ranks[0].micro_batches
    if not run.steps:  # rank 0's first step whole (ms of the timed layers), so a reader can check the aggregates
        run.rank0 = {"tokens": [mb.num_tokens for mb in r0], "measured_ms": [sum(times[id(mb)]) * 1e3 for mb in r0],
                     "predicted_ms": [sum(cm.microbatch_times(mb)) * 1e3 / factor for mb in r0]}
    measured = msgspec.convert(msgspec.to_builtins(plan), type(plan))  # a copy whose costs are the measured ones
    for rank, mrank in zip(plan.ranks, measured.ranks):
        for mb, mmb in zip(rank.micro_batches, mrank.micro_batches):
            mmb.fwd_cost, mmb.bwd_cost = (t * factor for t in times[id(mb)])
    run.steps.append({
        "imb_meas": _imbalance(np.array([sum(times[id(mb)]) for mb in r0])),
        "imb_pred": _imbalance(np.array([sum(cm.microbatch_times(mb)) for mb in r0])),
        "sim_pred": simulate_step(plan, cm, par).step_time,
        "sim_meas": simulate_step(measured, cm, par, use_plan_costs=True).step_time,
        "tokens": sum(mb.num_tokens for r in plan.ranks for mb in r.micro_batches),
        "micro_batches": len(r0), "first_run_max": max(first_run, default=1.0)})
    ctx.free()


def _round(ctx, model, shape, runs: list[_Strategy], windows, s: int, cm, factor: float) -> None:
    """Step `s` of every strategy still running; one that fails is reported and the others go on."""
    for run in runs:
        if run.error is None:
            try:
                _one_step(ctx, model, shape, run, windows[s], s, cm, factor)
            except Exception as e:  # noqa: BLE001 - a strategy that fails here is reported, the others still run
                run.error = f"{type(e).__name__}: {e}"[:300]
            print(f"  step {s} {run.name:15s} {run.error or run.steps[-1]}", flush=True)


def _row(run: _Strategy) -> dict:
    if run.error is not None:
        return {"strategy": run.name, "error": run.error, "steps": len(run.steps)}
    col = {k: np.array([st[k] for st in run.steps], dtype=np.float64) for k in run.steps[0]}
    tokens, sim_meas = int(col["tokens"].sum()), float(col["sim_meas"].sum())
    return {"strategy": run.name, "steps": len(run.steps), "tokens": tokens,
            "micro_batches_per_rank": float(col["micro_batches"].mean()),
            "imbalance_measured": float(col["imb_meas"].mean()), "imbalance_predicted": float(col["imb_pred"].mean()),
            "step_time_measured_s": sim_meas, "step_time_predicted_s": float(col["sim_pred"].sum()),
            "tokens_per_s_measured": tokens / sim_meas if sim_meas > 0 else None,
            "first_run_slowdown_max": float(col["first_run_max"].max()), "rank0_first_step": run.rank0}


def _warm_up(ctx: Ctx, model: Layers, shape, cap: int) -> None:
    """First-launch costs out of the first timed step: one pack of the largest size and one slice (a pack whose
    queries attend to earlier keys, the path SlimPack's slices take)."""
    for q, p in (([cap], [0]), ([cap // 4], [cap // 2])):
        time_fwd_bwd(ctx, pack_runner(model, Pack(q, p, ctx.device, ctx.backend), shape, ctx.dtype), repeats=1, warmup=2)


def _strategies(st: dict, prof: PlanProfile, par: ParallelConfig) -> list[_Strategy]:
    runs = []
    for name in st["strategies"]:
        cfg = PlanConfig(strategy=name, parallel=par, max_tokens=st["cap"], context=st["cap"],
                         tokens_per_step=st["tokens_per_step"], model=prof.model, device=prof.device)
        runs.append(_Strategy(name, cfg))
        try:
            runs[-1].planner = make_planner(cfg)
        except Exception as e:  # noqa: BLE001 - reported in its row
            runs[-1].error = f"{type(e).__name__}: {e}"[:300]
    return runs


def run(ctx: Ctx, budget: Budget, out_dir) -> dict:
    st = setup(ctx.dry_run, ctx.quick)
    shape = ctx.main_shape()
    torch.manual_seed(ctx.seed)
    model = Layers(shape, LAYERS_TIMED).to(ctx.device, ctx.dtype)
    lengths = long_tail_lengths(200_000, ctx.seed, scale=st["scale"])
    windows = draw_windows(lengths, st["tokens_per_step"], st["cap"], st["max_steps"], incomplete=False).windows
    par = ParallelConfig(dp=st["dp"], pp=st["pp"])
    stage_layers = presets.layers_per_stage(presets.get_shape("llama2-7b"), par)
    factor = stage_layers / LAYERS_TIMED  # the timed layers -> one pipeline stage of Llama-2-7B
    prof = plan_profile(ctx, "llama2-7b", par, out_dir)
    _warm_up(ctx, model, shape, st["cap"])
    runs = _strategies(st, prof, par)
    with planner_warnings() as warnings:
        _round(ctx, model, shape, runs, windows, 0, prof.predict, factor)
        ok = [r for r in runs if r.error is None]
        steps = min(steps_for_budget(budget.left(), [r.step_s for r in ok], st["max_steps"]), len(windows))
        done = 1
        for s in range(1, steps):  # whole rounds only: every strategy times the same steps
            if s >= MIN_STEPS and budget.left() <= 0:
                break
            _round(ctx, model, shape, runs, windows, s, prof.predict, factor)
            done = s + 1
    rows = [_row(r) for r in runs]
    base = next((r for r in rows if r["strategy"] == "concat" and r.get("tokens_per_s_measured")), None)
    for r in rows:
        if base and r.get("tokens_per_s_measured"):
            r["speedup_vs_concat"] = r["tokens_per_s_measured"] / base["tokens_per_s_measured"]
    return {"setup": {k: v for k, v in st.items() if k != "strategies"}, "layers_timed": LAYERS_TIMED,
            "stage_layers": stage_layers, "steps": done, "steps_chosen": steps, "profile": prof.label,
            "plan_model": prof.model, "plan_device": prof.device, "planner_warnings": sorted(set(warnings))[:20],
            "rows": rows}
