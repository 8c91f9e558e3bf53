"""Interleaved 1F1B and its zero-bubble form (vpp > 1) and ZB-V for sliced plans (issue 25, item 3): the simulator
against schedules worked out by hand and against torch.distributed.pipelining's own generated orders
(ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble), the KV carry between slices held under both (random slice chains, each order checked by
the runtime's independent list check), and PlanPipelineSchedule running the written lists over gloo at 2 and 4
pipeline ranks (4 and 8 model stages) with slices and an empty micro-batch: gradients equal a whole-document
reference, the executed order equals the written lists, and the carried key/value gradient accumulators stay
within the simulator's estimate after every action."""

from __future__ import annotations

import types

import msgspec
import numpy as np
import pytest
import torch
from helpers.distributed import run_ranks
from helpers.pipeline_model import HAND, HAND_LENGTHS, HD, HKV, Llama, documents, loss_fn, reference, stage_layers
from helpers.pipeline_run import assert_grads_close, grads_of, plan_inputs, sliced_stage
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from packloader.balancers.cost.model import CostModel
from packloader.balancers.sim.actions import rank_actions, step_actions
from packloader.balancers.sim.simulator import simulate, slice_edges_of
from packloader.contracts import (
    ConfigError,
    CostProfile,
    MicroBatch,
    ParallelConfig,
    PlanConfig,
    Poly,
    RankPlan,
    Segment,
    StepPlan,
)
from packloader.runtime.pipeline_actions import engine_actions

LINEAR = CostModel(CostProfile(name="linear", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 1.0, 0),
                               lin_bwd=Poly(0, 2.0, 0)))
OPS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
RTOL = 1e-9


def _torch_order(cls, pp: int, m: int, rank: int, **extra) -> list[list]:
    """torch's own compute actions of one rank, as [op, micro_batch, stage] (idle slots dropped)."""
    ns = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp, **extra)
    return [[OPS[a.computation_type.name], a.microbatch_index, a.stage_index]
            for a in cls._calculate_single_rank_operations(ns, rank) if a is not None]


# ----------------------------------------------------------------------------------------------- simulator


def test_zbv_by_hand_two_ranks_two_micro_batches():
    # pp = 2, vpp = 2: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. A rank's f = 2, b = 4 split over its
    # two chunks: F = 1, B = 1 and W = 1 per chunk (wgt = half the backward). The order is torch's template for
    # max(2*pp-1, m) = 3 micro-batches with the third's slots dropped; the dependencies then give:
    # rank 0: F0@0 [0,1] F1@0 [1,2] F0@3 [3,4] B0@3 [4,5] W0@3 [5,6] F1@3 [6,7] B1@3 [7,8] W1@3 [8,9]
    #         B0@0 [9,10] W0@0 [10,11] B1@0 [12,13] W1@0 [13,14]
    # rank 1: F0@1 [1,2] F0@2 [2,3] F1@1 [3,4] F1@2 [4,5] B0@2 [5,6] W0@2 [6,7] B0@1 [7,8] W0@1 [8,9]
    #         B1@2 [9,10] W1@2 [10,11] B1@1 [11,12] W1@1 [12,13]
    r = simulate([2, 2], [4, 4], pp=2, vpp=2, schedule="zb-v", wgt=[2, 2])
    acts = rank_actions(r)
    assert acts[0] == [["F", 0, 0], ["F", 1, 0], ["F", 0, 3], ["B", 0, 3], ["W", 0, 3], ["F", 1, 3], ["B", 1, 3],
                       ["W", 1, 3], ["B", 0, 0], ["W", 0, 0], ["B", 1, 0], ["W", 1, 0]]
    assert acts[1] == [["F", 0, 1], ["F", 0, 2], ["F", 1, 1], ["F", 1, 2], ["B", 0, 2], ["W", 0, 2], ["B", 0, 1],
                       ["W", 0, 1], ["B", 1, 2], ["W", 1, 2], ["B", 1, 1], ["W", 1, 1]]
    expect = {  # (stage, micro-batch, op 0 F / 1 B / 2 W): start
        (0, 0, 0): 0, (0, 1, 0): 1, (1, 0, 0): 1, (2, 0, 0): 2, (1, 1, 0): 3, (2, 1, 0): 4, (3, 0, 0): 3,
        (3, 0, 1): 4, (3, 0, 2): 5, (3, 1, 0): 6, (3, 1, 1): 7, (3, 1, 2): 8, (2, 0, 1): 5, (2, 0, 2): 6,
        (1, 0, 1): 7, (1, 0, 2): 8, (2, 1, 1): 9, (2, 1, 2): 10, (1, 1, 1): 11, (1, 1, 2): 12, (0, 0, 1): 9,
        (0, 0, 2): 10, (0, 1, 1): 12, (0, 1, 2): 13,
    }
    for (v, u, op), t in expect.items():
        assert r.start[v, u, op] == t, (v, u, op, r.start[v, u, op])
    assert r.step_time == 14
    assert r.busy.tolist() == [12, 12]
    assert r.order(0)[2] == ("F", 0, 1)  # stage 3 is rank 0's second chunk


