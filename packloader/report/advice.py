"""What the report recommends: the strategy, the micro-batch count and token cap, and a Hydraulis-style
heterogeneous grouping of data-parallel ranks, each backed by a simulation over the same drawn steps.

* Strategy, micro-batches and cap: a grid over every packloader strategy that ran, token caps (half, same,
  twice the current one, and the memory model's own cap when it lies between) and micro-batches per rank
  (the planner's choice, pp, 2pp, 4pp), each planned over the first few drawn steps (then drained, see
  run.py); the best few whose simulated peak memory fits the device are planned again over every drawn step,
  and the first that still fits is the advice, compared with the fastest baseline at the user's settings.
* Grouping (the Hydraulis paper, section 5's strategy proposal): merge g DP ranks into one group that runs
  context parallelism over g GPUs, so the group takes micro-batches g times as long (cap x g) at 1/g of the
  per-GPU work (ideal sharding; the per-micro-batch and per-segment floors do not shrink). k such groups plus
  the remaining plain ranks keep the GPU count. The registry's planner of heterogeneous ranks (`rank_costs`,
  Hydraulis' dispatch among the shipped ones) plans the step's pieces on this mix with one cost model and cap per
  rank. Each micro-batch of a merged group then pays its CP group's K/V all-gather (cp x g GPUs, priced from the
  device's `cp_link` as `fixed_with_comm` prices fixed CP's; plain ranks pay nothing new, as the fixed-CP rows),
  and the gain is that simulated time against the same planner on the homogeneous layout; a grouping is advised
  only where it is faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from packloader.balancers.cost import presets
from packloader.balancers.cost.cp_comm import CPComm, cp_comm_for
from packloader.balancers.cost.cp_price import fixed_with_comm, without_fixed_traffic
from packloader.balancers.cost.cp_shard_attention import scale_profile_to_cp
from packloader.balancers.cost.memory import memory_limit_bytes
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.resolve import RankCosts
from packloader.balancers.planners.registry import rank_costs_planner
from packloader.balancers.sim.metrics import score_plans
from packloader.balancers.sim.simulator import simulate_step
from packloader.contracts import ParallelConfig, PlanConfig, StepPlan
from packloader.report.draw import Draw
from packloader.report.figures import Advice, CapCandidate, GiB, GroupingCandidate, RankGroup, StrategyFigures
from packloader.report.run import run_planner, run_strategy


def fits(fig: StrategyFigures, memory) -> bool:
    lim = memory_limit_bytes(memory)
    return lim is None or not fig.peak_memory_gib or max(fig.peak_memory_gib) * GiB <= lim


def merged_model(model: CostModel, g: int, comm: CPComm | None = None) -> CostModel:
    """The cost of one of g GPUs running a micro-batch together as context parallelism: one GPU's share of it
    (`cost.cp_shard_attention.scale_profile_to_cp`: attention slopes and the linear part's tokens divided by g, floors and
    the per-document term kept), as fixed CP at cp x g prices it; without the CP traffic `model` carries
    (`cost.cp_price.without_fixed_traffic`, priced by `comm`): `with_group_traffic` adds the merged group's."""
    if g == 1:
        return model
    prof = model.profile
    if prof.cp_traffic > 1:
        if comm is None:
            raise ValueError(f"cost model {prof.name!r} carries CP {prof.cp_traffic}'s traffic: merged_model needs its comm")
        prof = without_fixed_traffic(prof, comm)
    pr = scale_profile_to_cp(prof, g)
    return CostModel(msgspec.structs.replace(pr, name=f"{model.profile.name}/cpx{g}"))


