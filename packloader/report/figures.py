"""Every figure the report shows, as msgspec Structs (the JSON file is `Report` encoded), and the code that
computes a strategy's figures from its plans with the shared scores (`balancers.metrics`), the pipeline
simulator's memory timeline (`balancers.simulator`, `balancers.memory`) and token accounting
(`balancers.verify`).

Units: times in seconds (the cost model's unit; the table shows milliseconds), memory in GiB, shares as
fractions of 1.
"""

from __future__ import annotations

import msgspec
import numpy as np

from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.registry import Window
from packloader.balancers.sim.metrics import aggregate, score_plans
from packloader.balancers.sim.simulator import simulate_step
from packloader.balancers.sim.verify import coverage
from packloader.contracts import ParallelConfig, PlanConfig
from packloader.report.draw import Draw
from packloader.report.run import StrategyRun, describe

GiB = 1024.0**3
REPORT_VERSION = 1


class Settings(msgspec.Struct, kw_only=True):
    input: str
    tokenizer: str | None
    model: str
    cost_profile: str
    device: str
    dp: int
    pp: int
    cp: int
    tp: int
    vpp: int
    schedule: str
    gpus: int
    tokens_per_step: int
    max_tokens: int
    context: int
    steps: int
    seed: int
    memory_cap_tokens: int | None = None  # the memory model's token cap for this layout (None: unknown)


class LengthStats(msgspec.Struct, kw_only=True):
    documents: int
    tokens: int
    mean: float
    median: float
    p90: float
    p99: float
    max: int
    empty_documents: int  # left out, as the loader does
    documents_cut: int  # longer than --context, cut into pieces
    pieces: int
    # the longest documents holding `long_doc_share` of documents carry `long_attention_share` of attention work
    long_threshold: int
    long_doc_share: float
    long_token_share: float
    long_attention_share: float


class StepFigures(msgspec.Struct, kw_only=True):
    step: int
    drain: bool = False  # an extra flushed step after the drawn ones (trains what outlier delay still held)
    tokens: int
    micro_batches: int  # per DP rank
    imbalance: float  # worst rank's max micro-batch cost x micro-batches / total
    imbalance_global: float
    dp_spread: float
    step_time: float
    bound_time: float
    efficiency: float
    bubble_share: float
    packing_efficiency: float
    tokens_delayed: int
    tokens_split: int
    plan_seconds: float
    peak_activation_gib: list[float] = []  # per pipeline stage, max over DP ranks


class StrategyFigures(msgspec.Struct, kw_only=True):
    name: str
    role: str  # "baseline" or "packloader"
    description: str
    status: str  # "ok" or "skipped"
    note: str = ""
    steps: int = 0  # drawn steps
    drain_steps: int = 0  # extra flushed steps that trained what was still queued after the drawn ones
    tokens_drawn: int = 0
    tokens_planned: int = 0  # drain steps included
    tokens_queued_at_end: int = 0  # held back by outlier delay after the last drawn step (then drained)
    tokens_left_queued: int = 0  # still queued after the drain steps (0 unless a planner never lets go)
    tokens_dropped: int = 0
    tokens_duplicated: int = 0
    micro_batches_mean: float = 0.0  # per DP rank per step
    imbalance_mean: float = 0.0
    imbalance_max: float = 0.0
    imbalance_global_mean: float = 0.0
    dp_spread_mean: float = 0.0
    dp_spread_max: float = 0.0
    step_time_mean: float = 0.0  # over the drawn steps
    step_time_total: float = 0.0  # drain steps included: the time to train every drawn token
    bound_time_total: float = 0.0
    efficiency: float = 0.0  # the no-bubble ideal / simulated time, over the run
    efficiency_fill: float = 0.0  # the fill-credited bound / simulated time, over the run
    tokens_per_second: float = 0.0  # tokens trained / simulated time, all GPUs together
    # baseline name -> this strategy's tokens_per_second / the baseline's: the step-time ratio corrected for
    # tokens a strategy holds back past the last step (outlier delay) or trains in addition
    speedup: dict[str, float] = {}
    bubble_share_mean: float = 0.0
    peak_activation_gib: list[float] = []  # per pipeline stage, max over ranks and steps
    peak_memory_gib: list[float] = []  # the same plus weights, gradients and optimizer state
    packing_efficiency: float = 0.0
    tokens_delayed: int = 0
    delay_share: float = 0.0
    delay_mean: float = 0.0  # steps, over all tokens (metrics.token_delay)
    delay_max: int = 0
    tokens_split: int = 0
    split_share: float = 0.0
    plan_ms_mean: float = 0.0
    plan_ms_max: float = 0.0
    per_step: list[StepFigures] = []


