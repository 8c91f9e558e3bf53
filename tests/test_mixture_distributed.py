"""A mixture across gloo ranks, spawned DataLoader workers and an elastic change of layout: every token of every
document the mixture epoch drew trained exactly once (the ledger, over the union of ranks or workers), every
rank planning the same steps, and each micro-batch's tokens equal to the entry's own documents."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from helpers.distributed import run_ranks
from helpers.docs import token_docs, write_token_shards
from helpers.ledger import TokenLedger, check_batch_tokens
from helpers.spawned_epoch import spawned_epoch

from packloader import Mixture, MixtureEntry, PackedDataset, PackedLoader, ParallelConfig, PlanConfig, merge_states

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def mixture(tmp_path) -> Mixture:
    entries = []
    for e, (n, w) in enumerate([(120, 0.5), (80, 0.3), (60, 0.2)]):
        d = tmp_path / f"entry{e}"
        d.mkdir()
        entries.append(MixtureEntry(name=f"e{e}", source=write_token_shards(d, token_docs(n, seed=e), shards=2),
                                    weight=w))
    return Mixture(entries=entries)


def config(dp: int) -> PlanConfig:
    return PlanConfig(strategy="wlb", max_tokens=256, context=256, tokens_per_step=600 * dp,
                      parallel=ParallelConfig(dp=dp))


def _rank(rank, world, mix):
    loader = PackedLoader(mix, tokenizer=None, config=config(world), num_threads=2, timeout=60)
    assert loader.dp_rank == rank
    out = [(b.step, msgspec.json.encode(b.plan), [(s.doc, s.start, s.end) for s in b.segments]) for b in loader]
    loader.close()
    return out


def test_gloo_ranks_plan_alike_and_train_every_token_once(tmp_path):
    mix = mixture(tmp_path)
    results = run_ranks(_rank, 2, mix)
    plans = [{step: plan for step, plan, _ in r} for r in results]
    assert plans[0] == plans[1]
    reference = PackedLoader(mix, tokenizer=None, config=config(2), dp_rank=0, num_threads=0)
    ledger = TokenLedger(reference.stream)
    for r in results:
        for _, _, segs in r:
            for d, a, b in segs:
                ledger.segments[d].append((a, b))
    assert ledger.check_epoch(0) > 0
    reference.close()


def test_spawned_workers_train_every_token_once(tmp_path):
    ds = PackedDataset(mixture(tmp_path), tokenizer=None, config=config(1), epochs=1)
    tokens, pieces = spawned_epoch(ds, num_workers=2)
    assert tokens == sum(len(p) for p in pieces)


@pytest.mark.parametrize("before,after,stop", [(2, 1, 5), (1, 3, 4)])
def test_elastic_change_of_dp_trains_every_token_once(tmp_path, before, after, stop):
    mix = mixture(tmp_path)
    loaders = [PackedLoader(mix, tokenizer=None, config=config(before), dp_rank=r, num_threads=0)
               for r in range(before)]
    ledger = TokenLedger(loaders[0].stream)
    states = []
    for ld in loaders:  # each rank trains `stop` whole steps
        for b in ld:
            check_batch_tokens(b, ld.stream)
            ledger.add([b])
            if b.step == stop - 1 and b.index_in_step == b.micro_batches_in_step - 1:
                break
        states.append(ld.state_dict())
        ld.close()
    state = merge_states(states) if before > 1 else states[0]
    for r in range(after):
        ld = PackedLoader(mix, tokenizer=None, config=config(after), dp_rank=r, num_threads=0)
        ld.load_state_dict(state)
        for b in ld:
            assert len(b.plan.ranks) == after
            check_batch_tokens(b, ld.stream)
            ledger.add([b])
        ld.close()
    ledger.check_epoch(0)
    np.testing.assert_equal(ledger.stream.num_docs, 260)
