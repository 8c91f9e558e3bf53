"""The report's per-document CP row (issue 26): where the layout has context parallelism (cp > 1, or cp_mode asks
for it), the dynamic-cp planner plans the same steps on the DP x CP pool, and a note says whether it beats the
fastest fixed-CP packloader plan once that plan's micro-batches pay their CP group's K/V all-gather too (the
cost model's CP scaling alone prices fixed CP's traffic as free, dynamic-cp's plans include theirs)."""

from __future__ import annotations

import msgspec

from packloader.balancers.cost.cp_price import fixed_with_comm
from packloader.balancers.cost.model import CostModel, annotate_costs
from packloader.balancers.factory import asks_for_pool, make_planner
from packloader.balancers.planners.doc_cp.price import DynamicCPCost
from packloader.balancers.planners.registry import planner_specs
from packloader.balancers.sim.metrics import score_plans
from packloader.contracts import PlanConfig, StepPlan
from packloader.report.advice import fits
from packloader.report.draw import Draw
from packloader.report.figures import StrategyFigures, strategy_figures
from packloader.report.run import StrategyRun, run_planner


def pool_planner() -> str:
    """The registered planner of per-document CP (the registry names planners; the report does not)."""
    return next(s.name for s in planner_specs() if s.cp_pool)


def wanted(config: PlanConfig) -> bool:
    return config.parallel.cp > 1 or asks_for_pool(config)


def _priced(plan: StepPlan, model: CostModel) -> StepPlan:
    if all(mb.fwd_cost > 0 or not mb.segments for r in plan.ranks for mb in r.micro_batches):
        return plan
    return annotate_costs(msgspec.structs.replace(plan, ranks=[msgspec.structs.replace(r) for r in plan.ranks]), model)


def fixed_with_traffic_rate(run: StrategyRun, model: CostModel, config: PlanConfig, comm) -> float:
    """Tokens per second of a fixed-CP run whose micro-batches also pay their CP all-gather."""
    plans = [fixed_with_comm(_priced(p, model), comm, config.parallel.cp, model.profile.cp_traffic) for p in run.plans]
    _, agg = score_plans(plans, model, config.parallel, schedule=config.schedule, use_plan_costs=True)
    return agg.tokens / agg.step_time_total if agg.step_time_total > 0 else 0.0


def dynamic_cp_row(config: PlanConfig, draw: Draw, model: CostModel, runs: dict[str, StrategyRun],
                   figs: list[StrategyFigures], memory=None) -> tuple[StrategyRun, StrategyFigures, str]:
    """The dynamic-cp run, its figures and the note comparing it with the fastest fixed-CP packloader plan that
    fits in memory (`memory`: the report's memory model)."""
    name = pool_planner()
    cfg = msgspec.structs.replace(config, strategy=name, cp_mode="dynamic")
    run = run_planner(lambda: make_planner(cfg), name, cfg, draw)
    run.name = name
    # its plans carry their own prices; packing efficiency against a GPU's share (max_tokens / cp), which also
    # bounds its memory as it bounds a fixed-CP GPU's
    per_gpu = msgspec.structs.replace(cfg, max_tokens=-(-cfg.max_tokens // cfg.parallel.cp))
    fig = strategy_figures(run, draw, model, per_gpu, None)
    if fig.status != "ok":
        return run, fig, f"per-document CP ({name}) could not plan these steps: {fig.note}"
    comm = DynamicCPCost.for_config(cfg).comm
    fixed = [f for f in figs if f.status == "ok" and f.role == "packloader" and f.name in runs and fits(f, memory)]
    rates = {f.name: fixed_with_traffic_rate(runs[f.name], model, config, comm) for f in fixed}
    if not rates:
        return run, fig, f"per-document CP ({name}): {fig.tokens_per_second / 1e3:,.0f}k tokens/s simulated"
    best = max(rates, key=rates.get)  # type: ignore[arg-type]
    ratio = fig.tokens_per_second / rates[best] if rates[best] > 0 else 0.0
    text = (f"per-document CP ({name}, each document on its own power-of-two subgroup of the {config.parallel.dp} x "
            f"{config.parallel.cp} GPUs): {fig.tokens_per_second / 1e3:,.0f}k tokens/s simulated, {ratio:.2f}x {best} at "
            f"fixed CP {config.parallel.cp} ({rates[best] / 1e3:,.0f}k tokens/s once its CP all-gather is priced too); ")
    if ratio > 1.0:
        text += ("it wins at these settings: set PlanConfig.cp_mode='dynamic' (or --cp-mode dynamic; a runtime that runs "
                 "per-document CP subgroups), or 'auto' to choose per step")
    else:
        text += "fixed CP stays faster at these settings"
    return run, fig, text
