"""`PackedBatch.step_metrics`: one StepMetrics record per step, the same on every micro-batch and rank, its counts
checked against the collated tensors and its times against the cost model's micro-batch times summed by hand
(PP 1: a rank's step is its micro-batches one after the other)."""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import pytest

from packloader import PackedLoader, PlanConfig, StepMetrics
from packloader.balancers.cost.resolve import load_cost_model
from packloader.contracts import ParallelConfig
from packloader.sources.base import IterableSource

VOCAB = 101


def corpus(n=120, seed=3):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.pareto(1.0, size=n) * 30 + 2, 256).astype(int)
    return [rng.integers(0, VOCAB, size=int(k)).astype(np.int32) for k in lengths]


def config(strategy="wlb", dp=2):
    return PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp), max_tokens=256, context=256,
                      tokens_per_step=1024, allow_slicing=False, model="tiny")


def batches_by_step(cfg, docs, **kw):
    """step -> every rank's batches of that step."""
    steps = defaultdict(list)
    for r in range(cfg.parallel.dp):
        for b in PackedLoader(IterableSource(docs), config=cfg, dp_rank=r, num_threads=0, append_eos=False, **kw):
            steps[b.step].append(b)
    return dict(sorted(steps.items()))


@pytest.fixture(scope="module")
def docs():
    return corpus()


@pytest.mark.parametrize("strategy,long_docs", [("wlb", False), ("fixed", False), ("wlb", True)])
def test_counts_match_the_collated_tensors(docs, strategy, long_docs):
    cfg = config(strategy)
    if long_docs:  # documents of 12 pieces: steps end inside them, their rest goes to the next steps in order
        rng = np.random.default_rng(5)
        docs = docs[:40] + [rng.integers(0, VOCAB, size=3000).astype(np.int32) for _ in range(3)]
    steps = batches_by_step(cfg, docs, pad_to_multiple=8)
    assert len(steps) > 3
    trained = 0
    for s, batches in steps.items():
        m = batches[0].step_metrics
        assert isinstance(m, StepMetrics) and m.step == s
        assert all(b.step_metrics == m for b in batches)  # one record for the whole step, every rank
        assert m.tokens == sum(int(b.cu_seqlens[-1]) for b in batches)
        assert m.loss_tokens == sum(int((b.labels != -100).sum()) for b in batches)
        assert m.padding_tokens == sum(b.num_tokens - int(b.cu_seqlens[-1]) for b in batches)
        # queued after the step: tokens drawn so far (the loader's stats) minus tokens trained so far
        trained += m.tokens
        assert m.queued_tokens == batches[0].stats.tokens - trained, s
        assert m.micro_batches == max(b.micro_batches_in_step for b in batches)
        assert m.cost_model and m.planner
    assert trained == sum(len(d) for d in docs)


def test_delay_from_the_draw_order(docs):
    # in file order (shuffle=False) document d is drawn at the first step whose cumulative draw count passes d;
    # each trained token's delay is its step minus that, read from the batches' own doc_ids and cu_seqlens
    steps = batches_by_step(config("wlb"), docs, shuffle=False)
    drawn_upto = [batches[0].stats.documents for batches in steps.values()]
    ms = [batches[0].step_metrics for batches in steps.values()]
    assert any(m.queued_tokens for m in ms), "the corpus should make wlb hold outliers back"
    for s, batches in steps.items():
        delays = []  # (delay, tokens) per segment
        for b in batches:
            lens = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()
            for d, n in zip(b.doc_ids.tolist(), lens):
                drawn = next(k for k, upto in enumerate(drawn_upto) if d < upto)
                delays.append((s - drawn, n))
        tokens = sum(n for _, n in delays)
        m = ms[s]
        assert m.delayed_tokens == sum(n for d, n in delays if d > 0), s
        assert m.delay_max == max((d for d, n in delays if n), default=0), s
        assert m.delay_mean == pytest.approx(sum(d * n for d, n in delays) / tokens if tokens else 0.0, abs=1e-12)


