"""Per-document CP with slice chains (issue 26): a long document cut into slices that run at a smaller CP size, on one
subgroup in consecutive slots. Against a brute force over every placement of a tiny step (whole documents and
chains alike, each priced independently here), a device too small for a chain's activations, exactly-once
coverage, the checker, and the per-document CP collate's chain check (tests/test_dynamic_cp_chains_runtime.py runs
chains over gloo)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from helpers.dynamic_cp_brute import brute_force, cfg, check_tokens_once_and_chains, segments_of

from packloader.balancers.cost.memory import GiB, memory_model_for
from packloader.balancers.factory import make_planner
from packloader.balancers.offline import plan_run
from packloader.balancers.planners.doc_cp.planner import DynamicCPOptions, DynamicCPPlanner
from packloader.balancers.planners.registry import Window
from packloader.balancers.sim.metrics import score_plan
from packloader.balancers.sim.verify import verify_plan
from packloader.collate.cp_document_shards import check_chains, plan_dynamic_cp
from packloader.contracts import CPPlacement, ParallelConfig, PlannerState

# ------------------------------------------------------------------ tests


def test_dynamic_cp_chains_two_documents_on_one_gpu_each_beat_cp2_as_the_brute_force_finds():
    # G = 2 GPUs of 8192 tokens a slot, two slots, two documents of 16384: each needs both GPUs whole, so whole they
    # take a slot each on CP 2 (an all-gather across nodes at TP 8); chained, each runs as two 8192-token slices
    # on one GPU, the second after the first's keys, no CP traffic. The brute force over both (every placement)
    # finds the chains strictly faster, and they fit the H100 (2 x 8192 tokens of activations per GPU).
    lengths = [16384, 16384]
    config = cfg(micro_batches=2)
    planner = make_planner(config)
    best, combo = brute_force(lengths, planner, 2)
    whole, _ = brute_force(lengths, planner, 2, chains=False)
    assert all(len(o) == 2 and o[0][2] == 1 for o in combo) and best < whole * 0.99
    plan, _ = planner.plan(Window.from_lengths(np.array(lengths)), PlannerState(), 0)
    segs = segments_of(plan)
    assert [(d, a, m, s, af) for d, a, m, _, s, af in segs] == [(0, 0, 0, 1, 0), (0, 8192, 1, 1, 0),
                                                               (1, 0, 0, 1, 0), (1, 8192, 1, 1, 0)]
    assert {f for d, _, _, f, _, _ in segs if d == 0} != {f for d, _, _, f, _, _ in segs if d == 1}
    assert score_plan(plan, planner.cost.model, config.parallel).step_time == pytest.approx(best, rel=1e-9)
    verify_plan([plan], Window.from_lengths(np.array(lengths)))


def test_dynamic_cp_chains_not_taken_where_memory_forbids_them():
    # the same step on a device whose memory holds one slot's 8192 tokens per GPU but not a chain's 16384: the
    # planner keeps the documents whole on CP 2 (hand-worked bytes: static + activations of 8192 tokens fit,
    # static + activations of 16384 tokens, what a chain keeps until its backward, do not)
    lengths = [16384, 16384]
    base = cfg(micro_batches=2)
    mem = memory_model_for(base.model, ParallelConfig(dp=1, cp=1, tp=8), "1f1b", "h100")
    per = mem.activation_bytes_per_token() + mem.transient_bytes_per_token()
    limit = mem.static_bytes() + 1.5 * 8192 * per  # between one slot's peak and a chain's
    gib = (limit + mem.reserve_gib * GiB) / (GiB * mem.usable_fraction)
    assert mem.static_bytes() + 8192 * per < limit < mem.static_bytes() + 16384 * mem.activation_bytes_per_token()
    planner = make_planner(cfg(micro_batches=2, memory_gib=gib))
    plan, _ = planner.plan(Window.from_lengths(np.array(lengths)), PlannerState(), 0)
    segs = segments_of(plan)
    assert [(d, a, s, af) for d, a, _, _, s, af in segs] == [(0, 0, 2, 0), (1, 0, 2, 0)]
    roomy, _ = make_planner(cfg(micro_batches=2)).plan(Window.from_lengths(np.array(lengths)), PlannerState(), 0)
    assert len(segments_of(roomy)) == 4  # the same step with the H100's memory: chained (test above)


def test_dynamic_cp_chains_on_by_default_off_without_slicing_or_by_option():
    lengths = np.array([16384, 16384])
    for planner in (DynamicCPPlanner(cfg(micro_batches=2, allow_slicing=False)),
                    DynamicCPPlanner(cfg(micro_batches=2), DynamicCPOptions(chains=False)),
                    make_planner(cfg(micro_batches=2, planner_options={"dynamic-cp": {"chains": False}}))):
        plan, _ = planner.plan(Window.from_lengths(lengths), PlannerState(), 0)
        assert all(af == a for _, a, _, _, _, af in segments_of(plan))
    plan, _ = make_planner(cfg(micro_batches=2)).plan(Window.from_lengths(lengths), PlannerState(), 0)
    assert DynamicCPOptions().chains and sum(af < a for _, a, _, _, _, af in segments_of(plan)) == 2


@pytest.mark.parametrize("seed", range(3))
def test_dynamic_cp_chains_cover_every_token_once_in_consecutive_slots(seed):
    rng = np.random.default_rng(260 + seed)
    lengths = np.concatenate([rng.integers(50, 3000, 60), rng.integers(9000, 40000, 6)])
    rng.shuffle(lengths)
    config = cfg(dp=2, cp=4, max_tokens=16384, context=65536, tps=50000)  # 8 GPUs of 4096 tokens a slot
    run = plan_run(lengths, config, steps=None)
    verify_plan(run.plans, run.windows, final_state=run.final_state)
    assert check_tokens_once_and_chains(run.plans, lengths) > 0


def test_dynamic_cp_chains_pass_the_per_document_collate_and_a_moved_chain_is_refused():
    # a chained plan's slices follow their earlier slices on the same GPU: every GPU's step passes the collate's
    # chain check and the second slice's runs count its 8192 earlier keys first; the same chain with its second
    # slice on the other GPU is refused (its earlier keys were kept on GPU 0), naming the segment
    plan, _ = make_planner(cfg(micro_batches=2)).plan(Window.from_lengths(np.array([16384, 16384])), PlannerState(), 0)
    for g, rank in enumerate(plan.ranks):
        check_chains(rank.micro_batches, gpu=g, step=0)
        shard = plan_dynamic_cp(rank.micro_batches[1], gpu=g, pool=2)
        assert shard.run_prefix.tolist() == [8192] and shard.cu_seqlens_k.tolist() == [0, 16384]
        assert shard.position_ids.tolist() == list(range(8192, 16384))
    first, second = plan.ranks[0].micro_batches
    other = msgspec.structs.replace(second, cp=[CPPlacement(1, 1)])
    with pytest.raises(ValueError, match=r"step 0, micro-batch 1 of pool GPU 1: segment 0 \(document \d, tokens "
                                         r"8192\.\.16383\) is a slice on GPUs 1\.\.1, but token 0 .*same CPPlacement"):
        check_chains([msgspec.structs.replace(first, segments=[], cp=[]), other], gpu=1, step=0)