def test_zbv_by_hand_one_rank_with_a_slice():
    # pp = 1: stages 0 and 1 on one rank; micro-batch 1 holds a slice reading micro-batch 0's keys, so its
    # backward goes first (order [1, 0, 2]). torch's template for one rank: F@0 | F@1 B@1 W@1 | (F@0 B@0 W@0
    # F@1 B@1 W@1) ... | B@0 W@0. Its first B (slot 0) is micro-batch 1, whose forward has not run: there the
    # rank runs all its remaining forwards (chunk 0's one ahead of chunk 1's: lead 2*(pp-0)-1 = 1), and the
    # template's later forward slots run nothing.
    r = simulate([2, 2, 2], [4, 4, 4], pp=1, vpp=2, schedule="zb-v", slice_edges=[(0, 1)])
    assert rank_actions(r)[0] == [
        ["F", 0, 0], ["F", 0, 1], ["F", 1, 0], ["F", 1, 1], ["F", 2, 0], ["F", 2, 1], ["B", 1, 1], ["W", 1, 1],
        ["B", 1, 0], ["W", 1, 0], ["B", 0, 1], ["W", 0, 1], ["B", 0, 0], ["W", 0, 0], ["B", 2, 1], ["W", 2, 1],
        ["B", 2, 0], ["W", 2, 0]]
    # one rank never idles: F = B = W = 1 per chunk, 18 tasks
    assert r.step_time == 18
    # the KV carry: 1's forward after 0's, 0's backward after 1's, on each stage
    for v in range(2):
        assert r.start[v, 1, 0] >= r.finish[v, 0, 0] and r.start[v, 0, 1] >= r.finish[v, 1, 1]


def test_zbv_slice_chain_flows_through_the_v():
    # pp = 4, a document in 16 slices (one chain over all micro-batches): no backward can start before the last
    # slice's forward, so every rank runs its 16 forwards of each chunk first. Rank 0 keeps chunk 0 (stage 0)
    # 7 micro-batches ahead of chunk 1 (stage 7): F0..6@0, then F(u + 7)@0 before F(u)@7. Both ranks' work is
    # f = 1, b = 2 per micro-batch (0.5 per chunk forward, 0.5 B and 0.5 W): the forwards flow through the V
    # at one chunk-forward per 0.5 (stage 7 gets micro-batch u at 3.5 + u), and the backwards run back to
    # back from 19.0 (after F15@7 [18.5, 19.0]) on rank 0.
    m = 16
    r = simulate(np.ones(m), 2 * np.ones(m), pp=4, vpp=2, schedule="zb-v", slice_edges=[(i, i + 1) for i in range(m - 1)])
    first = rank_actions(r)[0][:2 * m]
    assert first[:7] == [["F", u, 0] for u in range(7)]
    assert first[7:25] == [x for u in range(9) for x in (["F", u, 7], ["F", u + 7, 0])]
    assert first[25:] == [["F", u, 7] for u in range(9, 16)]
    assert [r.start[7, u, 0] for u in range(m)] == [3.5 + u for u in range(m)]
    assert r.start[7, 15, 1] == 19.0
    # interleaved 1F1B gives the same step time here; a schedule that crossed the V one micro-batch at a time
    # (chunk 1 right behind chunk 0) would wait ~3 per micro-batch on rank 0
    il = simulate(np.ones(m), 2 * np.ones(m), pp=4, vpp=2, schedule="interleaved",
                  slice_edges=[(i, i + 1) for i in range(m - 1)])
    assert r.step_time == pytest.approx(il.step_time)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_zbv_order_is_torchs(pp):
    for m in (1, 2, 3, 5, 8, 11):
        r = simulate(np.ones(m), 2 * np.ones(m), pp=pp, vpp=2, schedule="zb-v")
        for s in range(pp):
            assert rank_actions(r)[s] == _torch_order(ScheduleZBVZeroBubble, pp, m, s), (pp, m, s)


