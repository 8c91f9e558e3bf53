"""Part 5, balance on real time: one long-tail corpus planned for DP 8 / PP 4 by `fixed`, `auto` and today's
packers (`concat`, `multipack`, `karmarkar_karp`); every micro-batch of every DP rank is timed (forward +
backward of a few Llama layers, gpu_model.py), up to 20 steps within the part's budget. Reported per strategy:
the measured imbalance degree of rank 0 (max micro-batch time x micro-batches / total, per step) against the
cost model's, and the DP 8 / PP 4 step time simulated from the measured times (the plan's pipeline schedule,
`simulate_step` with the measured costs; times scaled from the timed layers to a stage's layers), against the
same simulation priced by the cost model (the measured H100 profile for the stage, LM head left out as in the
timed layers)."""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from gpu_common import Budget, Ctx, long_tail_lengths, time_fwd_bwd
from gpu_model import Layers, Pack, pack_runner

from packloader.balancers.cost import presets
from packloader.balancers.cost.measured import measured_profile
from packloader.balancers.cost.model import CostModel
from packloader.balancers.draw import draw_windows
from packloader.balancers.planners.registry import make_planner
from packloader.balancers.sim.simulator import simulate_step
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

STRATEGIES = ("fixed", "auto", "concat", "multipack", "karmarkar_karp")
LAYERS_TIMED = 2


def setup(dry: bool) -> dict:
    if dry:
        return {"dp": 2, "pp": 2, "cap": 64, "tokens_per_step": 512, "steps": 1, "scale": 1 / 256,
                "strategies": ("fixed", "auto", "concat")}
    return {"dp": 8, "pp": 4, "cap": 16384, "tokens_per_step": 524288, "steps": 20, "scale": 1.0,
            "strategies": STRATEGIES}


def _imbalance(t: np.ndarray) -> float:
    return float(t.max() * len(t) / t.sum()) if len(t) and t.sum() > 0 else 1.0


def _time_plan(ctx: Ctx, model: Layers, plan, shape) -> dict[int, tuple[float, float]]:
    """Measured (fwd, bwd) of every micro-batch of the step, by id(); a DP-Merge micro-batch is timed once and
    each of its g ranks is charged 1/g (its share when run as context parallelism)."""
    out = {}
    for rank in plan.ranks:
        for mb in rank.micro_batches:
            if id(mb) in out or not mb.segments:
                out.setdefault(id(mb), (0.0, 0.0))
                continue
            q = [s.end - s.start for s in mb.segments]
            p = [s.start - s.attend_from for s in mb.segments]
            f, b = time_fwd_bwd(ctx, pack_runner(model, Pack(q, p, ctx.device, ctx.backend), shape, ctx.dtype),
                                repeats=1, warmup=0)
            g = len(mb.dp_group) if mb.dp_group else 1
            out[id(mb)] = (f / g, b / g)
    return out


def _one_strategy(ctx, model, shape, cfg_kw, strategy, windows, share: Budget, factor: float) -> dict:
    cfg = PlanConfig(strategy=strategy, **cfg_kw)
    # the planner prices with its own model; the prediction set against the measurement leaves out the LM head,
    # as the timed layers do
    cm = CostModel(measured_profile(presets.get_shape(cfg.model), cfg.parallel, include_head=False))
    planner, state = make_planner(cfg), PlannerState()
    imb_meas, imb_pred, sim_meas, sim_pred, tokens = [], [], [], [], 0
    for s, w in enumerate(windows):
        if share.left() <= 0:
            break
        plan, state = planner.plan(w, state, s)
        times = _time_plan(ctx, model, plan, shape)
        r0 = plan.ranks[0].micro_batches
        imb_meas.append(_imbalance(np.array([sum(times[id(mb)]) for mb in r0])))
        imb_pred.append(_imbalance(np.array([sum(cm.microbatch_times(mb)) for mb in r0])))
        sim_pred.append(simulate_step(plan, cm, cfg.parallel).step_time)
        measured = msgspec.convert(msgspec.to_builtins(plan), type(plan))  # a copy whose costs are the measured ones
        for rank, mrank in zip(plan.ranks, measured.ranks):
            for mb, mmb in zip(rank.micro_batches, mrank.micro_batches):
                mmb.fwd_cost, mmb.bwd_cost = (t * factor for t in times[id(mb)])
        sim_meas.append(simulate_step(measured, cm, cfg.parallel, use_plan_costs=True).step_time)
        tokens += sum(mb.num_tokens for r in plan.ranks for mb in r.micro_batches)
        ctx.free()
    return {"strategy": strategy, "steps": len(imb_meas), "tokens": tokens,
            "imbalance_measured": float(np.mean(imb_meas)) if imb_meas else None,
            "imbalance_predicted": float(np.mean(imb_pred)) if imb_pred else None,
            "step_time_measured_s": float(np.sum(sim_meas)), "step_time_predicted_s": float(np.sum(sim_pred)),
            "tokens_per_s_measured": tokens / float(np.sum(sim_meas)) if sim_meas else None}


def run(ctx: Ctx, budget: Budget, out_dir) -> dict:
    st = setup(ctx.dry_run)
    shape = ctx.main_shape()
    torch.manual_seed(ctx.seed)
    model = Layers(shape, LAYERS_TIMED).to(ctx.device, ctx.dtype)
    lengths = long_tail_lengths(200_000, ctx.seed, scale=st["scale"])
    windows = draw_windows(lengths, st["tokens_per_step"], st["cap"], st["steps"], incomplete=False).windows
    par = ParallelConfig(dp=st["dp"], pp=st["pp"])
    stage_layers = presets.layers_per_stage(presets.get_shape("llama2-7b"), par)
    factor = stage_layers / LAYERS_TIMED  # the timed layers -> one pipeline stage of Llama-2-7B
    cfg_kw = {"parallel": par, "max_tokens": st["cap"], "context": st["cap"], "tokens_per_step": st["tokens_per_step"],
              "model": "llama2-7b"}
    # warm up the kernels on one pack of the largest size (first-launch costs stay out of the first strategy)
    time_fwd_bwd(ctx, pack_runner(model, Pack([st["cap"]], [0], ctx.device, ctx.backend), shape, ctx.dtype), repeats=1, warmup=2)
    rows = []
    strategies = st["strategies"]
    for i, name in enumerate(strategies):
        share = Budget(budget.left() / (len(strategies) - i))
        try:
            rows.append(_one_strategy(ctx, model, shape, cfg_kw, name, windows, share, factor))
        except Exception as e:  # noqa: BLE001 - a strategy that fails here is reported, the others still run
            rows.append({"strategy": name, "error": f"{type(e).__name__}: {e}"[:300]})
        print(f"  {name:15s} {rows[-1]}")
    base = next((r for r in rows if r["strategy"] == "concat" and r.get("tokens_per_s_measured")), None)
    for r in rows:  # tokens per simulated second: comparable where a budget cut leaves different step counts
        if base and r.get("tokens_per_s_measured"):
            r["speedup_vs_concat"] = r["tokens_per_s_measured"] / base["tokens_per_s_measured"]
    return {"setup": {k: v for k, v in st.items() if k != "strategies"}, "layers_timed": LAYERS_TIMED,
            "stage_layers": stage_layers, "rows": rows}
