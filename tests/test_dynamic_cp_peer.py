"""benchmarks/peers/megatron_hybrid_cp.py: megatron-core's hybrid-CP schedule turned into a dynamic-CP StepPlan.

The references are a schedule worked out by hand from megatron's code (below) and megatron's own scheduler called
here directly, its output read the way its training schedule reads it (a sample's CP size is the number of GPUs of
a group whose list holds it).
"""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hybrid_cp = pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")

from packloader.contracts import CPPlacement, Segment, StepPlan  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from peers.megatron_hybrid_cp import (  # noqa: E402
    MegatronSchedulerError,
    barrier_step_time,
    megatron_cp_groups,
    megatron_hybrid_cp_plan,
    megatron_slots,
)


def layout(plan: StepPlan) -> list[list[list[tuple[int, int, int]]]]:
    """Per pool GPU, per micro-batch: (doc, CP size, first GPU) of each segment."""
    return [[[(s.doc, c.size, c.first) for s, c in zip(mb.segments, mb.cp, strict=True)] for mb in r.micro_batches]
            for r in plan.ranks]


def test_dynamic_cp_peer_hand_worked_schedule():
    """DP 2 x CP 2, 100 tokens per GPU. Megatron's CP sizes: 300 -> 4 (300/100 = 3, next power of two), 150 -> 2,
    the rest 1; workloads L^2 / size: 22500, 11250, 6400, 3600, 2500, 1600. First group: the CP-4 sample takes
    all four GPUs and nothing else fits, so the group closes. Second group: buckets [150], [80, 60, 50], [40]
    (target 25350 / 2, closed past 1.1 x target); 150 on GPUs 0-1, 80 on GPU 2, 60 on GPU 3 (free GPUs first),
    50 and 40 on the least loaded CP-1 GPU, 3 (3600, then 6100, against GPU 2's 6400)."""
    lengths = [300, 150, 80, 60, 50, 40]
    plan = megatron_hybrid_cp_plan(lengths, dp=2, cp=2, max_tokens_per_gpu=100)
    assert plan.cp_mode == "dynamic" and len(plan.ranks) == 4
    assert layout(plan) == [  # one micro-batch per sub-sample, as megatron runs them; group 2 takes 3 slots
        [[(0, 4, 0)], [(1, 2, 0)], [], []],
        [[(0, 4, 0)], [(1, 2, 0)], [], []],
        [[(0, 4, 0)], [(2, 1, 2)], [], []],
        [[(0, 4, 0)], [(3, 1, 3)], [(4, 1, 3)], [(5, 1, 3)]],
    ]
    assert megatron_slots(plan) == [range(0, 1), range(1, 4)]
    assert [s.end for mb in plan.ranks[3].micro_batches[1:] for s in mb.segments] == [60, 50, 40]
    grouped = megatron_hybrid_cp_plan(lengths, dp=2, cp=2, max_tokens_per_gpu=100, layout="group")
    assert layout(grouped) == [
        [[(0, 4, 0)], [(1, 2, 0)]],
        [[(0, 4, 0)], [(1, 2, 0)]],
        [[(0, 4, 0)], [(2, 1, 2)]],
        [[(0, 4, 0)], [(3, 1, 3), (4, 1, 3), (5, 1, 3)]],
    ]
    assert megatron_slots(grouped) == [range(0, 1), range(1, 2)]
    assert plan.extra["megatron_groups"] == 2
    # busy per GPU in group 2: 11250, 11250, 6400, 3600 + 2500 + 1600; group 1 has none idle
    assert plan.extra["megatron_idle_share"] == pytest.approx((4 * 11250 - 36600) / (4 * 22500 + 4 * 11250))
    # to multiples of 2 x DP x CP = 8: 300 + 4, 150 + 2, 60 + 4, 50 + 6; its CP split alone: 300 to 8, 150 to 4
    assert plan.extra["pad_tokens_required"] == 16
    assert plan.extra["pad_tokens_min"] == 6
    assert plan.extra["placements_outside_megatron_groups"] == 0
    sp = megatron_hybrid_cp_plan(lengths, dp=2, cp=2, max_tokens_per_gpu=100, sequence_parallel_tp=2)
    assert sp.extra["pad_tokens_required"] == 4 + 10 + 0 + 4 + 14 + 8  # multiples of 16
    # a time per sub-sample share of L / size tokens: group 1 lasts 75, group 2 its busiest GPU, 3 (60 + 50 + 40)
    times = [[sum(s.end / c.size for s, c in zip(r.micro_batches[m].segments, r.micro_batches[m].cp))
              for r in plan.ranks] for m in range(4)]
    assert barrier_step_time(plan, times) == pytest.approx(75 + 150)