@pytest.mark.parametrize("strategy", ["fixed", "wlb"])  # fixed leaves micro-batch costs out, wlb prices them
def test_times_and_balance_by_hand(docs, strategy):
    cfg = config(strategy, dp=2)
    model = load_cost_model("tiny", cfg.parallel)
    for batches in batches_by_step(cfg, docs).values():
        m = batches[0].step_metrics
        plan = batches[0].plan
        rank_times, imbalances = [], []
        for rank in plan.ranks:
            costs = [sum(model.microbatch_times(mb)) for mb in rank.micro_batches]
            rank_times.append(sum(costs))
            imbalances.append(max(costs) * len(costs) / sum(costs) if costs and sum(costs) > 0 else 1.0)
        assert m.step_time == pytest.approx(max(rank_times), rel=1e-9)
        assert m.dp_spread == pytest.approx(max(rank_times) / np.mean(rank_times), rel=1e-9)
        assert m.bubble_share == pytest.approx(1 - sum(rank_times) / (len(rank_times) * max(rank_times)), abs=1e-9)
        assert m.imbalance == pytest.approx(max(imbalances), rel=1e-9)


def test_megatron_iterator_logs_each_step_once(docs, caplog):
    pytest.importorskip("megatron.core")
    from packloader_integrations import megatron as pm

    cfg = config("fixed", dp=1)
    loader = PackedLoader(IterableSource(docs), config=cfg, num_threads=0, append_eos=False)
    with caplog.at_level(logging.INFO, logger="packloader"):
        out = list(pm.MegatronDataIterator(loader))
    steps = sorted({d["step_metrics"].step for d in out})
    lines = [r.getMessage() for r in caplog.records if r.name == "packloader.megatron"]
    assert len(lines) == len(steps)
    for s, line in zip(steps, lines):
        assert line.startswith(f"step {s} ") and "predicted" in line and "tokens" in line


def _log_from_two_ranks(rank, world, docs):
    """Each gloo rank's MegatronDataIterator log lines (the default: global rank 0 logs, the others do not)."""
    from packloader_integrations import megatron as pm

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("packloader.megatron")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    loader = PackedLoader(IterableSource(docs), config=config("fixed", dp=world), dp_rank=rank, num_threads=0,
                          append_eos=False)
    steps = {d["step_metrics"].step for d in pm.MegatronDataIterator(loader)}
    return len(steps), [r.getMessage() for r in records]


@pytest.mark.multiprocess
def test_megatron_iterator_logs_each_step_once_over_two_ranks(docs):
    pytest.importorskip("megatron.core")
    from helpers.distributed import run_ranks

    (steps0, lines0), (steps1, lines1) = run_ranks(_log_from_two_ranks, 2, docs)
    assert steps0 == steps1 > 1
    assert len(lines0) == steps0 and lines1 == []


def test_package_logger_is_quiet_by_default():
    logger = logging.getLogger("packloader")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)


# --- delay of the rest of a long document that a step ended inside (issue 21) ---------------------------------------

def spanning_config(strategy="fixed", dp=1):
    return PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=dp), max_tokens=256, context=256,
                      tokens_per_step=1000, allow_slicing=False, model="tiny")


def spanning_docs(lengths=(100, 2600, 300), seed=9):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in lengths]


def test_a_document_over_three_steps_by_hand():
    # worked by hand from the README's rule (a step draws pieces of 256 until it holds 1000 tokens, the piece that
    # crosses the mark included): step 0 = A (100) + B[0:1024) (1124); step 1 = B[1024:2048) (1024, drawn at step
    # 0: delay 1); step 2 = B[2048:2600) (552, delay 2) + C (300, delay 0), the epoch's end
    steps = batches_by_step(spanning_config(), spanning_docs(), shuffle=False)
    ms = [batches[0].step_metrics for batches in steps.values()]
    assert [m.tokens for m in ms] == [1124, 1024, 852]
    assert [m.delayed_tokens for m in ms] == [0, 1024, 552]
    assert [m.delay_max for m in ms] == [0, 1, 2]
    assert [m.delay_mean for m in ms] == pytest.approx([0.0, 1.0, 552 * 2 / 852], abs=1e-12)