@pytest.mark.parametrize("pp,vpp", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
@pytest.mark.parametrize("schedule,cls", [("interleaved", ScheduleInterleaved1F1B),
                                          ("zb-h1", ScheduleInterleavedZeroBubble)])
def test_interleaved_order_is_torchs(pp, vpp, schedule, cls):
    """Interleaved 1F1B, and ZB-H1 at vpp > 1 as torch's interleaved zero bubble (one warm-up forward per hop,
    split backwards, rank s keeping s Ws back)."""
    for m in (pp, 2 * pp, 3 * pp):
        r = simulate(np.ones(m), 2 * np.ones(m), pp=pp, vpp=vpp, schedule=schedule)
        rounds = max(1, m // pp)
        for s in range(pp):
            ref = _torch_order(cls, pp, m, s, n_local_stages=vpp, number_of_rounds=rounds,
                               microbatches_per_round=m // rounds)
            assert rank_actions(r)[s] == ref, (pp, vpp, m, s)


def _chains(rng, m):
    edges, u = [], 0
    while u < m - 1:
        if rng.random() < 0.4:
            n = int(rng.integers(2, min(6, m - u) + 1))
            edges += [(u + i, u + i + 1) for i in range(n - 1)]
            u += n - 1
        else:
            u += 1
    return edges


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved", "zb-h1"])
def test_sliced_orders_hold_the_kv_carry(schedule):
    """Random slice chains: the schedule never deadlocks, and every rank's order passes the runtime's own list
    check (each stage: a slice's forward after its keys' micro-batch's, their backwards the other way round)."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        pp = int(rng.integers(1, 5))
        m = int(rng.integers(1, 4)) * pp if schedule != "zb-v" else int(rng.integers(1, 13))
        edges = _chains(rng, m)
        f = rng.random(m) + 0.1
        r = simulate(f, 2.5 * f, pp=pp, vpp=2, schedule=schedule, slice_edges=edges)
        readers: dict[int, set[int]] = {}
        for a, b in edges:
            readers.setdefault(a, set()).add(b)
        engine_actions(rank_actions(r), m, pp, 2, readers, v_shape=schedule == "zb-v")
        # the slices' dependencies in time, on every stage
        for a, b in edges:
            assert (r.start[:, b, 0] >= r.finish[:, a, 0]).all()
            assert (r.start[:, a, 1] >= r.finish[:, b, 1]).all()
        assert r.busy.sum() == pytest.approx(3.5 * f.sum() * pp)  # every rank: f + b of every micro-batch


def test_zbv_needs_two_chunks_and_auto_considers_it():
    from packloader.balancers.planners.config_rules import validate_config
    from packloader.balancers.planners.schedule_choice import KIND_NAMES, schedule_kinds

    with pytest.raises(ValueError, match="needs vpp=2"):
        simulate(np.ones(4), np.ones(4), pp=2, vpp=1, schedule="zb-v")
    with pytest.raises(ConfigError, match="expected vpp=2"):
        validate_config(PlanConfig(parallel=ParallelConfig(pp=2, vpp=3), schedule="zb-v"))
    kinds = lambda vpp: [KIND_NAMES[k] for k in schedule_kinds(PlanConfig(parallel=ParallelConfig(pp=4, vpp=vpp),  # noqa: E731
                                                                          schedule="auto"))]
    assert kinds(1) == ["1f1b", "zb-h1"] and kinds(2) == ["interleaved", "zb-h1", "zb-v"]
    assert kinds(3) == ["interleaved", "zb-h1"]


def test_auto_at_vpp2_plans_and_writes_zbv_lists():
    """`auto` under --schedule auto at vpp 2 scores interleaved 1F1B and ZB-V; its step records the choice,
    and the written lists follow it (V placement and W actions for ZB-V)."""
    from packloader.balancers.factory import make_planner
    from packloader.balancers.planners.registry import Window
    from packloader.contracts import PlannerState

    lens = [700, 90, 140, 220, 50, 310, 120, 80, 170, 400, 60, 110] * 2
    w = Window(np.arange(len(lens), dtype=np.int64), np.zeros(len(lens), np.int64), np.array(lens, np.int64))
    cfg = PlanConfig(parallel=ParallelConfig(pp=2, vpp=2), max_tokens=512, context=1024, tokens_per_step=sum(lens),
                     num_micro_batches=8, schedule="auto")
    plan, _ = make_planner(cfg).plan(w, PlannerState(), 0)
    assert plan.schedule in ("interleaved", "zb-h1", "zb-v")
    lists = step_actions(plan, LINEAR, cfg.parallel, schedule="auto")[0]
    stages = {a[2] for a in lists[0]}
    assert stages == ({0, 3} if plan.schedule == "zb-v" else {0, 2})
    assert any(a[0] == "W" for a in lists[0]) == (plan.schedule != "interleaved")


# ------------------------------------------------------------------------------------------ runs over gloo

WITH_EMPTY = RankPlan(micro_batches=HAND.micro_batches[:6] + [MicroBatch(segments=[]), HAND.micro_batches[7]])
WITH_EMPTY_LENGTHS = {d: n for d, n in HAND_LENGTHS.items() if d != 106}


def _written(rank_plan: RankPlan, pp: int, schedule: str) -> list:
    """The record's "actions" of the plan as `packloader plan` writes them: through JSON and back."""
    acts = step_actions(StepPlan(step=0, ranks=[rank_plan]), LINEAR, ParallelConfig(pp=pp, vpp=2), schedule=schedule)
    return msgspec.json.decode(msgspec.json.encode(acts))[0]


def _stages_of(model, rank, pp, schedule, layers):
    n = 2 * pp
    held = sorted({rank, n - 1 - rank}) if schedule == "zb-v" else [rank, rank + pp]
    return [sliced_stage(model, layers, si, n) for si in held]


def _run(rank, world, cases, layers):
    import torch.distributed as dist

    from packloader.runtime.pipeline import PlanPipelineSchedule

    torch.set_num_threads(1)
    out = []
    for rank_plan, lengths, schedule, lists in cases:
        model = Llama(layers)
        stages = _stages_of(model, rank, world, schedule, layers)
        sched = PlanPipelineSchedule(stages, loss_fn, schedule=schedule)
        losses: list = []
        sched.step_plan(rank_plan, actions=lists, losses=losses,
                        **plan_inputs(rank_plan.micro_batches, documents(lengths)))
        # the rank's accumulator bytes after each action: the acting stage's sample plus the other's last
        last = {st.stage_index: 0 for st in stages}
        it = {st.stage_index: iter(st.kv_trace) for st in stages}
        grad_bytes = []
        for _, _, si in sched.executed:
            last[si] = next(it[si]).grad_bytes
            grad_bytes.append(sum(last.values()))
        out.append(dict(grads=grads_of(model),
                        loss=sum(float(x.detach()) for x in losses) if any(st.is_last for st in stages) else None,
                        executed=[list(a) for a in sched.executed], left=sum(len(st.cache) for st in stages),
                        grad_bytes=grad_bytes))
        dist.barrier()
    return out


def _simulated_grad_bytes(rank_plan, pp, schedule, layers):
    """The simulator's key/value-gradient bytes on each pipeline rank after each of its actions (float64 dK and
    dV of every layer a stage holds, per prefix token)."""
    mbs = rank_plan.micro_batches
    edges, prefix = slice_edges_of(mbs)
    per_token = [2 * HKV * HD * 8 * (hi - lo) for lo, hi in stage_layers(layers, 2 * pp)]
    kv = np.stack([prefix * float(t) for t in per_token])
    m = len(mbs)
    sim = simulate(np.ones(m), np.ones(m), pp, vpp=2, schedule=schedule, backward_order=rank_plan.backward_order,
                   slice_edges=edges, kv_bytes=kv)
    return sim.mem_bytes[:, 1::2]


def _check(res, rank_plan, lengths, schedule, lists, pp, layers, what):
    got: dict = {}
    sim = _simulated_grad_bytes(rank_plan, pp, schedule, layers)
    for s in range(pp):
        r = res[s]
        assert r["executed"] == lists[s], f"{what}: pipeline rank {s} ran another order than the written one"
        assert r["left"] == 0
        assert len(r["grad_bytes"]) == sim.shape[1]
        assert all(g <= e for g, e in zip(r["grad_bytes"], sim[s])), (what, s, r["grad_bytes"], sim[s].tolist())
        for k, g in r["grads"].items():
            assert k not in got, (what, k)
            got[k] = g
    ref_loss, ref = reference(Llama(layers), documents(lengths))
    assert_grads_close(got, ref, RTOL, what)
    losses = [r["loss"] for r in res if r["loss"] is not None]  # the last stage's rank: 0 under ZB-V, else pp-1
    assert len(losses) == 1 and losses[0] == pytest.approx(ref_loss, rel=RTOL)
    return max(max(r["grad_bytes"]) for r in res)


def _cases(pp):
    plans = [(HAND, HAND_LENGTHS), (WITH_EMPTY, WITH_EMPTY_LENGTHS)]
    return [(p, lens, sched, _written(p, pp, sched)) for p, lens in plans for sched in ("interleaved", "zb-h1", "zb-v")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("pp,layers", [(2, 4), (4, 8)])
def test_written_vpp_lists_run_over_gloo(pp, layers):
    cases = _cases(pp)
    res = run_ranks(_run, pp, cases, layers)
    held = 0
    for ci, (p, lens, sched, lists) in enumerate(cases):
        per_rank = [res[s][ci] for s in range(pp)]
        held = max(held, _check(per_rank, p, lens, sched, lists, pp, layers, f"pp {pp} case {ci} ({sched})"))
        assert any(a[0] == "W" for a in lists[0]) == (sched != "interleaved")
    assert held > 0  # the accumulators held something (the bound above was not met by zeros alone)


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved", "zb-h1", "auto"])
def test_plan_cli_writes_vpp_lists(tmp_path, capsys, schedule):
    """`packloader plan --vpp 2`: every record's lists pass the runtime's check under the placement of the
    step's schedule (the V for ZB-V), with the plan's slices; zb-v without --vpp 2 is refused naming both flags."""
    import json

    from packloader.cli.main import main
    from packloader.runtime.pipeline import _readers

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(800), 1.5, 300), 1, 20000).astype(np.int64)
    lengths[7] = 0
    np.save(tmp_path / "l.npy", lengths)
    out = tmp_path / "p.jsonl"
    args = ["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--pp", "2", "--tp", "4", "--max-tokens", "8192",
            "--context", "16384", "--tokens-per-step", "60000", "--steps", "3", "--micro-batches", "4",
            "--schedule", schedule, "--out", str(out), "--quiet"]
    assert main(args + ["--vpp", "2"]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs
    sliced = 0
    for rec in recs:
        step_schedule = rec.get("schedule", schedule)
        assert step_schedule == schedule or (schedule == "auto" and step_schedule in ("interleaved", "zb-h1", "zb-v"))
        for lists, rp in zip(rec["actions"], rec["ranks"]):
            mbs = [MicroBatch(segments=[Segment(*x) for x in mb]) for mb in rp]
            readers = _readers(mbs)
            sliced += bool(readers)
            engine_actions(lists, len(mbs), 2, 2, readers, v_shape=step_schedule == "zb-v")
            assert {a[2] for a in lists[0]} == ({0, 3} if step_schedule == "zb-v" else {0, 2})
            assert any(a[0] == "W" for a in lists[0]) == (step_schedule != "interleaved")
    assert sliced  # some lists carried slices
    if schedule == "zb-v":
        assert main(args) == 2
        assert "invalid configuration (--schedule, --vpp)" in capsys.readouterr().err


def test_zbv_memory_puts_the_lm_head_on_rank_0():
    """Under ZB-V rank 0 holds the last model stage: the LM head's static bytes and the logits transient are
    counted there, not on rank pp-1 (the memory model's own placement)."""
    from packloader.balancers.cost.memory import MemoryModel
    from packloader.balancers.sim.simulator import simulate_rank

    par = ParallelConfig(pp=2, tp=2, vpp=2, dp=4)
    mem = MemoryModel.for_preset("llama3-8b", par)
    shape = mem.shape
    head = (shape.vocab * shape.hidden + shape.hidden) / par.tp * (6.0 + 12.0 / par.dp)  # head + final norm
    mbs = [MicroBatch(segments=[Segment(d, 0, 1000, 0)]) for d in range(4)]
    loop = simulate_rank(mbs, LINEAR, par, schedule="interleaved", memory=mem)
    v = simulate_rank(mbs, LINEAR, par, schedule="zb-v", memory=mem)
    assert v.static_bytes[0] == pytest.approx(loop.static_bytes[0] + head)
    assert v.static_bytes[1] == pytest.approx(loop.static_bytes[1] - head)
    # the logits transient (vocab x 6 bytes / tp per token) lives while rank 0 runs a forward of the last stage
    # (stage 3): what a forward frees at its end is its transient
    logits = shape.vocab * 6 / par.tp * 1000
    for rank in range(2):
        for k, (op, _, chunk) in enumerate(v.order(rank)):
            if op == "F":
                freed = v.mem_bytes[rank, 2 * k] - v.mem_bytes[rank, 2 * k + 1]
                assert freed == pytest.approx(logits if (rank, chunk) == (0, 1) else 0.0), (rank, k)
