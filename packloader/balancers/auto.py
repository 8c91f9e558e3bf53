"""`auto` (the default strategy): plan the step with several candidates and keep the one the pipeline simulator
says runs fastest under the device's memory, as SlimPack's simulator-guided selection does.

Candidates are (planner, micro-batches per rank): `wlb`, `hydraulis`, `slimpack` (only with
config.allow_slicing) and `fixed`, each at its own default number of micro-batches and at a few others around
it (`micro_batch_counts`); config.num_micro_batches pins the count. In a pipeline (PP > 1) with slicing
allowed, slimpack's default count and wlb at 2x are planned only when slimpack at 2x does not fit the device
(`AutoPlanner.deferred`): measured on the four benchmark distributions at DP 8 / PP 4, slimpack at 2x won every
step, its default count was at least 9 % slower and wlb at 2x at least 5 % slower (planning went from about 10
to 7 ms per step); in the report's memory-bound demo (TP 2) slimpack at 2x does not fit and wlb at 2x wins
steps, so they are still planned there. Every candidate plans the same pieces (the
queued ones, then the window) under the same token cap, min(config.max_tokens, the cost model's memory cap
MaxLen); a candidate that cannot (a piece over the cap without slicing) is skipped.

Score: the slowest DP rank's simulated step time (the batched numba simulator, 1F1B / GPipe / interleaved as
configured, slice dependencies and FILO backward included), divided by the workload the candidate planned
this step (attention + linear work of its pieces, no floors). For candidates that plan everything this is the
step time; a candidate that delays outliers (wlb) is charged for the time per unit of work it actually trains,
so holding work back never looks like a speed-up by itself. Lowest score wins; scores within TOLERANCE of the
lowest count as equal, and among those the most even micro-batches (imbalance degree), then the earlier
candidate in the fixed order above, so every rank picks the same plan. Slicing candidates are scored first;
a whole-piece candidate that plans everything (hydraulis, fixed) is skipped when its bound, PP times the
largest piece's own micro-batch time (that micro-batch's forward and backward chain through the stages), is
already beyond the tolerance of the best score.

Memory: when config.model is a preset, its memory model (memory.memory_model_for: the model shape under
config.parallel and config.schedule, selective recompute, on the cost model's device, H100 80 GiB unless the
profile says H200) bounds the choice. Candidates are taken in score order and the simulated peak memory of one
GPU (peaks.packing_peaks: the simulator's kernel with the memory model's activations, transients, slices' key/
value gradients and static memory, the same peak `simulate_step` gives the report) is computed for each until
one fits the device's limit (MemoryModel.limit_bytes); the ties within TOLERANCE of that one are checked too,
and the pruning of whole-piece candidates compares against the fastest plan that fits. So usually only the
winner is simulated for memory. If no candidate fits, the one with the lowest peak is taken and its plan
records StepPlan.extra["memory_over"] = peak / limit (> 1) instead of failing. With a calibration profile JSON
(no model shape, so no memory information) the check is skipped and the fastest candidate wins.

Cost of the search: hydraulis runs its longest-first dispatch only (one trial, not the paper's 100) with at
most three V values (two at scale), and skips a V whose objective bound cannot win (`HydraulisPlanner.v_bound`:
the same V wins, typically without packing the top of Appendix C's window); slimpack's phase one (dispatch,
DP-Merge groups, per-rank order) is computed once for both of its counts; with pieces x DP ranks above
SMALL_WORK only each planner's default count is tried, and above FIXED_MAX_WORK fixed is dropped. The
per-candidate scoring is numba throughout (micro-batch costs, slice edges, the batched simulator); the
imbalance degree is computed only when candidates tie within TOLERANCE. Measured on a 2-core machine shared
with other work (4M tokens per step, 64K cap, long-tail lengths, llama3-8b at TP 8): see docs/benchmarks.md
(planner section) for the per-step means at DP 8 / PP 4, PP 1 and DP 1024 with 3.2M tokens. The memory check adds no measurable time when the fastest candidate fits (llama3-8b at tp 8);
when nothing fits (llama3-8b at tp 1, 64K micro-batches) every candidate is planned and simulated: about
+2 ms per step at DP 8 / PP 4 (synthetic-cc median 7.9 -> 9.7 ms on that machine).

Why slimpack at twice its packs usually wins at PP > 1 (imbalance degree 1.01-1.02, simulated efficiency
0.97 in docs/benchmarks.md): half-size packs halve the pipeline fill and drain, and since slimpack keeps all
of a rank's slices in one run of linked packs from pack 0 (see slimpack.py) the slices' first-in-last-out
backward costs no extra drain. Before that rule a run broken mid-step cost one more drain on some ranks, the
2x slimpack candidate lost about 8 % on those steps, and a wlb candidate with micro-batches up to 2x the mean
(imbalance degree 1.3-2.0) won by under 1 %, which pushed the mean imbalance on `stdlib` to 1.08.

Delay bound: a candidate that holds pieces back (wlb's outlier delay) is eligible only while the run's delay
stays within DELAY_MEAN_MAX steps, mean over all tokens (metrics.token_delay: tokens trained when drawn count
0), counting what it holds as trained next step, and it holds at most QUEUE_MAX_SHARE of a step's tokens
(config.tokens_per_step). The run's trained tokens and token-steps of delay so far are carried in
PlannerState.extra["auto_delay"], so a resumed run applies the same bound. When no eligible candidate is left,
wlb plans everything (as on a flush). Without this, wlb won steps where its queue kept growing: the report's
demo delayed 44 % of its tokens by 1.5 steps on average, with 604K tokens still queued after 8 steps of 524K.

State: the winner's queue is the new state (only wlb queues); a flush plans everything (every candidate then
plans all pieces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np

from packloader.balancers.assemble import Packing, Pieces, carried_extra, cost_model_for, wants_flush
from packloader.balancers.cost import doc_time_split
from packloader.balancers.hydraulis import HydraulisPlanner
from packloader.balancers.kernels import bfd_pack, slice_edges_kernel
from packloader.balancers.memory import MemoryModel, memory_limit_bytes, memory_model_for
from packloader.balancers.peaks import packing_peaks, stage_bytes
from packloader.balancers.registry import Planner, Window, register_planner
from packloader.balancers.simulator import SCHEDULES, step_times_ranks_sliced
from packloader.balancers.slimpack import SlimPackPlanner, default_packs
from packloader.balancers.wlb import WLBPlanner, default_micro_batches
from packloader.contracts import PlanConfig, PlannerState, StepPlan

PLANNERS = ("wlb", "hydraulis", "slimpack", "fixed")
SMALL_WORK = 400_000  # pieces x DP ranks below which every candidate runs
FIXED_MAX_WORK = 2_000_000  # fixed's BFD is O(pieces x bins): dropped above this
TOLERANCE = 0.005  # simulated step times this close count as equal (the cost model is no finer than that)
DELAY_MEAN_MAX = 0.5  # steps: the run's mean delay over all tokens, what is queued counted as trained next step
QUEUE_MAX_SHARE = 0.5  # of config.tokens_per_step: the most tokens held back after a step
DELAY_KEY = "auto_delay"  # PlannerState.extra: [tokens trained so far, token-steps of delay so far]


@dataclass(frozen=True)
class Candidate:
    planner: str
    micro_batches: int | None  # None: the planner's own choice


def micro_batch_counts(base: int, small: bool) -> list[int | None]:
    """The counts tried around a planner's default `base`: the default itself and, for small problems, twice
    as many (a finer balance and a smaller pipeline fill share, for more per-micro-batch floors)."""
    return [None, 2 * base] if small else [None]


def slice_edges(packing: Packing) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-rank slice edges (CSR offsets, source position, destination position) of a Packing: an edge from
    the micro-batch holding a slice's prefix end to the slice's micro-batch, positions local to each rank (a
    DP-Merge micro-batch is listed by each member rank, so its edges appear on each)."""
    return slice_edges_prefix(packing)[:3]