def megatron_reference(lengths, pool, cap):
    """Megatron's scheduler built directly (not through its data-loader wrapper), its group read per sample."""

    class Pool:
        def size(self):
            return pool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler = hybrid_cp.BalancedCPScheduler(max_seq_len_per_rank=cap, dp_cp_group=Pool())
        _, groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    return groups


def random_lengths(rng, pool, cap):
    n = rng.randint(1, 50)
    return [min(max(1, int(rng.lognormvariate(rng.uniform(2.5, 5), rng.uniform(0.5, 1.8)))), pool * cap)
            for _ in range(n)]


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 2), (4, 2), (2, 4), (4, 4), (1, 8)])
def test_dynamic_cp_peer_same_groups_as_megatron(dp, cp):
    rng = random.Random(dp * 100 + cp)
    pool = dp * cp
    for trial in range(25):
        cap = rng.choice([64, 100, 256])
        lengths = random_lengths(rng, pool, cap)
        mode = ("sample", "group")[trial % 2]
        plan = megatron_hybrid_cp_plan(np.array(lengths), dp=dp, cp=cp, max_tokens_per_gpu=cap, layout=mode)
        groups = megatron_reference(lengths, pool, cap)
        slots = megatron_slots(plan)
        assert len(slots) == len(groups)
        assert all(len(r.micro_batches) == slots[-1].stop for r in plan.ranks)
        for group, group_slots in zip(groups, slots):
            for gpu in range(pool):
                mbs = [plan.ranks[gpu].micro_batches[m] for m in group_slots]
                assert [s.doc for mb in mbs for s in mb.segments] == group[gpu]
                if mode == "sample":  # one sub-sample per micro-batch, the rest of the group's slots empty
                    assert [len(mb.segments) for mb in mbs] == [1] * len(group[gpu]) + [0] * (len(mbs) - len(group[gpu]))
                for s, place in ((s, c) for mb in mbs for s, c in zip(mb.segments, mb.cp, strict=True)):
                    holders = [g for g in range(pool) if s.doc in group[g]]
                    # megatron's local_cp_size: the number of GPUs of the group holding the sample
                    assert place.size == len([True for ids in group if s.doc in ids])
                    assert holders == list(range(place.first, place.first + place.size))


