"""Scores of a plan: how balanced it is, how fast the simulated step runs against the no-bubble ideal, how full
the micro-batches are, and how far it bent the data order.

Definitions (per step; `RunScores` aggregates a run):

* imbalance degree (WLB-LLM): ``max micro-batch cost x number of micro-batches / total cost`` over one DP
  rank's micro-batches (1.0 = perfectly even). `imbalance` is the worst rank's, `imbalance_mean` the mean over
  ranks, `imbalance_global` the same formula over every micro-batch of the step (it also sees DP imbalance),
  `imbalance_fwd` the worst rank's on forward cost alone (what WLB-LLM's table measures). Cost = forward +
  backward per pipeline stage from the cost model.
* DP spread: the slowest rank's simulated pipeline time / the mean rank's.
* step time: the slowest rank's simulated pipeline time (`simulator.simulate_step`, bubbles included).
* no-bubble ideal (`work_bound`, also `bound_time`): the step's total forward + backward cost (per stage)
  spread evenly over the dp ranks, ``total / dp``: what the step would take with every pipeline GPU busy all
  the time, the ideal a user pays for. efficiency = work_bound / step time (1.0 = no idle GPU time at all;
  pipeline fill and drain, imbalance and DP waiting all count against it).
* fill-credited bound (`fill_bound`, named as such wherever it is shown): the same work over m equal
  micro-batches per rank with the schedule's ideal fill, ``total / dp x (m + pp - 1) / m`` (interleaved:
  ``(m + (pp - 1) / vpp) / m``); `efficiency_fill` = fill_bound / step time. It credits the pipeline's fill
  and drain to the bound (at m = 32, pp = 4 it hides 8.6 % of idle time), so it is never the headline.
* bubble share: idle share of all dp x pp GPUs over the step (pipeline bubbles and DP waiting).
* packing efficiency: tokens / (micro-batch slots x max_tokens), a DP-Merge micro-batch counting n/g tokens
  on each of its g ranks' slots.
* delay (`token_delay`, the one definition the report, the benchmark and `auto`'s bound use): a token's delay
  is the number of steps between its document's draw and the step that trains it; `delay_mean` is the mean
  over all trained tokens (a token trained when drawn counts 0), `delay_max` the largest, `delay_share` the
  share of tokens with a delay above 0. Needs the draw step of each document (`drawn`: a mapping or array doc ->
  step, or the PlannerState the step was planned from, whose queue records draw steps); unknown documents
  count as drawn at the step that trains them.
* tokens split: tokens in slices (segments with attend_from < start) and the documents they belong to.
* tokens dropped / duplicated: from `verify.coverage` when the run's pieces are given (must be 0).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import msgspec
import numpy as np

from packloader.balancers.cost.model import CostModel, _per_rank
from packloader.balancers.cost.schedules import ORDER_1F1B, ORDER_INTERLEAVED
from packloader.balancers.sim.kernels import SCHEDULES, ZB_H1, ZB_V, step_times_ranks_sliced
from packloader.balancers.sim.simulator import plan_schedule, simulate_step, slice_edges_of
from packloader.balancers.sim.verify import coverage, owned_segments
from packloader.balancers.sim.weights import weight_times
from packloader.contracts import ParallelConfig, PlannerState, StepPlan


class PlanScores(msgspec.Struct, kw_only=True):
    step: int
    dp: int
    pp: int
    micro_batches: int  # per rank
    tokens: int
    imbalance: float
    imbalance_mean: float
    imbalance_global: float
    imbalance_fwd: float
    dp_spread: float
    step_time: float
    bound_time: float  # the no-bubble ideal (= work_bound)
    work_bound: float
    efficiency: float  # work_bound / step_time
    bubble_share: float
    packing_efficiency: float
    tokens_split: int
    docs_split: int
    tokens_delayed: int
    delay_share: float
    delay_mean: float
    delay_max: int
    delay_known: bool
    peak_bytes: float = 0.0
    imbalance_ranks: list[float] = []
    rank_times: list[float] = []
    fill_bound: float = 0.0  # fill-credited bound (module docstring)
    efficiency_fill: float = 0.0


class RunScores(msgspec.Struct, kw_only=True):
    steps: int
    tokens: int
    imbalance_mean: float
    imbalance_max: float
    imbalance_global_mean: float
    imbalance_fwd_mean: float
    dp_spread_mean: float
    dp_spread_max: float
    step_time_total: float
    bound_time_total: float  # sum of the no-bubble ideals
    efficiency: float  # sum of no-bubble ideals / sum of simulated step times
    efficiency_mean: float
    efficiency_min: float
    bubble_share_mean: float
    packing_efficiency: float  # token-weighted over the run
    tokens_split: int
    split_share: float
    tokens_delayed: int
    delay_share: float
    delay_mean: float
    delay_max: int
    peak_bytes: float = 0.0
    tokens_dropped: int = 0
    tokens_duplicated: int = 0
    tokens_extra: int = 0
    fill_bound_total: float = 0.0
    efficiency_fill: float = 0.0  # fill-credited: sum of fill bounds / sum of simulated step times


def _drawn_lookup(drawn, step: int):
    """doc -> draw step function from a mapping, an array indexed by doc, or a PlannerState."""
    if drawn is None:
        return None
    if isinstance(drawn, PlannerState):
        table = {q.doc: q.drawn_step for q in drawn.queued}
        return lambda d: table.get(d, step)
    if isinstance(drawn, np.ndarray):
        arr = drawn

        def look(d: int) -> int:
            if 0 <= d < len(arr) and arr[d] >= 0:
                return int(arr[d])
            return step

        return look
    if isinstance(drawn, Mapping):
        return lambda d: int(drawn.get(d, step))
    raise TypeError(f"drawn: expected a mapping, an array or a PlannerState, got {type(drawn).__name__}")


def drawn_steps(windows: Sequence, first_step: int = 0) -> dict[int, int]:
    """doc -> the step whose window first drew it, from the Windows of consecutive steps."""
    out: dict[int, int] = {}
    for k, w in enumerate(windows):
        for d in np.asarray(w.doc).tolist():
            out.setdefault(int(d), first_step + k)
    return out


def _unique_segments(plan: StepPlan):
    seen: set = set()
    for r, rank in enumerate(plan.ranks):
        for mb in rank.micro_batches:
            if mb.dp_group and len(mb.dp_group) > 1:
                key = (tuple(mb.dp_group), tuple(mb.segments))
                if key in seen:
                    continue
                seen.add(key)
            yield from owned_segments(mb, r)


def _fast_rank_times(plan: StepPlan, rank_f, rank_b, pp: int, vpp: int, schedule: str, models) -> np.ndarray:
    """Every rank's simulated time in one numba call (no memory tracking, default backward order)."""
    kind = SCHEDULES[schedule]
    if kind == ORDER_INTERLEAVED and vpp == 1:
        kind = ORDER_1F1B
    offsets = np.zeros(len(rank_f) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(f) for f in rank_f])
    e_off = [0]
    e_src: list[int] = []
    e_dst: list[int] = []
    for rank in plan.ranks:
        if any(sg.attend_from < sg.start for mb in rank.micro_batches for sg in mb.segments):
            edges, _ = slice_edges_of(rank.micro_batches)
            e_src.extend(edges[:, 0].tolist())
            e_dst.extend(edges[:, 1].tolist())
        e_off.append(len(e_src))
    f = np.concatenate(rank_f) if rank_f else np.zeros(0)
    b = np.concatenate(rank_b) if rank_b else np.zeros(0)
    w = np.zeros_like(b)
    if kind in (ZB_H1, ZB_V) and len(b):
        w = np.minimum(np.concatenate([weight_times(r.micro_batches, [models[i]])[0] for i, r in enumerate(plan.ranks)]), b)
    t = step_times_ranks_sliced(pp, vpp, kind, f, b, w, offsets, np.asarray(e_off, dtype=np.int64),
                                np.asarray(e_src, dtype=np.int64), np.asarray(e_dst, dtype=np.int64), 0.0)
    if (t < 0).any():
        raise RuntimeError(f"schedule {schedule!r} deadlocks for step {plan.step} (pp={pp}, vpp={vpp}); see simulator.simulate")
    return t