class CapCandidate(msgspec.Struct, kw_only=True):
    strategy: str
    max_tokens: int
    num_micro_batches: int  # 0: the planner's own choice
    steps: int
    step_time_total: float = 0.0
    tokens_per_second: float = 0.0
    micro_batches_mean: float = 0.0
    peak_memory_gib: float = 0.0
    fits_memory: bool = True
    note: str = ""


class RankGroup(msgspec.Struct, kw_only=True):
    count: int  # how many such groups
    gpus_per_group: int  # DP ranks merged into one group (context parallelism x this)
    cp: int
    max_tokens: int


class GroupingCandidate(msgspec.Struct, kw_only=True):
    groups: list[RankGroup]
    description: str
    step_time_total: float = 0.0
    gain_vs_homogeneous: float = 0.0  # the same planner's homogeneous time / this time (same steps, same tokens)
    gain_vs_baseline: float = 0.0  # this throughput / the fastest baseline's
    note: str = ""
    planner: str = ""  # the registry's planner of heterogeneous ranks that planned it (`rank_costs`)

    def homogeneous(self) -> str:
        """The layout the gain is measured against, for the text."""
        return f"the homogeneous {self.planner} layout" if self.planner else "the homogeneous layout"


class Advice(msgspec.Struct, kw_only=True):
    strategy: str
    reason: str
    num_micro_batches: int  # pinned: the setting; else the planner's own choice, rounded mean per rank and step
    max_tokens: int
    speedup_vs_baseline: float
    baseline: str
    tokens_per_second: float = 0.0  # the advice over every drawn step
    grid_steps: int = 0  # the cap grid planned this many drawn steps (then drained)
    baseline_tokens_per_second: float = 0.0  # the fastest baseline over every drawn step at the user's settings
    cap_grid: list[CapCandidate] = []
    confirmed: list[CapCandidate] = []  # the grid's best, planned over every drawn step, until one fits
    grouping: GroupingCandidate | None = None
    grouping_candidates: list[GroupingCandidate] = []
    notes: list[str] = []
    micro_batches_pinned: bool = False  # the advice sets PlanConfig.num_micro_batches (else: leave it None)
    micro_batches_mean: float = 0.0  # micro-batches per DP rank per step, mean over the steps, as advised

    def settings_text(self) -> str:
        """The advised settings as settings: a mean of the planner's own per-step choices is not one."""
        if self.micro_batches_pinned:
            mbs = f"num_micro_batches={self.num_micro_batches} (--micro-batches {self.num_micro_batches})"
        else:
            mbs = (f"num_micro_batches left to the planner (None: {self.strategy} picks a count each step; "
                   f"{self.micro_batches_mean:.1f} per DP rank on average here)")
        return f"strategy={self.strategy}, max_tokens={self.max_tokens:,}, {mbs}"

    def grouping_text(self) -> str:
        """The grouping advice spelt out: what changes, what its gains compare, and where it stands against the
        strategy advised above, so the line, the table and summary.png tell one story."""
        g = self.grouping
        if g is None:
            return ""
        planner = g.planner or "the planner of heterogeneous ranks"
        out = f"{g.description}, the same GPUs, planned by {planner}: "
        if g.gain_vs_homogeneous:
            out += f"{g.gain_vs_homogeneous:.2f}x {planner} on your layout unchanged (the table's {planner} column)"
        else:
            out += (f"{planner} on your layout unchanged has no plan of these steps to compare (not in --strategies, or "
                    "skipped: see above), this grouping has")
        if g.gain_vs_baseline:
            base = f" ({self.baseline})" if self.baseline else ""
            out += f", {g.gain_vs_baseline:.2f}x the fastest baseline{base}"
            if self.speedup_vs_baseline and g.gain_vs_baseline < self.speedup_vs_baseline:
                out += (f"; that is below strategy {self.strategy} as advised above ({self.speedup_vs_baseline:.2f}x): "
                        f"the grouping pays only for a trainer that runs {planner}")
        return out