@pytest.mark.parametrize("dp,cp", [(2, 2), (4, 4), (8, 2)])
def test_dynamic_cp_peer_every_document_once_within_the_memory_cap(dp, cp):
    rng = random.Random(7 + dp * cp)
    pool = dp * cp
    for _ in range(25):
        cap = rng.choice([64, 100, 256])
        lengths = random_lengths(rng, pool, cap)
        plan = megatron_hybrid_cp_plan(lengths, dp=dp, cp=cp, max_tokens_per_gpu=cap)
        seen: dict[int, list[tuple[int, int, CPPlacement]]] = {}
        for gpu, rank in enumerate(plan.ranks):
            for m, mb in enumerate(rank.micro_batches):
                for s, place in zip(mb.segments, mb.cp, strict=True):
                    seen.setdefault(s.doc, []).append((m, gpu, place))
                    assert (s.start, s.end, s.attend_from) == (0, lengths[s.doc], 0)
        assert sorted(seen) == list(range(len(lengths)))  # nothing dropped, nothing invented
        for doc, where in seen.items():
            slots, places = {m for m, _, _ in where}, set(p for _, _, p in where)
            assert len(slots) == 1 and len(places) == 1  # one slot, one placement
            place = places.pop()
            assert sorted(g for _, g, _ in where) == list(range(place.first, place.first + place.size))
            # an aligned power-of-two group: one megatron creates
            assert place.size & (place.size - 1) == 0 and place.first % place.size == 0
            # megatron's memory cap: each GPU's share of the sample within max_tokens_per_gpu
            assert -(-lengths[doc] // place.size) <= cap
            smallest = next(p for p in (1 << k for k in range(20)) if lengths[doc] <= p * cap)
            assert place.size >= smallest  # at least its own CP size; more when megatron fills idle GPUs
        assert plan.extra["placements_outside_megatron_groups"] == 0
        for rank in plan.ranks:  # one forward at a time: every micro-batch within the cap, as megatron runs them
            for mb in rank.micro_batches:
                assert sum(-(-(s.end - s.start) // c.size) for s, c in zip(mb.segments, mb.cp)) <= cap


def test_dynamic_cp_peer_fills_idle_gpus_by_widening_cp():
    """One short sample on 8 GPUs: megatron leaves no GPU empty, doubling its CP size until it spans all 8."""
    plan = megatron_hybrid_cp_plan([np.int64(40)], dp=4, cp=2, max_tokens_per_gpu=100)
    assert layout(plan) == [[[(0, 8, 0)]]] * 8
    assert plan.extra["megatron_idle_share"] == 0


def test_dynamic_cp_peer_keeps_the_given_segments():
    segs = [Segment(7, 128, 428, 128), Segment(9, 0, 50, 0)]
    plan = megatron_hybrid_cp_plan([300, 50], dp=2, cp=2, max_tokens_per_gpu=100, step=5, segments=segs)
    assert plan.step == 5
    assert {s for r in plan.ranks for mb in r.micro_batches for s in mb.segments} == set(segs)
    with pytest.raises(ValueError, match=r"segments\[1\] holds 50 tokens, lengths\[1\] = 60"):
        megatron_hybrid_cp_plan([300, 60], dp=2, cp=2, max_tokens_per_gpu=100, segments=segs)


def test_dynamic_cp_peer_megatron_cp_groups():
    """create_hybrid_dp_cp_groups over 16 ranks: aligned groups of 2, 4 and 8; with the whole pool and single
    GPUs. Over 6: groups of 2 only (its sizes stop below the largest power of two under the pool)."""
    expected16 = {(s, f) for s in (1, 2, 4, 8) for f in range(0, 16, s)} | {(16, 0)}
    assert megatron_cp_groups(16) == expected16
    assert megatron_cp_groups(6) == {(1, r) for r in range(6)} | {(2, 0), (2, 2), (2, 4), (6, 0)}


def test_dynamic_cp_peer_pool_not_a_power_of_two():
    """DP 3 x CP 2: megatron gives the 248-token sample CP 4 on GPUs 0-3, a group it never creates over 6
    ranks; the plan keeps it as megatron placed it and counts it."""
    plan = megatron_hybrid_cp_plan([32, 22, 4, 31, 248], dp=3, cp=2, max_tokens_per_gpu=100)
    assert [c for mb in plan.ranks[0].micro_batches for c in mb.cp] == [CPPlacement(4, 0)]
    assert plan.extra["placements_outside_megatron_groups"] == 1
    # DP 5 x CP 2: widening the samples to fill idle GPUs runs past the pool inside megatron
    with pytest.raises(MegatronSchedulerError, match="dp x cp = 10 on 2 samples: IndexError"):
        megatron_hybrid_cp_plan([118, 94], dp=5, cp=2, max_tokens_per_gpu=100)


@pytest.mark.parametrize("lengths,kwargs,message", [
    ([10, 0], {}, r"lengths\[1\] = 0: expected a positive token count"),
    ([10, 401], {}, r"lengths\[1\] = 401 tokens: megatron's CP size for it .* is 8, over its dp x cp = 4"),
    ([10], {"dp": 3, "cp": 1}, r"dp x cp = 3: .* even number"),
    ([10], {"max_tokens_per_gpu": 0}, r"max_tokens_per_gpu: expected a positive integer, got 0"),
    ([10, 2.5], {}, r"lengths\[1\] = 2.5: expected an integer token count"),
    ([10], {"layout": "rows"}, r"layout: expected 'sample' or 'group', got 'rows'"),
])
def test_dynamic_cp_peer_refuses_bad_input(lengths, kwargs, message):
    args = {"dp": 2, "cp": 2, "max_tokens_per_gpu": 100} | kwargs
    with pytest.raises(ValueError, match=message):
        megatron_hybrid_cp_plan(lengths, **args)


def test_dynamic_cp_peer_benchmark_writes_its_section(tmp_path):
    """benchmarks/peer_megatron.py on one small step: every drawn token is counted at one CP size."""
    import peer_megatron

    doc = tmp_path / "page.md"
    doc.write_text("# P\n\n<!-- SECTION:megatron-hybrid-cp -->\n(pending)\n<!-- END:megatron-hybrid-cp -->\n")
    args = ["--steps", "1", "--datasets", "synthetic-github", "--tokens-per-step", "300000", "--write", str(doc)]
    assert peer_megatron.main(args) == 0
    text = doc.read_text()
    assert "(pending)" not in text and "| synthetic-github |" in text and text.count("SECTION:megatron-hybrid-cp") == 1
    setup = peer_megatron.Setup("t", 4, 1, 131072, 300000, 1)
    row = peer_megatron.run("synthetic-github", setup, cp=4, tp=8, seed=0)
    assert sum(row.cp_share.values()) == pytest.approx(1.0)
    assert row.outside == 0 and row.pad_min <= row.pad_required and 0 <= row.idle < 1