def with_group_traffic(plan: StepPlan, models: list[CostModel], k: int, comm: CPComm, size: int) -> StepPlan:
    """A copy of a grouping's plan priced by its ranks' models, whose first k ranks (the merged groups) also pay
    the K/V all-gather of a CP group of `size` GPUs on every micro-batch (`fixed_with_comm`)."""
    ranks = [msgspec.structs.replace(rank, micro_batches=[
        msgspec.structs.replace(mb, fwd_cost=f, bwd_cost=b)
        for mb, (f, b) in ((mb, models[r].microbatch_times(mb)) for mb in rank.micro_batches)])
        for r, rank in enumerate(plan.ranks)]
    merged = fixed_with_comm(msgspec.structs.replace(plan, ranks=ranks[:k]), comm, size)  # a fixed-CP plan
    return msgspec.structs.replace(plan, ranks=merged.ranks + ranks[k:])


def traffic_note(config: PlanConfig) -> str:
    """What the grouping's CP traffic is priced from (a profile JSON has no model shape: llama3-8b's)."""
    try:
        presets.get_shape(config.model)
        shape = f"{config.model}'s K/V"
    except (KeyError, ValueError):
        shape = f"llama3-8b's K/V: {config.model} carries no model shape"
    return (f"groupings pay their CP traffic: each merged micro-batch's K/V all-gather over its cp x g GPUs ({shape}), "
            f"priced from the {config.device} device's cp_link (estimated unless measured by `packloader calibrate --cp`)")


@dataclass
class _Eval:
    time: float
    tokens: int
    m: float
    peak: float  # bytes, max over stages of activations + static; 0 when unknown


def _evaluate(run, draw: Draw, model, parallel: ParallelConfig, config: PlanConfig, memory) -> _Eval:
    _, agg = score_plans(run.plans, model, parallel, max_tokens=config.max_tokens, schedule=config.schedule, drawn=draw.doc_step)
    regular = run.plans[: len(run.plans) - run.drain_steps] or run.plans
    m = float(np.mean([len(p.ranks[0].micro_batches) for p in regular]))
    peak = 0.0
    if memory is not None:
        for plan in run.plans:
            sim = simulate_step(plan, model, parallel, schedule=config.schedule, memory=memory)
            peak = max(peak, sim.peak_bytes)
    return _Eval(agg.step_time_total, agg.tokens, m, peak)