class Report(msgspec.Struct, kw_only=True):
    version: int = REPORT_VERSION
    settings: Settings
    lengths: LengthStats
    reference_baseline: str  # the baseline the plots and advice compare against
    strategies: list[StrategyFigures]
    advice: Advice | None = None
    timeline_step: int = 0
    notes: list[str] = []
    files: dict[str, str] = {}


# ----------------------------------------------------------------------------------------------- computing


def length_stats(draw: Draw, model: CostModel, empty: int = 0) -> LengthStats:
    """Summary of the drawn documents, and how much of the attention work the longest ones carry."""
    lens = draw.lengths
    pieces = draw.pieces()
    share_docs, share_tokens, share_attn, thr = long_tail(lens, pieces.doc, pieces.length, model)
    return LengthStats(
        documents=len(lens), tokens=int(lens.sum()), mean=float(lens.mean()), median=float(np.median(lens)),
        p90=float(np.percentile(lens, 90)), p99=float(np.percentile(lens, 99)), max=int(lens.max()),
        empty_documents=int(empty), documents_cut=draw.docs_cut, pieces=len(pieces.length),
        long_threshold=thr, long_doc_share=share_docs, long_token_share=share_tokens, long_attention_share=share_attn,
    )


def attention_work(model: CostModel, piece_lengths: np.ndarray) -> np.ndarray:
    """Forward + backward attention time of each piece as a whole causal segment."""
    q = np.asarray(piece_lengths, dtype=np.int64)
    f, b = model.segment_times(q, np.zeros_like(q))
    return f + b


def doc_attention(lengths: np.ndarray, piece_doc: np.ndarray, piece_len: np.ndarray, model: CostModel) -> np.ndarray:
    """Attention work per document (sum over its pieces), indexed like `lengths` (doc ids 0..n-1)."""
    return np.bincount(piece_doc, weights=attention_work(model, piece_len), minlength=len(lengths))


def long_tail(lengths: np.ndarray, piece_doc: np.ndarray, piece_len: np.ndarray, model: CostModel, top: float = 0.1):
    """(document share, token share, attention share, threshold) of the longest `top` of documents."""
    if len(lengths) == 0:
        return 0.0, 0.0, 0.0, 0
    attn = doc_attention(lengths, piece_doc, piece_len, model)
    thr = int(np.quantile(lengths, 1.0 - top, method="lower"))
    sel = lengths > thr
    if not sel.any():
        sel = lengths >= thr
    tot_attn = float(attn.sum()) or 1.0
    return (float(sel.mean()), float(lengths[sel].sum() / lengths.sum()), float(attn[sel].sum() / tot_attn), thr)


def memory_peaks(run: StrategyRun, model: CostModel, parallel: ParallelConfig, schedule: str, memory) -> tuple[list[list[float]], list[float]]:
    """Per step, the peak activation bytes of each pipeline stage (max over DP ranks); and each stage's static
    bytes (weights, gradients, optimizer state). Empty lists without a memory model."""
    if memory is None:
        return [], []
    per_step = []
    static = [float(memory.static_bytes(s)) for s in range(parallel.pp)]
    for plan in run.plans:
        sim = simulate_step(plan, model, parallel, schedule=schedule, memory=memory)
        act = np.max(np.stack([r.peak_bytes - r.static_bytes for r in sim.ranks]), axis=0)
        per_step.append([float(x) for x in act])
    return per_step, static


