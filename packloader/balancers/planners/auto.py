"""`auto` (the default strategy): plan the step with several candidates and keep the one the pipeline simulator
says runs fastest under the device's memory, as SlimPack's simulator-guided selection does.

Candidates are (planner, micro-batches per rank) for every registry entry with an `AutoUse` (its `auto=`
field; slicing planners only with config.allow_slicing), in AutoUse.order: each at its default count
(`AutoUse.default_count`, or the planner's own choice) and, on small problems, at the multiples of its ladder
(`micro_batch_counts`). auto knows no planner by name: what follows names the shipped entries' settings (wlb,
hydraulis, slimpack, fixed, in that order; slimpack's ladder in a pipeline 2x, 4x and 8x). config.num_micro_batches
(or StepLayout.micro_batches) pins the count. The simulated step time chooses among them, within memory. In a
pipeline with slicing, the counts an entry defers (`AutoUse.defer`: slimpack's default, wlb's 2x) are planned only
when no count of a slicing planner fits the device (`AutoPlanner.deferred`; docs/benchmarks.md has the
measurements behind this). Every candidate plans the same pieces (the queued ones, then the window) under the same
token cap, min(config.max_tokens, the cost model's memory cap MaxLen); a candidate that cannot (a piece over the
cap without slicing) is skipped.

Score: the slowest DP rank's simulated step time (the batched numba simulator, 1F1B / GPipe / interleaved as
configured, or with PlanConfig.schedule "auto" the faster of 1F1B and ZB-H1 that fits, recorded in
StepPlan.schedule (`schedule_choice`); slice dependencies and FILO backward included), divided by the workload the candidate planned
this step (attention + linear work of its pieces, no floors), so holding work back never looks like a speed-up
by itself. Lowest score wins; scores within TOLERANCE of the lowest count as equal, and among those the most
even micro-batches (imbalance degree), then the earlier candidate in the fixed order above, so every rank picks
the same plan. Slicing candidates are scored first; a whole-piece candidate that plans everything (hydraulis,
fixed) is skipped when its bound, PP times the largest piece's own micro-batch time, is already beyond the
tolerance of the best score.

Memory: when config.model is a preset, its memory model (`cost.memory.memory_model_for`) bounds the choice.
Candidates are taken in score order and the simulated peak memory of one GPU (`sim.peaks.packing_peaks`, the
same peak `simulate_step` gives the report) is computed for each until one fits the device's limit; the ties
within TOLERANCE of that one are checked too. In a pipeline with slicing, when no slimpack count fits (a run
of linked packs keeps whole pieces' activations alive until its first-in-last-out backward), slimpack is
planned again at each count with runs bounded to half, then a quarter of its packs, then pp packs, until one
fits (`bounded_runs`, SlimPackPlanner.run_share), before any whole-piece plan is taken. If no candidate fits,
the one with the lowest peak is taken and its plan records StepPlan.memory_over = peak / limit (> 1) instead
of failing. With a calibration
profile JSON (no model shape, so no memory information) the check is skipped.

Cost of the search: hydraulis runs its longest-first dispatch only (one trial, not the paper's 100) with at
most three V values (two at scale); slimpack's phase one is computed once for all of its counts; with pieces
x DP ranks above SMALL_WORK only each planner's default count is tried, and above an entry's AutoUse.max_work
it is dropped (fixed: 2M). The imbalance degree is computed only when candidates tie within TOLERANCE.

Delay bound: a candidate that holds pieces back (wlb's outlier delay) is eligible only while the run's mean
delay over all tokens (`sim.metrics.token_delay`) stays within DELAY_MEAN_MAX steps, counting what it holds as
trained next step, and it holds at most QUEUE_MAX_SHARE of a step's tokens. The run's trained tokens and
token-steps of delay so far ride in PlannerState.extra[DELAY_KEY], so a resumed run applies the same bound.
When no eligible candidate is left, the entry with AutoUse.flush_fallback (wlb) plans everything (as on a flush).

Empty micro-batches: every DP rank runs the same number of micro-batches, so a rank with fewer pieces than the
fullest one gets empty slots. Each candidate drops the empty slots no rank needs before it is scored
(`Packing.drop_empty_slots`; not when config.num_micro_batches pins the count, nor under the interleaved
schedule, which accepts only some counts).

State: the winner's queue is the new state (only wlb queues); a flush plans everything.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future, wait

import msgspec
import numpy as np

from packloader.balancers.cost.coeffs import doc_time_split
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.memory import GiB, MemoryModel, memory_limit_bytes, memory_model_for, over_memory_text
from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.auto_step import Candidate, Scored, StepContext, queued_arrays
from packloader.balancers.planners.base import PackingPlanner
from packloader.balancers.planners.candidate_pool import CandidatePool, auto_threads
from packloader.balancers.planners.packing import Packing, Pieces
from packloader.balancers.planners.packing_measures import slice_edges_prefix
from packloader.balancers.planners.registry import (
    AutoUse,
    NoOptions,
    Planner,
    StepLayout,
    Window,
    planner_specs,
    register_planner,
)
from packloader.balancers.planners.schedule_choice import KIND_NAMES, fastest_schedule, schedule_kinds
from packloader.balancers.sim.peaks import packing_peaks, stage_bytes
from packloader.contracts import PlanConfig, PlannerState, StepPlan

SMALL_WORK = 400_000  # pieces x DP ranks below which every candidate runs
TOLERANCE = 0.005  # simulated step times this close count as equal (the cost model is no finer than that)
DELAY_MEAN_MAX = 0.5  # steps: the run's mean delay over all tokens, what is queued counted as trained next step
QUEUE_MAX_SHARE = 0.5  # of config.tokens_per_step: the most tokens held back after a step
RUN_SHARES = (0.5, 0.25, 1e-9)  # memory fallback: runs of at most this share of a rank's packs (1e-9: pp packs)
DELAY_KEY = "auto_delay"  # PlannerState.extra: [tokens trained so far, token-steps of delay so far]

log = logging.getLogger("packloader.planner")


def micro_batch_counts(base: int, small: bool, ladder: tuple[int, ...] = (2,)) -> list[int | None]:
    """The counts tried around a planner's default `base`: the default itself and, for small problems, each
    multiple in `ladder` (a finer balance and a smaller pipeline fill share, for more per-micro-batch floors).
    In a pipeline, slimpack climbs its entry's pipeline_ladder up to 8x its default: against the no-bubble ideal
    the fill and drain, (pp - 1) / m of the step, is what is left once slicing has balanced the micro-batches."""
    return [None] + [k * base for k in ladder] if small else [None]


class AutoPlanner:
    name = "auto"

    def __init__(self, config: PlanConfig, model: CostModel | None = None) -> None:
        self.config = config
        self.model = model if model is not None else cost_model_for(config)
        mem_cap = self.model.memory_cap()
        self.cap = min(config.max_tokens, mem_cap) if mem_cap else config.max_tokens
        self.sub_config = msgspec.structs.replace(config, max_tokens=self.cap)
        self._build_candidates()
        self.kinds = schedule_kinds(config)  # the schedules scored (schedule_choice), the default first
        self.kind = self.kinds[0]
        device = config.device  # a device profile's name: its file gives the memory (cost/devices.py)
        self.memory: MemoryModel | None = memory_model_for(config.model, config.parallel, config.schedule, device,
                                                                  config.memory_gib)
        self.mem_limit = memory_limit_bytes(self.memory)
        self.mem_stages = stage_bytes(self.memory, config.parallel.pp) if self.memory is not None else None
        # empty micro-batches no rank needs are dropped before scoring (Packing.drop_empty_slots), unless the count
        # is pinned or the interleaved schedule needs a count it accepts
        self.compact = config.num_micro_batches is None and not (config.parallel.vpp > 1 and self.kind in (2, 3))
        self.last_choice: Candidate | None = None
        self.last_scores: list[tuple[Candidate, float]] = []
        self.last_peaks: list[tuple[Candidate, float]] = []  # bytes, of the candidates checked last step
        self.device = device
        # candidates the memory check dropped over the run: candidate -> (steps dropped, highest peak bytes)
        self.memory_drops: dict[Candidate, tuple[int, float]] = {}
        self.memory_over_steps = 0  # steps where no candidate fit (the lowest peak was taken)
        self.pool = CandidatePool(auto_threads())  # at scale, candidates planned at once (default: in turn)

    # --- candidates ------------------------------------------------------------------------------------------

    def _build_candidates(self) -> None:
        """The candidate planners, from the registry: every entry with an AutoUse (slicing ones only with
        config.allow_slicing), in AutoUse.order, each built with auto's token cap, its options and auto's model."""
        cfg = self.config
        self.uses: dict[str, AutoUse] = {}
        self.solvers: dict[str, PackingPlanner] = {}
        self.solvers_at_scale: dict[str, PackingPlanner] = {}
        # the memory fallback: runs of linked packs bounded, loosest first (RUN_SHARES)
        self.runs: dict[str, dict[float, PackingPlanner]] = {}
        self.slicing: set[str] = set()
        for spec in sorted((s for s in planner_specs() if s.auto is not None), key=lambda s: (s.auto.order, s.name)):
            if spec.slices and not cfg.allow_slicing:
                continue
            use = spec.auto
            sub = msgspec.structs.replace(self.sub_config, strategy=spec.name)
            self.uses[spec.name] = use
            self.solvers[spec.name] = spec.build(sub, self.model, **use.options)
            if use.options_at_scale is not None:
                self.solvers_at_scale[spec.name] = spec.build(sub, self.model, **use.options_at_scale)
            if spec.slices:
                self.slicing.add(spec.name)
            if use.bounded_runs_option and cfg.allow_slicing and cfg.parallel.pp > 1:
                self.runs[spec.name] = {r: spec.build(sub, self.model, **{**use.options, use.bounded_runs_option: r})
                                        for r in RUN_SHARES}

    def candidates(self, pieces: Pieces, pinned: int | None = None) -> list[Candidate]:
        cfg = self.config
        pp = cfg.parallel.pp
        work = len(pieces) * cfg.parallel.dp
        small = work <= SMALL_WORK
        fixed_v = pinned or cfg.num_micro_batches
        out: list[Candidate] = []
        for name, use in self.uses.items():
            if use.max_work is not None and work > use.max_work:
                continue
            if use.max_pp is not None and pp > use.max_pp:
                continue
            if fixed_v:
                out.append(Candidate(name, fixed_v))
                continue
            if use.default_count is None:  # the planner chooses its own count (hydraulis' V, fixed's fewest bins)
                out.append(Candidate(name, None))
                continue
            base = use.default_count(self.solvers[name], pieces, self.sub_config)
            ladder = use.pipeline_ladder if use.pipeline_ladder and pp > 1 else use.ladder
            out += [Candidate(name, v) for v in micro_batch_counts(int(base), small, ladder)]
        return out

    def deferred(self, cand: Candidate, cands: list[Candidate]) -> bool:
        """Candidates planned only when slimpack at none of its ladder's counts (2x to 8x its packs) fits the
        device: in a pipeline with slicing, one of those wins when it fits (the measurements are in
        docs/benchmarks.md), so the default slimpack count and wlb's 2x are planned only when none does (the
        report's memory-bound demo)."""
        if self.config.parallel.pp <= 1 or not self.slicing or self.config.num_micro_batches:
            return False
        counts = [c.micro_batches for c in cands if c.planner == cand.planner]
        if len(counts) < 2:
            return False
        defer = self.uses[cand.planner].defer
        return (defer == "default" and cand.micro_batches is None) or \
            (defer == "counts" and cand.micro_batches is not None)

    def solve_candidate(self, cand: Candidate, pieces: Pieces, step: int, flush: bool, small: bool) -> Packing:
        planner = (None if small else self.solvers_at_scale.get(cand.planner)) or self.solvers[cand.planner]
        if cand.run_share:
            planner = self.runs[cand.planner][cand.run_share]
        return planner.solve(pieces, StepLayout(step, flush, cand.micro_batches), self.model)

    # --- scoring ---------------------------------------------------------------------------------------------

    def step_time(self, packing: Packing, edges=None) -> float:
        """The slowest rank's simulated step time of a packing (costs filled in), under the schedule it gets
        (`schedule_choice`: recorded in packing.schedule)."""
        edges = edges or slice_edges_prefix(packing)
        t, packing.schedule = fastest_schedule(packing, edges, self.config.parallel, self.kinds, self.model,
                                               lambda k: self.peak_bytes(packing, edges, k), self.mem_limit)
        return t

    def peak_bytes(self, packing: Packing, edges=None, kind: int | None = None) -> float:
        """Simulated peak memory of one GPU (max over DP ranks and pipeline stages, static memory included) of a
        packing with costs filled in; 0.0 without a memory model."""
        if self.memory is None:
            return 0.0
        p = self.config.parallel
        edges = edges or slice_edges_prefix(packing)
        kind = (packing.schedule if packing.schedule >= 0 else self.kind) if kind is None else kind
        return float(packing_peaks(packing, self.memory, p.pp, p.vpp, kind, edges, self.mem_stages).max())

    # --- planning --------------------------------------------------------------------------------------------

    def plan(self, window: Window, state: PlannerState, layout: StepLayout | int) -> tuple[StepPlan, PlannerState]:
        layout = StepLayout.of(layout)
        step, flush = layout.step, layout.flush
        pieces = Pieces.of(window, state, step)
        run_tokens, run_delay = (state.extra.get(DELAY_KEY) or [0, 0])[:2]
        piece_delay = int(((step - pieces.drawn) * pieces.length).sum())
        f, b = pieces.time_split(self.model.coeffs)
        piece_work = f + b
        total_work = float(piece_work.sum())
        small = len(pieces) * self.config.parallel.dp <= SMALL_WORK
        listed = self.candidates(pieces, layout.micro_batches)
        cands = list(enumerate(listed))
        # slicing candidates first: their time often rules out the whole-piece planners without running them;
        # deferred ones last, and only if no slimpack count of the ladder fits (`deferred`)
        later = {i for i, c in cands if self.deferred(c, listed)}
        cands.sort(key=lambda ic: (ic[0] in later, ic[1].planner not in self.slicing, ic[0]))
        floor = sum(self.model.floor())
        # any plan that keeps pieces whole and plans them all runs the largest piece inside one micro-batch,
        # whose forward and backward pass through every stage one after the other: pp x its time at least
        pp = self.config.parallel.pp
        whole_bound = pp * (float(piece_work.max()) + floor) / total_work if len(pieces) and total_work > 0 else 0.0
        ctx = StepContext(pieces, layout, small, total_work, whole_bound, run_tokens, run_delay, piece_delay)
        ahead = {} if small else self.evaluate_ahead([ic for ic in cands if ic[0] not in later], ctx)
        try:
            results, errors, over_bound = self.scored(cands, later, ahead, ctx)
        finally:
            wait(list(ahead.values()))  # those the loop skipped: no thread of this step outlives it
        if self.runs and results and not any(r.cand.planner in self.slicing and self.fits(r) for r in results):
            results += self.bounded_runs(listed, pieces, step, flush, small, total_work)
        fallback = next((n for n, u in self.uses.items() if u.flush_fallback), None)
        if not results and over_bound and fallback:  # every candidate that could plan queued past the bound
            cand = Candidate(fallback, None)
            packing = self.solvers[fallback].solve(pieces, StepLayout(step, True), self.model)
            packing.costs(self.model)
            edges = slice_edges_prefix(packing)
            results.append(Scored(self.step_time(packing, edges) / total_work if total_work > 0 else 0.0,
                                   len(listed), packing, cand, edges))
        if not results:
            raise ValueError("auto: no candidate planner can plan this step: " + "; ".join(errors))
        best, over = self.choose(results)
        packing = best.packing
        packing.extra = dict(state.extra)
        q_len, q_drawn = queued_arrays(packing)
        q_tokens = int(q_len.sum())
        q_delay = int(((step - q_drawn) * q_len).sum())
        packing.extra[DELAY_KEY] = [int(run_tokens + pieces.total_tokens - q_tokens), int(run_delay + piece_delay - q_delay)]
        plan = packing.to_step_plan(step)
        plan.planner = best.cand.planner
        plan.schedule = KIND_NAMES[packing.schedule] if self.config.schedule == "auto" else ""
        plan.memory_over = over
        if over > 0:
            self.warn_memory(step, best.peak)
        return plan, packing.state()

    def scored(self, cands: list[tuple[int, Candidate]], later: set[int], ahead: dict[int, Future],
               ctx: StepContext) -> tuple[list[Scored], list[str], int]:
        """The candidates in `cands`' order, each skipped, refused or scored as the module docstring says:
        (scored results, refusals, how many broke the delay bound). `ahead`: candidates already being evaluated
        in threads (`evaluate_ahead`); one the loop skips is not used."""
        results: list[Scored] = []
        errors: list[str] = []
        over_bound = 0
        step = ctx.layout.step
        for idx, cand in cands:
            if idx in later and any(r.cand.planner in self.slicing and self.fits(r) for r in results):
                continue  # a slicing count of the ladder fits: the deferred candidates would not win
            if self.uses[cand.planner].whole_pieces and results:
                if ctx.whole_bound > self.fastest_fitting(results) * (1.0 + TOLERANCE):
                    continue  # cannot come within the tolerance of the fastest plan that fits so far
            try:
                packing, edges, t, peak = ahead.pop(idx).result() if idx in ahead else self.evaluate(cand, ctx)
            except ValueError as e:  # e.g. a piece over the cap for a planner that cannot slice
                errors.append(f"{cand.planner}: {e}")
                continue
            work = ctx.total_work
            q_len, q_drawn = queued_arrays(packing)
            if packing.queued:  # what it holds back is not trained this step
                hf, hb = doc_time_split(self.model.coeffs, q_len)
                work -= float(hf.sum() + hb.sum())
            score = t / work if work > 0 else (0.0 if t == 0 else math.inf)
            if packing.queued and not self.delay_ok(q_len, q_drawn, ctx.pieces, step, ctx.run_tokens, ctx.run_delay,
                                                    ctx.piece_delay):
                over_bound += 1
                continue  # holding these back would break the delay bound
            results.append(Scored(score, idx, packing, cand, edges, peak_ahead=peak))
        return results, errors, over_bound

    def evaluate(self, cand: Candidate, ctx: StepContext, peak: bool = False) -> tuple[Packing, tuple, float, float | None]:
        """One candidate planned, its empty slots dropped, costed and simulated: (packing, slice edges, slowest
        rank's step time, with `peak` its simulated peak bytes, else None). Touches no state of the AutoPlanner,
        so candidates can run in threads."""
        lay = ctx.layout
        packing = self.solve_candidate(cand, ctx.pieces, lay.step, lay.flush, ctx.small)
        if self.compact and not lay.micro_batches:
            packing = packing.drop_empty_slots()
        packing.costs(self.model)
        edges = slice_edges_prefix(packing)
        t = self.step_time(packing, edges)
        return packing, edges, t, (self.peak_bytes(packing, edges) if peak and self.memory is not None else None)

    def evaluate_ahead(self, cands: list[tuple[int, Candidate]], ctx: StepContext) -> dict[int, Future]:
        """At scale, the candidates `scored` will take, started at once on the pool's threads (`candidate_pool`;
        off by default), each simulating its peak memory too. Only when each planner object is in one job (their
        caches are not shared); `scored` skips what it would have skipped."""
        if len({c.planner for _, c in cands}) < len(cands):
            return {}
        return self.pool.start(self.evaluate, {idx: (cand, ctx, True) for idx, cand in cands})

    def warn_memory(self, step: int, peak: float) -> None:
        """No candidate fits: a warning the first time (later steps at debug level; `memory_summary` counts
        them), saying by how much and what to change."""
        level = logging.WARNING if self.memory_over_steps <= 1 else logging.DEBUG
        log.log(level, "step %d: %s", step, over_memory_text(self.memory, self.config, peak, self.device))

    def bounded_runs(self, listed: list[Candidate], pieces: Pieces, step: int, flush: bool, small: bool,
                     total_work: float) -> list[Scored]:
        """Slimpack at each of its counts with bounded runs of linked packs, loosest bound first until one fits:
        when no slimpack plan fits the device because a long run keeps whole pieces' activations alive until
        its first backward, these keep slicing (and the balance it buys) instead of falling back to whole
        pieces. The tightest bound, pp packs, leaves about one piece's slices per run."""
        out: list[Scored] = []
        for c in (c for c in listed if c.planner in self.runs):
            for share in RUN_SHARES:
                cand = Candidate(c.planner, c.micro_batches, run_share=share)
                packing = self.solve_candidate(cand, pieces, step, flush, small)
                if self.compact:
                    packing = packing.drop_empty_slots()
                packing.costs(self.model)
                edges = slice_edges_prefix(packing)
                t = self.step_time(packing, edges)
                out.append(Scored(t / total_work if total_work > 0 else 0.0, len(listed) + 1 + len(out), packing, cand, edges))
                if self.fits(out[-1]):
                    break
        return out

    def choose(self, results: list[Scored]) -> tuple[Scored, float]:
        """The winner among scored candidates (module docstring) and its peak over the memory limit (0 when it
        fits); records the choice, scores and memory drops for the report."""
        fastest = self.fastest_fitting(results)
        over = 0.0
        if fastest < math.inf or self.mem_limit is None:
            # within TOLERANCE of the fastest that fits: the most even micro-batches, then the earliest candidate
            tol = TOLERANCE if self.config.parallel.pp > 1 else 0.0  # PP 1: the score is the judge's own measure
            group = [r for r in results if r.score <= fastest * (1.0 + tol) and self.fits(r)]
            best = min(group, key=lambda r: (r.imbalance(), r.idx)) if len(group) > 1 else group[0]
        else:  # nothing fits the device: the lowest peak, then the fastest, recorded in the plan
            for r in results:
                self.fits(r)
            best = min(results, key=lambda r: (r.peak, r.score, r.idx))
            over = best.peak / self.mem_limit if best.peak > self.mem_limit else 0.0
            self.memory_over_steps += over > 0
        self.last_choice = best.cand
        self.last_scores = [(r.cand, r.score) for r in results]
        self.last_peaks = [(r.cand, r.peak) for r in results if r.peak is not None]
        if self.mem_limit is not None:
            for r in results:
                if r.peak is not None and r.peak > self.mem_limit and r is not best:
                    n, top = self.memory_drops.get(r.cand, (0, 0.0))
                    self.memory_drops[r.cand] = (n + 1, max(top, r.peak))
        return best, over

    def delay_ok(self, q_len: np.ndarray, q_drawn: np.ndarray, pieces: Pieces, step: int, run_tokens: int,
                 run_delay: int, piece_delay: int) -> bool:
        """Whether a candidate's queue (its pieces' lengths and drawn steps, `queued_arrays`) keeps the delay
        bound (module docstring): at most QUEUE_MAX_SHARE of a step's tokens held, and the run's mean delay,
        with what it holds trained next step, <= DELAY_MEAN_MAX."""
        q_tokens = int(q_len.sum())
        if q_tokens > QUEUE_MAX_SHARE * self.config.tokens_per_step:
            return False
        q_now = int(((step - q_drawn) * q_len).sum())
        delay = run_delay + piece_delay - q_now + int(((step + 1 - q_drawn) * q_len).sum())
        tokens = run_tokens + pieces.total_tokens
        return delay <= DELAY_MEAN_MAX * tokens

    def memory_summary(self) -> str:
        """The candidates the memory check dropped over the run, each with its highest simulated peak against
        the device's limit; empty when none was dropped."""
        if not self.memory_drops or self.memory is None:
            return ""
        parts = []
        for cand, (n, peak) in sorted(self.memory_drops.items(), key=lambda kv: -kv[1][1]):
            mbs = "its default micro-batches" if cand.micro_batches is None else f"{cand.micro_batches} micro-batches"
            mbs += f", runs bounded to {cand.run_share:g} of its packs" if cand.run_share else ""
            parts.append(f"{cand.planner} at {mbs} (peak {peak / GiB:.1f} GiB, {n} step{'s' * (n != 1)})")
        text = (f"auto dropped {len(parts)} candidates that do not fit in memory, against "
                f"{self.mem_limit / GiB:.1f} GiB usable of the {self.memory.memory_gib:g} GiB "
                f"{self.device.upper()}: " + "; ".join(parts))
        if self.memory_over_steps:
            text += (f"; in {self.memory_over_steps} steps no candidate fit and the lowest peak was taken "
                     f"(StepPlan.memory_over)")
        return text

    def fits(self, r: Scored) -> bool:
        """Whether a scored candidate's simulated peak memory fits the device (simulated once, on demand)."""
        if self.mem_limit is None:
            return True
        if r.peak is None:
            r.peak = r.peak_ahead if r.peak_ahead is not None else self.peak_bytes(r.packing, r.edges)
        return r.peak <= self.mem_limit

    def fastest_fitting(self, results: list[Scored]) -> float:
        """The lowest score among candidates that fit the device (inf when none does): candidates are checked in
        score order until one fits, so usually only the fastest is simulated for memory."""
        for r in sorted(results, key=lambda r: (r.score, r.idx)):
            if r.score == math.inf:
                break
            if self.fits(r):
                return r.score
        return math.inf


@register_planner("auto", slices=True, summary="packloader auto: best plan by simulation", report_order=90)
def _make(config: PlanConfig, options: NoOptions, model: CostModel) -> Planner:
    return AutoPlanner(config, model)
