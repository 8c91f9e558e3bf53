"""PackedDataset under torch DataLoader workers: documents split by worker, none lost or doubled; steps stay
whole and in order; StatefulDataLoader saves and restores every worker."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.dataset import PackedDataset
from tests.helpers.ledger import TokenLedger, check_batch_tokens


def _config(dp=1):
    return PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=900, parallel=ParallelConfig(dp=dp))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.multiprocess
def test_dataloader_workers_cover_every_token_once(tmp_path, workers):
    from helpers.docs import token_docs, write_token_shards

    docs = token_docs(300, seed=3)
    ds = PackedDataset(write_token_shards(tmp_path, docs, shards=3), config=_config(), epochs=2)
    dl = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="spawn" if workers else None)
    steps = list(dl)
    numbers = [mbs[0].step for mbs in steps]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    for mbs in steps:  # a step's micro-batches arrive together, in order
        assert [b.index_in_step for b in mbs] == list(range(len(mbs)))
        assert {b.step for b in mbs} == {mbs[0].step}
    ledger = TokenLedger(ds._p.stream)
    cache = {}
    for mbs in steps:
        ledger.add(mbs)
        for b in mbs:
            check_batch_tokens(b, ds._p.stream, cache)
    assert ledger.check_epoch(0) == ledger.check_epoch(1) == sum(len(d) for d in docs)


@pytest.mark.multiprocess
def test_workers_and_ranks_together(tmp_path):
    """Two DP ranks, each with a two-worker DataLoader: every token once over ranks and workers."""
    from helpers.docs import text_docs, write_text_shards

    paths = write_text_shards(tmp_path, text_docs(150, seed=1), shards=2)
    ledger = None
    per_rank_steps = []
    for r in range(2):
        ds = PackedDataset(paths, tokenizer="bytes", config=_config(dp=2), dp_rank=r)
        steps = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
        per_rank_steps.append([(mbs[0].step, len(mbs)) for mbs in steps])
        ledger = ledger or TokenLedger(ds._p.stream)
        for mbs in steps:
            ledger.add(mbs)
    assert per_rank_steps[0] == per_rank_steps[1]  # same steps, same micro-batch counts, same order
    ledger.check_epoch(0)


@pytest.mark.multiprocess
def test_stateful_dataloader_resumes_each_worker(tmp_path):
    from helpers.docs import token_docs, write_token_shards
    from torchdata.stateful_dataloader import StatefulDataLoader

    paths = write_token_shards(tmp_path, token_docs(250, seed=4), shards=3)

    def make():
        ds = PackedDataset(paths, config=_config(), epochs=1)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")

    def key(mbs):
        return [(b.step, b.input_ids.tolist()) for b in mbs]

    full = [key(m) for m in make()]
    dl = make()
    it = iter(dl)
    head = [key(next(it)) for _ in range(5)]
    state = dl.state_dict()
    del it, dl
    dl = make()
    dl.load_state_dict(state)
    rest = [key(m) for m in dl]
    assert head + rest == full


def test_a_worker_iterator_restores_while_planning_is_slow(tmp_path):
    """What StatefulDataLoader does in a restored worker: a new iterator of the dataset, then load_state_dict,
    then next. With planning slower than torchdata's 0.5 s thread join (a loaded machine), a pipeline that the
    iterator had started before the load, and that the load reset, let its old thread draw a step from the
    restored position: that step was lost."""
    import time

    from helpers.docs import token_docs, write_token_shards
    from helpers.planners import SlowPlanner

    paths = write_token_shards(tmp_path, token_docs(70, seed=3), shards=2)
    cfg = _config()
    planner = SlowPlanner(cfg)
    ds = PackedDataset(paths, config=cfg, planner=planner, epochs=1)

    def key(mbs):
        return [(b.step, b.input_ids.tolist()) for b in mbs]

    ref = [key(s) for s in iter(ds)]
    assert len(ref) >= 5
    planner.pause, planner.slow = 1.5, range(1)  # planning the first step from scratch is slow
    it = iter(ds)
    head = [key(next(it)) for _ in range(2)]
    state = it.state_dict()
    it.close()
    restored = iter(ds)
    time.sleep(0.3)  # a started pipeline would be planning its first step by now
    restored.load_state_dict(state)
    assert head + [key(s) for s in restored] == ref
    restored.close()
    started = iter(ds)  # loading into an iterator that is running
    next(started)
    started.load_state_dict(state)
    assert [key(s) for s in started] == ref[2:]
    started.close()