def grid_caps(config: PlanConfig, model: CostModel, memory) -> list[int]:
    """Token caps to try: half, the same, twice the current one, and the memory model's own cap when it lies
    between."""
    tile = model.profile.tile
    cap = config.max_tokens
    caps = {max(tile, cap // 2 // tile * tile), cap, cap * 2}
    if memory is not None:
        mc = memory.tokens_that_fit(tile=tile)
        if cap // 2 < mc < cap * 2:
            caps.add(mc)
    return sorted(caps)


def cap_grid(strategies: list[str], config: PlanConfig, draw: Draw, model: CostModel, memory, steps: int, tick=None) -> list[CapCandidate]:
    """Plan the first `steps` steps with each strategy, token cap and micro-batch count of the grid."""
    pp = config.parallel.pp
    counts = sorted({0, pp, 2 * pp, 4 * pp})
    lim = memory_limit_bytes(memory)
    out = []
    for strategy in strategies:
        for cap in grid_caps(config, model, memory):
            for m in counts:
                cfg = msgspec.structs.replace(config, max_tokens=cap, num_micro_batches=m or None)
                run = run_strategy(strategy, cfg, draw, steps=steps, warmup=False)
                cand = CapCandidate(strategy=strategy, max_tokens=cap, num_micro_batches=m, steps=len(run.plans))
                if not run.ok:
                    cand.note = run.error or ""
                    cand.fits_memory = False
                else:
                    try:
                        ev = _evaluate(run, draw, model, config.parallel, cfg, memory)
                    except Exception as e:  # e.g. a schedule this micro-batch count cannot run
                        cand.note, cand.fits_memory = f"{type(e).__name__}: {e}"[:300], False
                        out.append(cand)
                        continue
                    cand.step_time_total, cand.micro_batches_mean = ev.time, ev.m
                    cand.tokens_per_second = ev.tokens / ev.time if ev.time > 0 else 0.0
                    cand.peak_memory_gib = ev.peak / GiB
                    cand.fits_memory = lim is None or ev.peak <= lim
                    if not cand.fits_memory:
                        cand.note = f"needs {ev.peak / GiB:.0f} GiB, more than the {lim / GiB:.0f} GiB usable"
                out.append(cand)
                if tick is not None:
                    tick()
    return out


def confirm_candidate(cand: CapCandidate, figs: list[StrategyFigures], config: PlanConfig, draw: Draw, model: CostModel,
                      memory) -> CapCandidate:
    """The candidate planned over every drawn step (then drained); the user's own settings reuse the main run."""
    lim = memory_limit_bytes(memory)
    out = CapCandidate(strategy=cand.strategy, max_tokens=cand.max_tokens, num_micro_batches=cand.num_micro_batches, steps=draw.steps)
    same = cand.max_tokens == config.max_tokens and cand.num_micro_batches == 0
    fig = next((f for f in figs if f.name == cand.strategy and f.status == "ok"), None)
    if same and fig is not None:
        out.tokens_per_second, out.step_time_total = fig.tokens_per_second, fig.step_time_total
        out.micro_batches_mean = fig.micro_batches_mean
        out.peak_memory_gib = max(fig.peak_memory_gib) if fig.peak_memory_gib else 0.0
        out.fits_memory = fits(fig, memory)
    else:
        cfg = msgspec.structs.replace(config, max_tokens=cand.max_tokens, num_micro_batches=cand.num_micro_batches or None)
        run = run_strategy(cand.strategy, cfg, draw, warmup=False)
        if not run.ok:
            out.note, out.fits_memory = run.error or "", False
            return out
        try:
            ev = _evaluate(run, draw, model, config.parallel, cfg, memory)
        except Exception as e:
            out.note, out.fits_memory = f"{type(e).__name__}: {e}"[:300], False
            return out
        out.step_time_total, out.micro_batches_mean = ev.time, ev.m
        out.tokens_per_second = ev.tokens / ev.time if ev.time > 0 else 0.0
        out.peak_memory_gib = ev.peak / GiB
        out.fits_memory = lim is None or ev.peak <= lim
    if not out.fits_memory and not out.note:
        out.note = f"over all {draw.steps} steps it needs {out.peak_memory_gib:.0f} GiB"
    return out


def grouping_candidates(config: PlanConfig, draw: Draw, model: CostModel, baseline_tps: float | None,
                        homogeneous_time: float | None, max_candidates: int = 6, tick=None,
                        comm: CPComm | None = None) -> list[GroupingCandidate]:
    """Heterogeneous groupings (k groups of g merged DP ranks + plain ranks), each planned by the registry's
    planner of heterogeneous ranks with per-rank cost models and caps over all drawn steps (none without one),
    scored with the merged groups' CP traffic (`with_group_traffic`; `comm`: its price, default the config's
    model on its device)."""
    spec = rank_costs_planner()
    if spec is None:
        return []
    comm = comm or cp_comm_for(config.model, config.parallel, device=config.device)
    dp, cp, cap = config.parallel.dp, config.parallel.cp, config.max_tokens
    shapes = [(g, k) for g in (2, 4, 8) if g <= dp for k in range(1, dp // g + 1)]
    shapes = shapes[:max_candidates]
    out = []
    for g, k in shapes:
        plain = dp - k * g
        ranks = k + plain
        big = merged_model(model, g, comm)
        models = [big] * k + [model] * plain
        caps = [cap * g] * k + [cap] * plain
        par = msgspec.structs.replace(config.parallel, dp=ranks)
        cfg = msgspec.structs.replace(config, strategy=spec.name, parallel=par)
        groups = [RankGroup(count=k, gpus_per_group=g, cp=cp * g, max_tokens=cap * g)]
        if plain:
            groups.append(RankGroup(count=plain, gpus_per_group=1, cp=cp, max_tokens=cap))
        desc = f"{k} group{'s' if k > 1 else ''} of {g} DP ranks as CP={cp * g} with cap {cap * g:,}"
        desc += f" + {plain} plain rank{'s' if plain != 1 else ''} (cap {cap:,})" if plain else " (every rank merged)"
        cand = GroupingCandidate(groups=groups, description=desc, planner=spec.name)
        costs = RankCosts(models, caps)
        run = run_planner(lambda: spec.build(cfg, costs), spec.name, cfg, draw, warmup=False)
        if tick is not None:
            tick()
        if not run.ok:
            cand.note = run.error or ""
            out.append(cand)
            continue
        try:
            plans = [with_group_traffic(p, models, k, comm, cp * g) for p in run.plans]
            _, agg = score_plans(plans, models, par, max_tokens=cap, schedule=config.schedule, drawn=draw.doc_step,
                                 use_plan_costs=True)
        except Exception as e:
            cand.note = f"{type(e).__name__}: {e}"[:300]
            out.append(cand)
            continue
        cand.step_time_total = agg.step_time_total
        if homogeneous_time:
            cand.gain_vs_homogeneous = homogeneous_time / agg.step_time_total
        if baseline_tps:
            cand.gain_vs_baseline = agg.tokens / agg.step_time_total / baseline_tps
        out.append(cand)
    return out


def advise_grouping(cands: list[GroupingCandidate], homogeneous_time: float | None) -> tuple[GroupingCandidate | None, list[str]]:
    """The fastest grouping with plain ranks left, and notes; with its CP traffic priced, a grouping is advised
    only where it beats the homogeneous layout (any that runs when that layout cannot)."""
    faster = [c for c in cands if c.step_time_total > 0 and (not homogeneous_time or c.step_time_total < homogeneous_time)]
    mixed = [c for c in faster if len(c.groups) > 1]
    merged = [c for c in faster if len(c.groups) == 1]
    pick = min(mixed, key=lambda c: c.step_time_total) if mixed else None
    notes = []
    if merged:
        top = min(merged, key=lambda c: c.step_time_total)
        if pick is None or top.step_time_total < pick.step_time_total:
            vs = (f"{top.gain_vs_homogeneous:.2f}x {top.homogeneous()}" if top.gain_vs_homogeneous
                  else f"{top.gain_vs_baseline:.2f}x the fastest baseline")
            notes.append(f"merging every rank ({top.description}) simulates faster still: {vs}")
    if cands and not faster:
        notes.append("no grouping simulates faster than the homogeneous layout once its CP traffic is priced")
    return pick, notes


def recommend(figs: list[StrategyFigures], config: PlanConfig, draw: Draw, model: CostModel, memory,
              *, grid_steps: int = 4, grouping: bool = True, progress: bool = False) -> Advice | None:
    """The advice block (None when no packloader strategy ran)."""
    from tqdm.auto import tqdm

    with tqdm(desc="advice", unit="plan", disable=not progress, leave=False, dynamic_ncols=True) as bar:
        return _recommend(figs, config, draw, model, memory, grid_steps, grouping, bar.update)


def _recommend(figs, config, draw, model, memory, grid_steps, grouping, tick, confirm: int = 3) -> Advice | None:
    ours = [f for f in figs if f.role == "packloader" and f.status == "ok"]
    bases = [f for f in figs if f.role == "baseline" and f.status == "ok"]
    if not ours:
        return None
    notes = []
    for f in ours:
        if not fits(f, memory):
            notes.append(f"{f.name} peaks at {max(f.peak_memory_gib):.0f} GiB on one GPU at cap {config.max_tokens:,}: "
                         f"more than the device holds")
    steps = min(grid_steps, draw.steps)
    grid = cap_grid([f.name for f in ours], config, draw, model, memory, steps, tick)
    base = max(bases, key=lambda f: f.tokens_per_second) if bases else None
    base_tps = base.tokens_per_second if base else 0.0
    # the grid is a filter over the first steps; its best candidates are confirmed over every drawn step
    # (a later step may need more memory), and the first that still fits is the advice
    ranked = sorted((c for c in grid if c.fits_memory and c.tokens_per_second > 0), key=lambda c: -c.tokens_per_second)
    confirmed: list[CapCandidate] = []
    pick = None
    for cand in ranked[:confirm]:
        full = confirm_candidate(cand, figs, config, draw, model, memory)
        confirmed.append(full)
        if tick is not None:
            tick()
        if full.fits_memory and full.tokens_per_second > 0:
            pick = full
            break
    if pick is not None:
        fig = next(f for f in ours if f.name == pick.strategy)
        m = pick.num_micro_batches or int(round(pick.micro_batches_mean))
        pinned, mean = bool(pick.num_micro_batches), pick.micro_batches_mean
        sp = pick.tokens_per_second / base_tps if base_tps else 1.0
        reason = (f"the highest simulated throughput that fits in memory: {pick.tokens_per_second:,.0f} tokens/s over "
                  f"all {draw.steps} steps with cap {pick.max_tokens:,} and "
                  f"{'its own choice of micro-batches' if not pick.num_micro_batches else f'{m} micro-batches per rank'}")
        cap, strategy = pick.max_tokens, pick.strategy
    else:
        notes.append("no strategy and cap of the grid fits the device's memory over all steps: lower --max-tokens or raise "
                     "tp/pp/cp; the advice below ignores memory")
        fig = max(ours, key=lambda f: f.tokens_per_second)
        m, cap, strategy = int(round(fig.micro_batches_mean)), config.max_tokens, fig.name
        pinned, mean = config.num_micro_batches is not None, fig.micro_batches_mean
        sp = fig.tokens_per_second / base_tps if base_tps else 1.0
        reason = f"the highest simulated throughput at your settings ({fig.tokens_per_second:,.0f} tokens/s)"
    if base:
        reason += f", {sp:.2f}x the fastest baseline ({base.name}) at your settings"
        if pick is not None and (pick.max_tokens, pick.num_micro_batches or None) != (config.max_tokens, config.num_micro_batches):
            # the table and summary.png show the strategy at the user's settings: say how the two figures relate
            reason += (f" (the table's {fig.name} column, at your cap {config.max_tokens:,}: "
                       f"{fig.tokens_per_second / base_tps:.2f}x)")
    if fig.delay_share > 0:
        reason += f"; at your settings it trains {fig.delay_share:.1%} of tokens later than drawn (delay mean {fig.delay_mean:.2f} steps over all tokens, max {fig.delay_max})"
    if fig.tokens_split:
        reason += f"; it slices {fig.split_share:.1%} of tokens (needs the sliced runtime)"
    advice = Advice(strategy=strategy, reason=reason, num_micro_batches=m, max_tokens=cap, speedup_vs_baseline=sp,
                    micro_batches_pinned=pinned, micro_batches_mean=mean,
                    baseline=base.name if base else "", notes=notes, cap_grid=grid, grid_steps=steps,
                    baseline_tokens_per_second=base_tps, confirmed=confirmed,
                    tokens_per_second=pick.tokens_per_second if pick is not None else fig.tokens_per_second)
    if grouping and config.parallel.dp >= 2:
        spec = rank_costs_planner()
        homo = next((f for f in figs if spec is not None and f.name == spec.name and f.status == "ok"), None)
        cands = grouping_candidates(config, draw, model, base.tokens_per_second if base else None,
                                    homo.step_time_total if homo else None, tick=tick)
        advice.grouping_candidates = cands
        advice.grouping, more = advise_grouping(cands, homo.step_time_total if homo else None)
        notes += more
        if cands:
            notes.append(traffic_note(config))
    return advice
