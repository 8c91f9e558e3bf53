"""DAG pipeline simulator (SlimPack section 4.3): step time, bubbles and per-stage memory of a pipeline
schedule over micro-batches of unequal cost, slices included.

Tasks are (virtual stage, forward/backward, micro-batch). Edges:

* data, stage to stage: F(v, u) after F(v-1, u); B(V-1, u) after F(V-1, u); B(v, u) after B(v+1, u)
  (plus an optional point-to-point latency on each stage-to-stage edge);
* data, slice to slice: when micro-batch u holds a slice whose earlier keys live in micro-batch u' < u (an
  "edge" (u', u)), F(v, u) waits for F(v, u') (keys and values) and B(v, u') waits for B(v, u) (their
  gradients);
* schedule: each pipeline rank runs its tasks one at a time in the order the schedule gives (1F1B, GPipe,
  interleaved 1F1B with vpp model chunks per rank, Megatron's order; ZB-H1, 1F1B with each backward split into
  the input gradient B, which the previous stage waits for, and the weight gradient W, which waits for its own
  B only and fills the bubbles, at vpp > 1 on the interleaved order: `kernels.build_ops`; ZB-V, vpp 2 with the chunks placed as a V and split
  backwards in torch.distributed.pipelining's order: `zbv.py`). Backward passes visit micro-batches in
  `backward_order` (default: forward order, except that the micro-batches of a sliced document go last slice
  first, SlimPack's FILO rule). Before its k-th backward, stage s has run warm_s + k + 1 forwards (1F1B:
  warm_s = pp - s - 1; Megatron's interleaved warm-up; GPipe: all), or more when that backward's own forward
  comes later in forward order: the rank runs those forwards first (SlimPack's injected forward micro-pack).
  An injection does not widen the lead for later backwards, so the backwards of a slice chain run back to
  back instead of waiting a pipeline round trip each.
  Interleaved 1F1B follows Megatron's table (groups of pp micro-batches, chunk by chunk); some micro-batch
  counts that are not a multiple of pp deadlock there, as Megatron forbids them: `simulate` raises, the
  batched kernels return -1.0 for that rank.

The DAG is resolved by list scheduling in the ranks' orders, which gives every task's earliest start (the
critical-path times of SlimPack's Algorithm 1); the step time is the last finish. Memory is tracked per rank
along its task order: a micro-batch's activations are allocated when its forward starts and freed when its
backward ends, a transient (logits, recompute buffers) lives while a task runs, and the key/value gradients a
later slice produces for an earlier one live from the later slice's backward start to the earlier one's
backward end.

Everything per task is in numba; `simulate` takes arrays (what `auto` calls per candidate), `simulate_rank` and
`simulate_step` take plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from packloader.balancers.cost.model import _per_rank
from packloader.balancers.cost.schedules import ORDER_1F1B, ORDER_INTERLEAVED
from packloader.balancers.sim.kernels import SCHEDULES, ZB_H1, ZB_V, build_ops, simulate_kernel, step_times_ranks
from packloader.balancers.sim.weights import weight_times
from packloader.balancers.sim.zbv import v_static_bytes
from packloader.contracts import MicroBatch, ParallelConfig, RankPlan, StepPlan

# ----------------------------------------------------------------------------------------------- arrays API


@dataclass
class SimResult:
    """One pipeline (one DP rank) simulated. Times in the cost model's unit (seconds); bytes as given."""

    step_time: float
    pp: int
    vpp: int
    m: int
    busy: np.ndarray  # (pp,) time each pipeline rank computes
    start: np.ndarray  # (V, m, 3): start of F (…, 0), B (…, 1) and W (…, 2, ZB-H1 only) of u on virtual stage v
    finish: np.ndarray
    ops: np.ndarray  # (pp, 2*m*vpp) task order per rank (encoded)
    peak_bytes: np.ndarray  # (pp,) peak memory (static + activations + transients + KV gradients)
    mem_times: np.ndarray  # (pp, 4*m*vpp) timeline: time after each task start / end
    mem_bytes: np.ndarray  # (pp, 4*m*vpp) bytes live at those times
    static_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    v_shape: bool = False  # ZB-V: rank s holds stages s and 2*pp-1-s (else s, s + pp, ...)

    @property
    def bubble(self) -> np.ndarray:
        """Idle time of each pipeline rank within the step."""
        return self.step_time - self.busy

    @property
    def bubble_time(self) -> float:
        """Mean idle time over the pipeline ranks."""
        return float(self.bubble.mean()) if self.pp else 0.0

    @property
    def bubble_share(self) -> float:
        """Idle share of the pipeline's GPU time: sum of idle / (pp x step time)."""
        return max(0.0, float(self.bubble.sum() / (self.pp * self.step_time))) if self.step_time > 0 else 0.0

    @property
    def peak(self) -> float:
        return float(self.peak_bytes.max()) if len(self.peak_bytes) else 0.0

    def order(self, rank: int) -> list[tuple[str, int, int]]:
        """The task order of a pipeline rank as ("F", "B" or "W", micro-batch, model chunk)."""
        out = []
        for t in self.ops[rank]:
            vu, op = divmod(int(t), 3)
            vs, u = divmod(vu, self.m)
            out.append(("FBW"[op], u, (vs >= self.pp) if self.v_shape else vs // self.pp))
        return out


def stage_ranks(pp: int, vpp: int, v_shape: bool = False) -> np.ndarray:
    """(pp*vpp,) the pipeline rank of each model stage: s, s + pp, ... on rank s, or the V of ZB-V."""
    v = np.arange(pp * vpp)
    return np.where(v < pp, v, 2 * pp - 1 - v) if v_shape else v % pp


def _per_virtual(x: np.ndarray | Sequence[float] | None, pp: int, vpp: int, m: int, what: str, split: bool,
                 v_shape: bool = False) -> np.ndarray:
    """(m,) -> same on every stage; (pp, m) -> per rank; (pp*vpp, m) -> per virtual stage. With `split`, a
    rank's value is divided evenly over its vpp chunks."""
    V = pp * vpp
    if x is None:
        return np.zeros((V, m))
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        if a.shape[0] != m:
            raise ValueError(f"{what}: {a.shape[0]} values for {m} micro-batches")
        out = np.broadcast_to(a, (V, m)).copy()
        return out / vpp if split else out
    if a.ndim == 2 and a.shape == (pp, m):
        out = a[stage_ranks(pp, vpp, v_shape)]  # virtual stage -> the rank that holds it
        return out / vpp if split else out
    if a.ndim == 2 and a.shape == (V, m):
        return np.ascontiguousarray(a)
    raise ValueError(f"{what}: expected shape ({m},), ({pp}, {m}) or ({V}, {m}), got {a.shape}")


def default_backward_order(m: int, edges: np.ndarray) -> np.ndarray:
    """Forward order, except that micro-batches chained by slice edges (earlier, later) go later slice first:
    sort by (last micro-batch that transitively depends on u, -u)."""
    key = np.arange(m, dtype=np.int64)
    if len(edges):
        # edges go from lower to higher index: one pass from the end settles the transitive maximum
        by_src: dict[int, list[int]] = {}
        for a, b in edges:
            by_src.setdefault(int(a), []).append(int(b))
        for u in range(m - 1, -1, -1):
            for v in by_src.get(u, ()):
                key[u] = max(key[u], key[v])
    return np.lexsort((-np.arange(m), key)).astype(np.int64)


def check_backward_order(order: np.ndarray, m: int, edges: np.ndarray) -> None:
    if sorted(order.tolist()) != list(range(m)):
        raise ValueError(f"backward_order must be a permutation of range({m}), got {order.tolist()}")
    pos = np.empty(m, dtype=np.int64)
    pos[order] = np.arange(m)
    for a, b in edges:
        if pos[a] < pos[b]:
            raise ValueError(
                f"backward_order runs micro-batch {a} before {b}, but {b} holds a later slice of a document "
                f"whose earlier slice is in {a}: its key/value gradients are not ready"
            )


def _edge_bytes(kv_bytes, V: int, E: int, vpp: int) -> np.ndarray:
    """(V, E) key/value-gradient bytes per edge: none, (E,) split over a rank's chunks, or (V, E) as given."""
    if kv_bytes is None:
        return np.zeros((V, E))
    kv_in = np.asarray(kv_bytes, dtype=np.float64)
    kv = np.broadcast_to(kv_in / vpp, (V, E)).copy() if kv_in.ndim == 1 else np.ascontiguousarray(kv_in)
    if kv.shape != (V, E):
        raise ValueError(f"kv_bytes: expected ({E},) or ({V}, {E}), got {kv_in.shape}")
    return kv


def _csr(m: int, keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    ptr = np.zeros(m + 1, dtype=np.int64)
    np.add.at(ptr, keys + 1, 1)
    ptr = np.cumsum(ptr)
    return ptr, np.ascontiguousarray(vals[order], dtype=np.int64), order.astype(np.int64)


def simulate(
    fwd: np.ndarray | Sequence[float],
    bwd: np.ndarray | Sequence[float],
    pp: int = 1,
    *,
    schedule: str = "1f1b",
    vpp: int = 1,
    backward_order: np.ndarray | Sequence[int] | None = None,
    slice_edges: np.ndarray | Sequence[tuple[int, int]] | None = None,
    p2p: float = 0.0,
    wgt: np.ndarray | Sequence[float] | None = None,
    act_bytes: np.ndarray | None = None,
    transient_bytes: np.ndarray | None = None,
    kv_bytes: np.ndarray | None = None,
    static_bytes: np.ndarray | Sequence[float] | float | None = None,
) -> SimResult:
    """Simulate one pipeline over m micro-batches.

    fwd, bwd: per micro-batch times, (m,) for the same time on every stage, (pp, m) per pipeline rank (a
    rank's time is split evenly over its vpp chunks), or (pp*vpp, m) per virtual stage. wgt: the weight-gradient
    part of bwd, shaped like it (ZB-H1 runs it as W, the rest as B; default half of bwd). slice_edges: pairs
    (earlier, later) of micro-batches where `later` holds a slice whose earlier keys live in `earlier`.
    act_bytes / transient_bytes: per micro-batch bytes, shaped like fwd (split over chunks too); kv_bytes:
    per edge (E,) or per virtual stage (V, E): the key/value gradient buffer of the edge. static_bytes: per
    rank, added to the memory timeline and peaks.
    """
    kind = SCHEDULES.get(schedule)
    if kind is None:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
    if schedule == "interleaved" and vpp == 1:
        kind = ORDER_1F1B
    if kind == ZB_V and vpp != 2:
        raise ValueError(f"schedule 'zb-v' runs two model chunks per pipeline rank: it needs vpp=2, got vpp={vpp}")
    if schedule not in ("interleaved", "gpipe", "zb-v", "zb-h1") and vpp != 1:
        raise ValueError(f"vpp={vpp} needs schedule 'interleaved', 'zb-h1' (interleaved zero bubble) or 'zb-v' (vpp 2)")
    v_shape = kind == ZB_V
    f_in = np.asarray(fwd, dtype=np.float64)
    m = int(f_in.shape[-1]) if f_in.ndim else 0
    V = pp * vpp
    f = _per_virtual(f_in, pp, vpp, m, "fwd", True, v_shape)
    b = _per_virtual(bwd, pp, vpp, m, "bwd", True, v_shape)
    w = b * 0.5 if wgt is None else _per_virtual(wgt, pp, vpp, m, "wgt", True, v_shape)
    if (w < 0).any() or (w > b).any():
        raise ValueError("wgt: the weight-gradient time must lie between 0 and the backward time")
    act = _per_virtual(act_bytes, pp, vpp, m, "act_bytes", True, v_shape)
    trans = _per_virtual(transient_bytes, pp, vpp, m, "transient_bytes", False, v_shape)
    edges = np.zeros((0, 2), dtype=np.int64) if slice_edges is None else np.asarray(slice_edges, dtype=np.int64).reshape(-1, 2)
    if len(edges):
        if (edges < 0).any() or (edges >= m).any():
            raise ValueError(f"slice edge out of range for {m} micro-batches: {edges.tolist()}")
        if (edges[:, 0] >= edges[:, 1]).any():
            raise ValueError("slice edges must go from an earlier micro-batch to a later one (slices in forward order)")
    kv = _edge_bytes(kv_bytes, V, len(edges), vpp)
    order = default_backward_order(m, edges) if backward_order is None else np.asarray(backward_order, dtype=np.int64)
    check_backward_order(order, m, edges)
    ops = build_ops(pp, vpp, m, kind, order)
    in_ptr, in_src, in_eid = _csr(m, edges[:, 1], edges[:, 0])
    out_ptr, out_dst, out_eid = _csr(m, edges[:, 0], edges[:, 1])
    n = ops.shape[1]
    st = np.empty(V * m * 3)
    fi = np.empty(V * m * 3)
    mt = np.zeros((pp, 2 * n))
    mbytes = np.zeros((pp, 2 * n))
    peak = np.zeros(pp)
    busy = np.zeros(pp)
    t = simulate_kernel(pp, vpp, m, ops, f, b, w, float(p2p), in_ptr, in_src, in_eid, out_ptr, out_dst, out_eid,
                        act, trans, kv, st, fi, mt, mbytes, peak, busy)
    if t < 0:
        hint = ""
        if kind in (ORDER_INTERLEAVED, ZB_H1) and vpp > 1 and m % pp:
            hint = f"; interleaved 1F1B needs the micro-batch count to be a multiple of pp ({m} % {pp} != 0), as Megatron does"
        raise RuntimeError(f"schedule {schedule!r} (pp={pp}, vpp={vpp}, m={m}) deadlocks with backward order {order.tolist()}{hint}")
    stat = np.zeros(pp) if static_bytes is None else np.broadcast_to(np.asarray(static_bytes, dtype=np.float64), (pp,)).copy()
    return SimResult(
        step_time=float(t), pp=pp, vpp=vpp, m=m, busy=busy,
        start=st.reshape(V, m, 3), finish=fi.reshape(V, m, 3), ops=ops,
        peak_bytes=peak + stat, mem_times=mt, mem_bytes=mbytes + stat[:, None], static_bytes=stat, v_shape=v_shape,
    )


def step_time(fwd: np.ndarray, bwd: np.ndarray, pp: int = 1, *, schedule: str = "1f1b", vpp: int = 1, p2p: float = 0.0,
              wgt: np.ndarray | None = None) -> float:
    """Just the step time of one pipeline (no slices, FIFO backward, no memory): the fast path."""
    f = np.ascontiguousarray(fwd, dtype=np.float64)
    b = np.ascontiguousarray(bwd, dtype=np.float64)
    w = b * 0.5 if wgt is None else np.ascontiguousarray(wgt, dtype=np.float64)
    kind = SCHEDULES[schedule]
    offsets = np.array([0, len(f)], dtype=np.int64)
    return float(step_times_ranks(pp, vpp, kind, f, b, w, offsets, p2p)[0])


def gpipe_formula(m: int, pp: int, f: float, b: float) -> float:
    """(m + pp - 1) * (f + b): GPipe's and 1F1B's step time for m equal micro-batches."""
    return (m + pp - 1) * (f + b)


# ----------------------------------------------------------------------------------------------- plans API


def slice_edges_of(micro_batches: Sequence[MicroBatch]) -> tuple[np.ndarray, np.ndarray]:
    """(edges (E, 2), prefix tokens (E,)) of a rank's micro-batches: for each slice (attend_from < start),
    an edge from the micro-batch holding the tokens just before it (doc, ..start) to the slice's micro-batch,
    with the slice's prefix length. Slices whose prefix lives in the same micro-batch give no edge."""
    where: dict[tuple[int, int], int] = {}  # (doc, end) -> micro-batch
    for u, mb in enumerate(micro_batches):
        for s in mb.segments:
            where[(s.doc, s.end)] = u
    edges = []
    prefix = []
    for u, mb in enumerate(micro_batches):
        for s in mb.segments:
            if s.attend_from < s.start:
                src = where.get((s.doc, s.start))
                if src is None:
                    raise ValueError(f"slice {s} of document {s.doc}: no micro-batch on this rank holds tokens ..{s.start}")
                if src != u:
                    edges.append((src, u))
                    prefix.append(s.start - s.attend_from)
    if not edges:
        return np.zeros((0, 2), np.int64), np.zeros(0, np.int64)
    return np.asarray(edges, dtype=np.int64), np.asarray(prefix, dtype=np.int64)


def simulate_rank(
    rank: RankPlan | Sequence[MicroBatch],
    model,
    parallel: ParallelConfig | None = None,
    *,
    schedule: str = "1f1b",
    memory=None,
    use_plan_costs: bool = False,
    p2p: float = 0.0,
    stage_models: Sequence | None = None,
) -> SimResult:
    """Simulate one DP rank's pipeline. `model` is a CostModel (per-stage times; the same on every stage);
    `stage_models` one CostModel per pipeline stage instead (e.g. `measured.measured_stage_profiles` or
    `presets.analytic_stage_profiles`: the embedding and LM head on the first and last stage); `memory` an
    optional memory.MemoryModel for activation/KV/static bytes; `use_plan_costs` takes the micro-batches'
    fwd_cost/bwd_cost as they are."""
    parallel = parallel or ParallelConfig()
    mbs = rank.micro_batches if isinstance(rank, RankPlan) else list(rank)
    bo = rank.backward_order if isinstance(rank, RankPlan) else None
    m = len(mbs)
    if use_plan_costs:
        f = np.array([mb.fwd_cost for mb in mbs], dtype=np.float64)
        b = np.array([mb.bwd_cost for mb in mbs], dtype=np.float64)
    elif stage_models is not None:
        if len(stage_models) != parallel.pp:
            raise ValueError(f"{len(stage_models)} stage models for pp={parallel.pp}")
        fb = [[sm.microbatch_times(mb) for mb in mbs] for sm in stage_models]
        f = np.array([[x[0] for x in row] for row in fb], dtype=np.float64).reshape(parallel.pp, m)
        b = np.array([[x[1] for x in row] for row in fb], dtype=np.float64).reshape(parallel.pp, m)
    else:
        fb = [model.microbatch_times(mb) for mb in mbs]
        f = np.array([x[0] for x in fb], dtype=np.float64).reshape(m)
        b = np.array([x[1] for x in fb], dtype=np.float64).reshape(m)
    edges, prefix = slice_edges_of(mbs)
    pp, vpp = parallel.pp, parallel.vpp
    w = None
    kind = SCHEDULES.get(schedule)
    ranks_of = stage_ranks(pp, vpp, kind == ZB_V)
    if kind in (ZB_H1, ZB_V) and (model is not None or stage_models is not None):
        wt = weight_times(mbs, stage_models if stage_models is not None else [model])
        w = np.minimum(wt if stage_models is not None else wt[0], b)
    act = trans = kv = stat = None
    if memory is not None:
        tokens = np.array([mb.num_tokens / (len(mb.dp_group) if mb.dp_group else 1) for mb in mbs], dtype=np.float64)
        act = np.stack([tokens * memory.activation_bytes_per_token(s) for s in range(pp)])
        trans = np.stack([tokens * memory.transient_bytes_per_token(s) for s in range(pp)])
        if kind == ZB_V:  # the logits transient on the last model stage, rank 0's second chunk
            trans = trans[[pp - 1 if v == 2 * pp - 1 else 0 for v in range(2 * pp)]]
        elif vpp > 1:
            trans = trans[ranks_of]
        kvpt = [memory.kv_grad_bytes_per_token(s) / vpp for s in range(pp)]
        kv = np.stack([prefix * kvpt[ranks_of[v]] for v in range(pp * vpp)]) if len(prefix) else None
        stat = [memory.static_bytes(s) for s in range(pp)]
        stat = v_static_bytes(np.array(stat), memory) if kind == ZB_V else stat
    return simulate(f, b, pp, schedule=schedule, vpp=vpp, backward_order=bo, slice_edges=edges, p2p=p2p, wgt=w,
                    act_bytes=act, transient_bytes=trans, kv_bytes=kv, static_bytes=stat)


@dataclass
class StepSim:
    """A whole step: every DP rank's pipeline simulated; the step ends when the slowest rank does."""

    ranks: list[SimResult]

    @property
    def rank_times(self) -> np.ndarray:
        return np.array([r.step_time for r in self.ranks])

    @property
    def step_time(self) -> float:
        return float(self.rank_times.max()) if self.ranks else 0.0

    @property
    def dp_spread(self) -> float:
        t = self.rank_times
        return float(t.max() / t.mean()) if len(t) and t.mean() > 0 else 1.0

    @property
    def peak_bytes(self) -> float:
        return max((r.peak for r in self.ranks), default=0.0)


def plan_schedule(plan: StepPlan, schedule: str, vpp: int = 1) -> str:
    """The schedule a step runs: the configured one, or under "auto" the one its planner chose (when the
    planner chose none, a planner other than `auto`: 1F1B, interleaved 1F1B at vpp > 1, the default `auto` tries
    first)."""
    if schedule != "auto":
        return schedule
    return plan.schedule or ("1f1b" if vpp == 1 else "interleaved")


def simulate_step(
    plan: StepPlan,
    model,
    parallel: ParallelConfig | None = None,
    *,
    schedule: str = "1f1b",
    memory=None,
    use_plan_costs: bool = False,
    p2p: float = 0.0,
) -> StepSim:
    """Simulate every DP rank of a step. `model`: one CostModel, or one per rank (a sequence or a
    memory.RankCosts). A DP-Merge micro-batch is simulated on each rank of its group at its per-rank cost."""
    models = _per_rank(model, len(plan.ranks))
    schedule = plan_schedule(plan, schedule, (parallel or ParallelConfig()).vpp)
    return StepSim([
        simulate_rank(r, models[i], parallel, schedule=schedule, memory=memory, use_plan_costs=use_plan_costs, p2p=p2p)
        for i, r in enumerate(plan.ranks)
    ])
