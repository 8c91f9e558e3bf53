"""Elastic resume of `PackedDataset` across DataLoader worker counts (issue 21, item 3): a StatefulDataLoader
state saved at W workers resumes at W' workers (and at another dp) through `dataloader_state_for`, and every
token of the epoch is trained exactly once over all the phases. Checked against the documents themselves: each
token's coverage count, and each micro-batch's input_ids against the document it names."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.docs import tail_with_giant
from torchdata.stateful_dataloader import StatefulDataLoader

from packloader import PackedDataset, ParallelConfig, PlanConfig, dataloader_state_for
from packloader.loader.dataset import _StepIterator
from packloader.sources.base import IterableSource


def corpus(seed: int = 0) -> list[np.ndarray]:
    return tail_with_giant(120, 50, 2000, 7, 4000, seed=seed)


def config(dp: int = 1, strategy: str = "wlb") -> PlanConfig:
    """`wlb` queues outliers (delay: queued pieces in the saved states)."""
    return PlanConfig(strategy=strategy, max_tokens=256, context=256, tokens_per_step=512 * dp,
                      parallel=ParallelConfig(dp=dp))


def loader(docs, cfg, workers, rank=0, state=None) -> StatefulDataLoader:
    ds = PackedDataset(IterableSource(docs), config=cfg, tokenizer="bytes", dp_rank=rank, shuffle=False,
                       num_threads=0)
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=workers,
                            multiprocessing_context="spawn" if workers else None)
    if state is not None:
        dl.load_state_dict(state)
    return dl


def take(dl, count, docs, seen) -> dict:
    """`count` steps (None: all) from `dl`, each micro-batch checked against the documents; its state after."""
    it = iter(dl)
    n = 0
    while count is None or n < count:
        try:
            mbs = next(it)
        except StopIteration:
            break
        n += 1
        for b in mbs:
            ids, cu = b.input_ids.numpy(), b.cu_seqlens.numpy()
            for i, s in enumerate(b.segments):
                assert np.array_equal(ids[cu[i]:cu[i + 1]], docs[s.doc][s.start:s.end])
                seen.append((s.doc, s.start, s.end))
    if count is not None:
        assert n == count, f"the epoch ended after {n} steps, before the save the test asks for"
    state = dl.state_dict()
    del it
    return state


def lost_and_repeated(docs, segments) -> tuple[int, int]:
    cover = [np.zeros(len(d), np.int64) for d in docs]
    for d, a, b in segments:
        cover[d][a:b] += 1
    return sum(int((c == 0).sum()) for c in cover), sum(int(np.maximum(c - 1, 0).sum()) for c in cover)


@pytest.mark.parametrize("phases", [((0, 3), (2, 4), (3, 5), (1, None)), ((2, 4), (3, 3), (1, 3), (0, None))])
@pytest.mark.multiprocess
def test_worker_count_changes_train_every_token_once(phases):
    """(workers, steps taken before the save): the second run's two saved parts go to two of three workers,
    then both to one worker, then to the main process."""
    docs = corpus()
    seen: list = []
    (workers, count), *rest = phases
    state = take(loader(docs, config(), workers), count, docs, seen)
    for workers, count in rest:
        state = take(loader(docs, config(), workers, state=dataloader_state_for(state, workers)), count, docs, seen)
    assert lost_and_repeated(docs, seen) == (0, 0)
    assert sum(b - a for _, a, b in seen) == sum(len(d) for d in docs)


@pytest.mark.multiprocess
def test_dp_2_with_2_workers_to_dp_1_with_3_then_0_workers():
    """Two DP ranks (each its own DataLoader of 2 workers) save after the same steps; one rank at dp 1 goes on
    with 3 workers, then in the main process: with what both old ranks trained, every token once."""
    docs = corpus(1)
    seen: list = []
    states = [take(loader(docs, config(2), 2, rank=r), 4, docs, seen) for r in range(2)]
    state = take(loader(docs, config(1, "auto"), 3, state=dataloader_state_for(states, 3)), 3, docs, seen)
    take(loader(docs, config(1), 0, state=dataloader_state_for(state, 0)), None, docs, seen)
    assert lost_and_repeated(docs, seen) == (0, 0)


@pytest.mark.multiprocess  # (its loaders have no workers, but `loader` can start them)
def test_what_cannot_be_honoured_is_refused_naming_it():
    docs = corpus(2)
    seen: list = []
    one = take(loader(docs, config(2), 0, rank=0), 2, docs, seen)
    other = take(loader(docs, config(2), 0, rank=1), 3, docs, seen)
    with pytest.raises(ValueError, match="DP rank 1's worker part 0 of 1 stands elsewhere"):
        dataloader_state_for([one, other], 2)
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        dataloader_state_for({"_snapshot": {}, "_steps_since_snapshot": 2}, 2)
    with pytest.raises(ValueError, match="not a StatefulDataLoader state_dict"):
        dataloader_state_for({"step": 3}, 2)
    narrow = PlanConfig(strategy="wlb", max_tokens=128, context=128, tokens_per_step=1024,
                        parallel=ParallelConfig(dp=2))
    dl = loader(docs, narrow, 0, state=dataloader_state_for(one, 0))
    with pytest.raises(ValueError, match="config.context: saved 256, now 128"):
        next(iter(dl))
    plain = dataloader_state_for(one, 0)["fetcher_state"]["dataset_iter_state"]["parts"][0]
    ds = PackedDataset(IterableSource(docs), config=config(2), tokenizer="bytes", dp_rank=0, shuffle=False)
    with pytest.raises(ValueError, match=r"worker 0 of 1, loaded into worker 1 of 2.*dataloader_state_for"):
        _StepIterator(ds, 1, 2).load_state_dict(plain)