def plan_delays(lengths, cfg, planner):
    """The per-step delay `packloader plan` reports for these lengths (balancers.offline + sim.metrics)."""
    from packloader.balancers.offline import plan_run
    from packloader.balancers.sim.metrics import drawn_steps, score_plans

    result = plan_run(np.asarray(lengths, np.int64), cfg, None, planner)
    scores, _ = score_plans(result.plans, load_cost_model("tiny", cfg.parallel), cfg.parallel,
                            max_tokens=cfg.max_tokens, drawn=drawn_steps(result.windows))
    return [(s.step, s.tokens, s.tokens_delayed, s.delay_max, s.delay_mean) for s in scores]


@pytest.mark.parametrize("delaying", [False, True])  # True: the planner also holds long (continued) pieces back
def test_delay_equals_the_plan_reports(delaying):
    from helpers.planners import DelayingPlanner

    from packloader.balancers.factory import make_planner

    cfg = spanning_config(dp=2)
    lengths = [100, 2600, 300, 40, 3100, 90, 700, 5, 1500, 60]
    docs = spanning_docs(lengths)
    planner = (lambda: DelayingPlanner(cfg, threshold=200)) if delaying else (lambda: make_planner(cfg))
    want = plan_delays(lengths, cfg, planner())
    got = []
    for s, batches in batches_by_step(cfg, docs, shuffle=False, planner=planner()).items():
        m = batches[0].step_metrics
        got.append((s, m.tokens, m.delayed_tokens, m.delay_max, pytest.approx(m.delay_mean, abs=1e-12)))
    assert got == want
    assert max(w[3] for w in want) >= 2 + delaying  # continued pieces (and, held back, later still) count


def test_the_record_resumes_exactly_inside_the_long_document():
    cfg = spanning_config()
    docs = spanning_docs((100, 2600, 300, 700, 50))

    def loader(**kw):
        return PackedLoader(IterableSource(docs), config=cfg, num_threads=0, append_eos=False, shuffle=False, **kw)

    ref = [(b.step, b.index_in_step, b.step_metrics) for b in loader()]
    assert any(m.delay_max == 2 for *_, m in ref)
    for cut in range(1, len(ref) - 1):  # every save point: step boundaries and inside steps, inside B included
        first = loader()
        it = iter(first)
        got = [(b.step, b.index_in_step, b.step_metrics) for b in (next(it) for _ in range(cut))]
        state = first.state_dict()
        first.close()
        again = loader()
        again.load_state_dict(state)
        got += [(b.step, b.index_in_step, b.step_metrics) for b in again]
        again.close()
        assert got == ref, cut


def test_a_state_saved_before_first_drawn_was_kept_still_loads():
    # the same format: a state without the field resumes the same batches; the continued document's pieces then
    # count from the step after the save (its first draw is unknown), one step less than the uninterrupted record
    cfg = spanning_config()
    docs = spanning_docs()
    first = PackedLoader(IterableSource(docs), config=cfg, num_threads=0, append_eos=False, shuffle=False)
    ref = [(b.step, b.input_ids.tolist(), b.step_metrics.delay_max) for b in first]
    first = PackedLoader(IterableSource(docs), config=cfg, num_threads=0, append_eos=False, shuffle=False)
    it = iter(first)
    got = [(b.step, b.input_ids.tolist(), b.step_metrics.delay_max) for b in (next(it) for _ in range(5))]
    state = first.state_dict()
    assert got[-1][0] == 0 and state["loader"]["step_state"]["first_drawn"]  # saved after step 0, inside B
    del state["loader"]["step_state"]["first_drawn"]
    again = PackedLoader(IterableSource(docs), config=cfg, num_threads=0, append_eos=False, shuffle=False)
    again.load_state_dict(state)
    got += [(b.step, b.input_ids.tolist(), b.step_metrics.delay_max) for b in again]
    assert [g[:2] for g in got] == [r[:2] for r in ref]
    assert [g[2] for g in got if g[0] > 0] == [r[2] - 1 for r in ref if r[0] > 0]