def slice_edges_prefix(packing: Packing) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`slice_edges` and, per edge, the tokens of keys the slice attends to before its start (its prefix, whose
    key/value gradients the simulator holds between the two backwards). One numba call
    (kernels.slice_edges_kernel); tests check it against the simulator's `slice_edges_of` on the StepPlan."""
    a = [np.ascontiguousarray(x, np.int64) for x in (packing.seg_doc, packing.seg_start, packing.seg_end, packing.seg_af,
                                                      packing.seg_mb, packing.rank_mbs)]
    return slice_edges_kernel(*a)


def imbalance_degree(packing: Packing) -> float:
    """WLB-LLM's imbalance degree of the worst rank: max micro-batch cost x count / total (costs filled in)."""
    c = (packing.mb_fwd + packing.mb_bwd)[packing.rank_mbs]
    tot = c.sum(axis=1)
    ok = tot > 0
    if not ok.any():
        return 1.0
    return float((c.max(axis=1)[ok] * c.shape[1] / tot[ok]).max())


class AutoPlanner:
    name = "auto"

    def __init__(self, config: PlanConfig) -> None:
        self.config = config
        self.model = cost_model_for(config)
        mem_cap = self.model.max_tokens()
        self.cap = min(config.max_tokens, mem_cap) if mem_cap else config.max_tokens
        sub = msgspec.structs.replace(config, max_tokens=self.cap)
        self.sub_config = sub
        self.wlb = WLBPlanner(msgspec.structs.replace(sub, strategy="wlb"))
        self.hydraulis = HydraulisPlanner(msgspec.structs.replace(sub, strategy="hydraulis"), trials=1, v_limit=3)
        self.hydraulis_fast = HydraulisPlanner(msgspec.structs.replace(sub, strategy="hydraulis"), trials=1, v_limit=2)
        self.slimpack = SlimPackPlanner(msgspec.structs.replace(sub, strategy="slimpack")) if config.allow_slicing else None
        kind = SCHEDULES[config.schedule]
        self.kind = 0 if kind == 2 and config.parallel.vpp == 1 else kind
        # the device the cost model describes (H100 unless its profile says H200); None for a profile JSON
        device = "h200" if "h200" in self.model.profile.device.lower() else "h100"
        self.memory: MemoryModel | None = memory_model_for(config.model, config.parallel, config.schedule, device,
                                                                  config.memory_gib)
        self.mem_limit = memory_limit_bytes(self.memory)
        self.mem_stages = stage_bytes(self.memory, config.parallel.pp) if self.memory is not None else None
        self.last_choice: Candidate | None = None
        self.last_scores: list[tuple[Candidate, float]] = []
        self.last_peaks: list[tuple[Candidate, float]] = []  # bytes, of the candidates checked last step
        self.device = device
        # candidates the memory check dropped over the run: candidate -> (steps dropped, highest peak bytes)
        self.memory_drops: dict[Candidate, tuple[int, float]] = {}
        self.memory_over_steps = 0  # steps where no candidate fit (the lowest peak was taken)

    # --- candidates ------------------------------------------------------------------------------------------

    def candidates(self, pieces: Pieces) -> list[Candidate]:
        cfg = self.config
        dp, pp = cfg.parallel.dp, cfg.parallel.pp
        n = len(pieces)
        work = n * dp
        small = work <= SMALL_WORK
        fixed_v = cfg.num_micro_batches
        tokens = pieces.total_tokens
        out: list[Candidate] = []
        for name in PLANNERS:
            if name == "slimpack" and self.slimpack is None:
                continue
            if name == "fixed" and work > FIXED_MAX_WORK:
                continue
            if fixed_v:
                out.append(Candidate(name, fixed_v))
                continue
            if name == "wlb":
                base = default_micro_batches(tokens, n, dp, pp, self.cap, self.wlb.fill)
            elif name == "slimpack":
                base = default_packs(tokens / dp, math.ceil(n / dp), pp, self.cap)
            else:  # hydraulis enumerates its own V; fixed takes the fewest bins that hold the step
                out.append(Candidate(name, None))
                continue
            out += [Candidate(name, v) for v in micro_batch_counts(int(base), small)]
        return out

    def deferred(self, cand: Candidate, cands: list[Candidate]) -> bool:
        """Candidates planned only when slimpack at twice its packs does not fit the device: in a pipeline with
        slicing, that one wins when it fits (all four benchmark distributions at DP 8 / PP 4, TP 8: every step;
        slimpack's default count >= 9 % slower, wlb at 2x >= 5 % slower), so the default slimpack count and
        wlb's 2x are not planned then. When it does not fit (the report's demo at TP 2), they are."""
        if self.config.parallel.pp <= 1 or self.slimpack is None or self.config.num_micro_batches:
            return False
        counts = [c.micro_batches for c in cands if c.planner == cand.planner]
        if len(counts) < 2:
            return False
        return (cand.planner == "slimpack" and cand.micro_batches is None) or \
            (cand.planner == "wlb" and cand.micro_batches is not None)

    def solve(self, cand: Candidate, pieces: Pieces, step: int, flush: bool, small: bool) -> Packing:
        v = cand.micro_batches
        if cand.planner == "wlb":
            return self.wlb.solve(pieces, step, flush, v)
        if cand.planner == "hydraulis":
            return (self.hydraulis if small else self.hydraulis_fast).solve(pieces, step, v)
        if cand.planner == "slimpack":
            return self.slimpack.solve(pieces, step, v)
        return self.fixed_packing(pieces, v)

    def fixed_packing(self, pieces: Pieces, v: int | None) -> Packing:
        """`fixed`'s plan as a Packing: best-fit decreasing into dp x V bins of cap tokens, bin b to rank b % dp
        at position b // dp (as FixedPlanner deals them), V grown until everything fits."""
        from packloader.balancers.assemble import check_cap, whole_pieces_packing

        dp, cap = self.config.parallel.dp, self.cap
        check_cap(pieces, cap, "fixed")
        per_rank = v or max(1, -(-pieces.total_tokens // (cap * dp)))
        while True:
            assign, ok = bfd_pack(pieces.length, cap, per_rank * dp)
            if ok:
                break
            per_rank += 1
        b = np.arange(per_rank * dp, dtype=np.int64)
        rank_mbs = np.empty((dp, per_rank), np.int64)
        rank_mbs[b % dp, b // dp] = b
        return whole_pieces_packing(pieces, assign, rank_mbs, strategy="fixed")

    # --- scoring ---------------------------------------------------------------------------------------------

    def step_time(self, packing: Packing, edges=None) -> float:
        """The slowest rank's simulated step time of a packing (costs filled in)."""
        cfg = self.config
        dp, v = packing.rank_mbs.shape
        order = packing.rank_mbs.ravel()
        f = np.ascontiguousarray(packing.mb_fwd[order])
        b = np.ascontiguousarray(packing.mb_bwd[order])
        offsets = np.arange(dp + 1, dtype=np.int64) * v
        e_off, e_src, e_dst = (edges or slice_edges_prefix(packing))[:3]
        t = step_times_ranks_sliced(cfg.parallel.pp, cfg.parallel.vpp, self.kind, f, b, offsets, e_off, e_src, e_dst, 0.0)
        if (t < 0).any():
            return math.inf  # this micro-batch count deadlocks the interleaved schedule
        return float(t.max())

    def peak_bytes(self, packing: Packing, edges=None) -> float:
        """Simulated peak memory of one GPU (max over DP ranks and pipeline stages, static memory included) of a
        packing with costs filled in; 0.0 without a memory model."""
        if self.memory is None:
            return 0.0
        p = self.config.parallel
        edges = edges or slice_edges_prefix(packing)
        return float(packing_peaks(packing, self.memory, p.pp, p.vpp, self.kind, edges, self.mem_stages).max())

    # --- planning --------------------------------------------------------------------------------------------

    def plan(self, window: Window, state: PlannerState, step: int) -> tuple[StepPlan, PlannerState]:
        pieces = Pieces.of(window, state, step)
        flush = wants_flush(state)
        run_tokens, run_delay = (state.extra.get(DELAY_KEY) or [0, 0])[:2]
        piece_delay = int(((step - pieces.drawn) * pieces.length).sum())
        f, b = doc_time_split(self.model.coeffs, pieces.length)
        piece_work = f + b
        total_work = float(piece_work.sum())
        small = len(pieces) * self.config.parallel.dp <= SMALL_WORK
        results: list[_Result] = []
        errors: list[str] = []
        listed = self.candidates(pieces)
        cands = list(enumerate(listed))
        # slicing candidates first: their time often rules out the whole-piece planners without running them;
        # deferred ones last, and only if slimpack at 2x does not fit (`deferred`)
        later = {i for i, c in cands if self.deferred(c, listed)}
        cands.sort(key=lambda ic: (ic[0] in later, ic[1].planner != "slimpack", ic[0]))
        floor = sum(self.model.floor())
        # any plan that keeps pieces whole and plans them all runs the largest piece inside one micro-batch,
        # whose forward and backward pass through every stage one after the other: pp x its time at least
        pp = self.config.parallel.pp
        whole_bound = pp * (float(piece_work.max()) + floor) / total_work if len(pieces) and total_work > 0 else 0.0
        over_bound = 0
        for idx, cand in cands:
            if idx in later and any(r.cand.planner == "slimpack" and self.fits(r) for r in results):
                continue  # slimpack at 2x planned and fits: the deferred candidates would not win
            if cand.planner in ("hydraulis", "fixed") and results:
                if whole_bound > self.fastest_fitting(results) * (1.0 + TOLERANCE):
                    continue  # cannot come within the tolerance of the fastest plan that fits so far
            try:
                packing = self.solve(cand, pieces, step, flush, small)
            except ValueError as e:  # e.g. a piece over the cap for a planner that cannot slice
                errors.append(f"{cand.planner}: {e}")
                continue
            packing.costs(self.model)
            edges = slice_edges_prefix(packing)
            t = self.step_time(packing, edges)
            work = total_work
            if packing.queued:  # what it holds back is not trained this step
                hf, hb = doc_time_split(self.model.coeffs, np.array([q.length for q in packing.queued], np.int64))
                work -= float(hf.sum() + hb.sum())
            score = t / work if work > 0 else (0.0 if t == 0 else math.inf)
            if packing.queued and not self.delay_ok(packing, pieces, step, run_tokens, run_delay, piece_delay):
                over_bound += 1
                continue  # holding these back would break the delay bound
            results.append(_Result(score, idx, packing, cand, edges))
        if not results and over_bound:  # every candidate that could plan queued past the bound: wlb plans everything
            cand = Candidate("wlb", None)
            packing = self.wlb.solve(pieces, step, True, None)
            packing.costs(self.model)
            edges = slice_edges_prefix(packing)
            results.append(_Result(self.step_time(packing, edges) / total_work if total_work > 0 else 0.0,
                                   len(listed), packing, cand, edges))
        if not results:
            raise ValueError("auto: no candidate planner can plan this step: " + "; ".join(errors))
        fastest = self.fastest_fitting(results)
        over = 0.0
        if fastest < math.inf or self.mem_limit is None:
            # within TOLERANCE of the fastest that fits: the most even micro-batches, then the earliest candidate
            group = [r for r in results if r.score <= fastest * (1.0 + TOLERANCE) and self.fits(r)]
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
        packing = best.packing
        packing.extra = carried_extra(state)
        q_tokens = sum(q.length for q in packing.queued)
        q_delay = sum((step - q.drawn_step) * q.length for q in packing.queued)
        packing.extra[DELAY_KEY] = [int(run_tokens + pieces.total_tokens - q_tokens), int(run_delay + piece_delay - q_delay)]
        plan = packing.to_step_plan(step)
        plan.extra["auto_candidate"] = float(best.idx)
        plan.extra["auto_planner"] = float(PLANNERS.index(best.cand.planner))
        if over:
            plan.extra["memory_over"] = over
        return plan, packing.state()

    def delay_ok(self, packing: Packing, pieces: Pieces, step: int, run_tokens: int, run_delay: int,
                 piece_delay: int) -> bool:
        """Whether a candidate's queue keeps the delay bound (module docstring): at most QUEUE_MAX_SHARE of a
        step's tokens held, and the run's mean delay, with what it holds trained next step, <= DELAY_MEAN_MAX."""
        q_tokens = sum(q.length for q in packing.queued)
        if q_tokens > QUEUE_MAX_SHARE * self.config.tokens_per_step:
            return False
        q_now = sum((step - q.drawn_step) * q.length for q in packing.queued)
        delay = run_delay + piece_delay - q_now + sum((step + 1 - q.drawn_step) * q.length for q in packing.queued)
        tokens = run_tokens + pieces.total_tokens
        return delay <= DELAY_MEAN_MAX * tokens

    def memory_summary(self) -> str:
        """The candidates the memory check dropped over the run, each with its highest simulated peak against
        the device's limit; empty when none was dropped."""
        if not self.memory_drops or self.memory is None:
            return ""
        from packloader.balancers.memory import GiB

        parts = []
        for cand, (n, peak) in sorted(self.memory_drops.items(), key=lambda kv: -kv[1][1]):
            mbs = "its default micro-batches" if cand.micro_batches is None else f"{cand.micro_batches} micro-batches"
            parts.append(f"{cand.planner} at {mbs} (peak {peak / GiB:.1f} GiB, {n} step{'s' * (n != 1)})")
        text = (f"auto dropped {len(parts)} candidates that do not fit in memory, against "
                f"{self.mem_limit / GiB:.1f} GiB usable of the {self.memory.memory_gib:g} GiB "
                f"{self.device.upper()}: " + "; ".join(parts))
        if self.memory_over_steps:
            text += (f"; in {self.memory_over_steps} steps no candidate fit and the lowest peak was taken "
                     f"(StepPlan.extra['memory_over'])")
        return text

    def fits(self, r: "_Result") -> bool:
        """Whether a scored candidate's simulated peak memory fits the device (simulated once, on demand)."""
        if self.mem_limit is None:
            return True
        if r.peak is None:
            r.peak = self.peak_bytes(r.packing, r.edges)
        return r.peak <= self.mem_limit

    def fastest_fitting(self, results: list["_Result"]) -> float:
        """The lowest score among candidates that fit the device (inf when none does): candidates are checked in
        score order until one fits, so usually only the fastest is simulated for memory."""
        for r in sorted(results, key=lambda r: (r.score, r.idx)):
            if r.score == math.inf:
                break
            if self.fits(r):
                return r.score
        return math.inf


@dataclass
class _Result:
    """A scored candidate: its score (simulated time per unit of work), position in the candidate list, plan,
    slice edges, simulated peak bytes (None until checked) and imbalance degree (computed when a tie asks)."""

    score: float
    idx: int
    packing: Packing
    cand: Candidate
    edges: tuple
    peak: float | None = None
    _imbalance: float | None = None

    def imbalance(self) -> float:
        if self._imbalance is None:
            self._imbalance = imbalance_degree(self.packing)
        return self._imbalance


@register_planner("auto")
def _make(config: PlanConfig) -> Planner:
    return AutoPlanner(config)