def strategy_figures(run: StrategyRun, draw: Draw, model: CostModel, config: PlanConfig, memory=None) -> StrategyFigures:
    """Figures of one strategy's run over the drawn steps (a skipped run keeps only its note)."""
    fig = StrategyFigures(name=run.name, role=run.role, description=describe(run.name),
                          status="ok" if run.ok else "skipped", note=run.error or "")
    if not run.ok:
        return fig
    if not run.plans:
        fig.status, fig.note = "skipped", "planned no steps"
        return fig
    parallel = config.parallel
    regular = len(run.plans) - run.drain_steps
    steps = draw.windows[:regular]
    pieces = Window(
        np.concatenate([w.doc for w in steps]), np.concatenate([w.offset for w in steps]), np.concatenate([w.length for w in steps])
    )
    per, agg = score_plans(run.plans, model, parallel, max_tokens=config.max_tokens, schedule=config.schedule,
                           drawn=draw.doc_step)
    cov = coverage(run.plans, pieces, run.final_state)
    act, static = memory_peaks(run, model, parallel, config.schedule, memory)
    fig.steps, fig.drain_steps = regular, run.drain_steps
    fig.tokens_drawn = int(pieces.length.sum())
    fig.tokens_planned = int(cov.planned_tokens)
    fig.tokens_queued_at_end = int(run.queued_at_end)
    fig.tokens_left_queued = int(cov.queued_tokens)
    fig.tokens_dropped = int(cov.missing_tokens)
    fig.tokens_duplicated = int(cov.duplicated_tokens)
    fig.micro_batches_mean = float(np.mean([s.micro_batches for s in per[:regular]]))
    drawn = aggregate(per[:regular])  # balance figures over the drawn steps (a drain step is atypical)
    fig.imbalance_mean, fig.imbalance_max = drawn.imbalance_mean, drawn.imbalance_max
    fig.imbalance_global_mean = drawn.imbalance_global_mean
    fig.dp_spread_mean, fig.dp_spread_max = drawn.dp_spread_mean, drawn.dp_spread_max
    fig.step_time_total, fig.bound_time_total = agg.step_time_total, agg.bound_time_total
    fig.step_time_mean = float(np.mean([s.step_time for s in per[:regular]]))
    fig.efficiency, fig.efficiency_fill = agg.efficiency, agg.efficiency_fill
    fig.tokens_per_second = fig.tokens_planned / agg.step_time_total if agg.step_time_total > 0 else 0.0
    fig.bubble_share_mean = drawn.bubble_share_mean
    if act:
        peak_act = np.max(np.asarray(act), axis=0)
        fig.peak_activation_gib = [float(x / GiB) for x in peak_act]
        fig.peak_memory_gib = [float((a + s) / GiB) for a, s in zip(peak_act, static)]
    fig.packing_efficiency = drawn.packing_efficiency
    fig.tokens_delayed = agg.tokens_delayed
    fig.delay_share, fig.delay_mean = agg.delay_share, agg.delay_mean
    fig.delay_max = agg.delay_max
    fig.tokens_split, fig.split_share = agg.tokens_split, agg.split_share
    ms = np.asarray(run.plan_seconds) * 1e3
    fig.plan_ms_mean, fig.plan_ms_max = float(ms.mean()), float(ms.max())
    fig.per_step = [
        StepFigures(
            step=s.step, drain=k >= regular, tokens=s.tokens, micro_batches=s.micro_batches, imbalance=s.imbalance,
            imbalance_global=s.imbalance_global, dp_spread=s.dp_spread, step_time=s.step_time,
            bound_time=s.bound_time, efficiency=s.efficiency, bubble_share=s.bubble_share,
            packing_efficiency=s.packing_efficiency, tokens_delayed=s.tokens_delayed, tokens_split=s.tokens_split,
            plan_seconds=float(run.plan_seconds[k]),
            peak_activation_gib=[float(x / GiB) for x in act[k]] if act else [],
        )
        for k, s in enumerate(per)
    ]
    return fig


def fill_speedups(figs: list[StrategyFigures]) -> None:
    """speedup[b] = this strategy's simulated throughput / baseline b's, over the same steps (equal to the ratio
    of total step times when both train every drawn token)."""
    bases = [f for f in figs if f.role == "baseline" and f.status == "ok" and f.tokens_per_second > 0]
    for f in figs:
        if f.status != "ok" or f.tokens_per_second <= 0:
            continue
        f.speedup = {b.name: f.tokens_per_second / b.tokens_per_second for b in bases if b.steps == f.steps}