def _bound_fill(m: int, pp: int, vpp: int, schedule: str) -> float:
    if m <= 0:
        return 1.0
    if schedule in ("interleaved", "zb-v") and vpp > 1:
        return (m + (pp - 1) / vpp) / m
    return (m + pp - 1) / m


def _rank_costs(plan: StepPlan, models: list[CostModel], use_plan_costs: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Forward and backward time of every micro-batch, per DP rank (the plan's own costs, or the models')."""
    rank_f, rank_b = [], []
    for r, rank in enumerate(plan.ranks):
        if use_plan_costs:
            f = np.array([mb.fwd_cost for mb in rank.micro_batches], dtype=np.float64)
            b = np.array([mb.bwd_cost for mb in rank.micro_batches], dtype=np.float64)
        else:
            fb = [models[r].microbatch_times(mb) for mb in rank.micro_batches]
            f = np.array([x[0] for x in fb], dtype=np.float64)
            b = np.array([x[1] for x in fb], dtype=np.float64)
        rank_f.append(f)
        rank_b.append(b)
    return rank_f, rank_b


class _Counts(msgspec.Struct):
    slots: int = 0
    tokens_slots: float = 0.0  # tokens per slot, a DP-Merge micro-batch counting n/g on each member
    largest: int = 0
    tokens: int = 0  # each DP-Merge micro-batch once
    tokens_split: int = 0
    split_docs: set = set()
    delays: list = []  # (delay in steps, tokens)


def _token_counts(plan: StepPlan, look) -> _Counts:
    out = _Counts(split_docs=set(), delays=[])
    seen_groups: set = set()
    for r, rank in enumerate(plan.ranks):
        for mb in rank.micro_batches:
            g = len(mb.dp_group) if mb.dp_group else 1
            n = mb.num_tokens
            out.slots += 1
            if mb.cp is not None:  # per-document CP: this GPU holds its shard of each segment, owns some
                shard = sum(-(-(s.end - s.start) // c.size) for s, c in zip(mb.segments, mb.cp))
                out.tokens_slots += shard
                out.largest = max(out.largest, shard)
                _count_segments(out, owned_segments(mb, r), plan.step, look)
                continue
            out.tokens_slots += n / g
            out.largest = max(out.largest, -(-n // g))
            if g > 1:
                key = (tuple(mb.dp_group), tuple(mb.segments))
                if key in seen_groups:
                    continue
                seen_groups.add(key)
            _count_segments(out, mb.segments, plan.step, look)
    # a sliced piece's first slice has attend_from == start: count every segment of a slice chain
    if out.split_docs:
        unique = list(_unique_segments(plan))
        chains = {(sg.doc, sg.attend_from) for sg in unique if sg.attend_from < sg.start}
        out.tokens_split = sum(sg.end - sg.start for sg in unique if (sg.doc, sg.attend_from) in chains)
    return out


def _count_segments(out: _Counts, segments, step: int, look) -> None:
    for s in segments:
        k = s.end - s.start
        out.tokens += k
        if s.attend_from < s.start:
            out.tokens_split += k
            out.split_docs.add(s.doc)
        if look is not None:
            out.delays.append((step - look(s.doc), k))


def _imbalance(c: np.ndarray) -> float:
    """Largest over mean (1.0 for nothing to balance)."""
    return float(c.max() * len(c) / c.sum()) if len(c) and c.sum() > 0 else 1.0


def score_plan(
    plan: StepPlan,
    model: CostModel | Sequence[CostModel],
    parallel: ParallelConfig | None = None,
    *,
    max_tokens: int | None = None,
    schedule: str = "1f1b",
    drawn=None,
    memory=None,
    use_plan_costs: bool = False,
) -> PlanScores:
    """Scores of one step (see the module docstring). `model`: one CostModel or one per rank (RankCosts);
    `max_tokens` for packing efficiency (default: the model's memory cap, else the largest micro-batch)."""
    parallel = parallel or ParallelConfig(dp=len(plan.ranks))
    dp = len(plan.ranks)
    models = _per_rank(model, dp)
    pp, vpp = parallel.pp, parallel.vpp
    schedule = plan_schedule(plan, schedule, vpp)
    # a per-document CP plan is scored on its own costs: one RankPlan per pool GPU, each micro-batch priced by the
    # dynamic-cp planner with its CP traffic and the wait for its subgroups' slowest GPU (planners/doc_cp/price)
    use_plan_costs = use_plan_costs or plan.cp_mode == "dynamic"
    rank_f, rank_b = _rank_costs(plan, models, use_plan_costs)
    look = _drawn_lookup(drawn, plan.step)
    counts = _token_counts(plan, look)
    per_rank_imb = [_imbalance(f + b) for f, b in zip(rank_f, rank_b)]
    per_rank_imb_f = [_imbalance(f) for f in rank_f]
    allc = np.concatenate([f + b for f, b in zip(rank_f, rank_b)]) if rank_f else np.zeros(0)
    total = float(allc.sum())
    imb_global = float(allc.max() * len(allc) / total) if total > 0 else 1.0
    m = max((len(r.micro_batches) for r in plan.ranks), default=0)
    if memory is None and all(r.backward_order is None for r in plan.ranks):
        rank_times = _fast_rank_times(plan, rank_f, rank_b, pp, vpp, schedule, models)
        busy = pp * total
        peak = 0.0
    else:
        sim = simulate_step(plan, models, parallel, schedule=schedule, memory=memory, use_plan_costs=use_plan_costs)
        rank_times = sim.rank_times
        busy = sum(float(r.busy.sum()) for r in sim.ranks)
        peak = sim.peak_bytes
    step_t = float(rank_times.max()) if len(rank_times) else 0.0
    dp_spread = float(rank_times.max() / rank_times.mean()) if len(rank_times) and rank_times.mean() > 0 else 1.0
    work_bound = total / dp if dp else 0.0
    fill_bound = work_bound * _bound_fill(m, pp, vpp, schedule)
    cap = max_tokens or (models[0].memory_cap() if models else None) or counts.largest or 1
    delay = token_delay(counts.delays)
    return PlanScores(
        step=plan.step,
        dp=dp,
        pp=pp,
        micro_batches=m,
        tokens=counts.tokens,
        imbalance=max(per_rank_imb, default=1.0),
        imbalance_mean=float(np.mean(per_rank_imb)) if per_rank_imb else 1.0,
        imbalance_global=imb_global,
        imbalance_fwd=max(per_rank_imb_f, default=1.0),
        dp_spread=dp_spread,
        step_time=step_t,
        bound_time=work_bound,
        work_bound=work_bound,
        efficiency=work_bound / step_t if step_t > 0 else 1.0,
        # at 0, not -2.2e-16, when the busy time summed in another order rounds past the step time
        bubble_share=max(0.0, 1.0 - busy / (dp * pp * step_t)) if step_t > 0 else 0.0,
        packing_efficiency=counts.tokens_slots / (counts.slots * cap) if counts.slots else 0.0,
        tokens_split=counts.tokens_split,
        docs_split=len(counts.split_docs),
        tokens_delayed=delay.tokens_delayed,
        delay_share=delay.share,
        delay_mean=delay.mean,
        delay_max=delay.max,
        delay_known=look is not None,
        peak_bytes=peak,
        imbalance_ranks=per_rank_imb,
        rank_times=[float(t) for t in rank_times],
        fill_bound=fill_bound,
        efficiency_fill=fill_bound / step_t if step_t > 0 else 1.0,
    )


class TokenDelay(msgspec.Struct, frozen=True):
    """Delay in steps of trained tokens: mean over all of them (undelayed ones count 0) and max."""

    tokens: int
    tokens_delayed: int
    total: int  # sum over tokens of their delay, in token-steps
    max: int

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0

    @property
    def share(self) -> float:
        return self.tokens_delayed / self.tokens if self.tokens else 0.0


def token_delay(pairs: Iterable[tuple[int, int]]) -> TokenDelay:
    """The delay of (delay in steps, tokens) pairs, one per trained segment."""
    tokens = delayed = total = top = 0
    for d, k in pairs:
        if k <= 0:
            continue
        tokens += k
        total += d * k
        if d > 0:
            delayed += k
            top = max(top, d)
    return TokenDelay(tokens, delayed, total, top)


def aggregate(scores: Sequence[PlanScores], cov=None) -> RunScores:
    """A run's scores from its steps' (and, optionally, a verify.Coverage for dropped/duplicated tokens)."""
    if not scores:
        raise ValueError("aggregate needs at least one step's scores")
    tok = sum(s.tokens for s in scores)
    st = sum(s.step_time for s in scores)
    bd = sum(s.bound_time for s in scores)
    fb = sum(s.fill_bound for s in scores)
    slots_tokens = sum(s.packing_efficiency * s.micro_batches * s.dp for s in scores)
    slots = sum(s.micro_batches * s.dp for s in scores)
    delayed = sum(s.tokens_delayed for s in scores)
    return RunScores(
        steps=len(scores),
        tokens=tok,
        imbalance_mean=float(np.mean([s.imbalance for s in scores])),
        imbalance_max=max(s.imbalance for s in scores),
        imbalance_global_mean=float(np.mean([s.imbalance_global for s in scores])),
        imbalance_fwd_mean=float(np.mean([s.imbalance_fwd for s in scores])),
        dp_spread_mean=float(np.mean([s.dp_spread for s in scores])),
        dp_spread_max=max(s.dp_spread for s in scores),
        step_time_total=st,
        bound_time_total=bd,
        efficiency=bd / st if st > 0 else 1.0,
        efficiency_mean=float(np.mean([s.efficiency for s in scores])),
        efficiency_min=min(s.efficiency for s in scores),
        bubble_share_mean=float(np.mean([s.bubble_share for s in scores])),
        packing_efficiency=slots_tokens / slots if slots else 0.0,
        tokens_split=sum(s.tokens_split for s in scores),
        split_share=sum(s.tokens_split for s in scores) / tok if tok else 0.0,
        tokens_delayed=delayed,
        delay_share=delayed / tok if tok else 0.0,
        delay_mean=sum(s.delay_mean * s.tokens for s in scores) / tok if tok else 0.0,
        delay_max=max(s.delay_max for s in scores),
        peak_bytes=max(s.peak_bytes for s in scores),
        tokens_dropped=cov.missing_tokens if cov is not None else 0,
        tokens_duplicated=cov.duplicated_tokens if cov is not None else 0,
        tokens_extra=cov.extra_tokens if cov is not None else 0,
        fill_bound_total=fb,
        efficiency_fill=fb / st if st > 0 else 1.0,
    )


def score_plans(
    plans: Iterable[StepPlan],
    model: CostModel | Sequence[CostModel],
    parallel: ParallelConfig | None = None,
    *,
    max_tokens: int | None = None,
    schedule: str = "1f1b",
    drawn=None,
    pieces=None,
    final_state: PlannerState | None = None,
    memory=None,
    use_plan_costs: bool = False,
) -> tuple[list[PlanScores], RunScores]:
    """Score every step and the run. `drawn`: doc -> draw step for the whole run (mapping or array);
    `pieces` (+ `final_state`): the run's drawn pieces, to count dropped/duplicated tokens."""
    plans = list(plans)
    per = [
        score_plan(p, model, parallel, max_tokens=max_tokens, schedule=schedule, drawn=drawn, memory=memory, use_plan_costs=use_plan_costs)
        for p in plans
    ]
    cov = None
    if pieces is not None:
        cov = coverage(plans, pieces, final_state)
    return per, aggregate(per, cov)
