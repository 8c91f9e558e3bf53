"""The Megatron adapter's CP sharding mode is `cp_shard_mode` (PlanConfig.cp_mode is another choice: fixed or
per-document CP); the old `cp_mode=` keyword still shards the same way for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from packloader.collate.cp_sequence_shards import plan_cp_shards  # noqa: E402
from packloader.contracts import PlanConfig  # noqa: E402
from packloader.loader.loader import PackedLoader  # noqa: E402
from packloader.runtime.cp_cost import cp_cost  # noqa: E402
from packloader.sources.base import IterableSource  # noqa: E402
from packloader_integrations import megatron as pm  # noqa: E402


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(3)
    ds = [rng.integers(0, 97, size=int(k)).astype(np.int32) for k in (150, 40, 9, 61, 120, 33, 7, 90)]
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=768, allow_slicing=False)
    return max(PackedLoader(IterableSource(ds), config=cfg, num_threads=0, append_eos=False),
               key=lambda b: len(b.segments))


@pytest.mark.parametrize("mode", ["sequence", "document"])
def test_cp_shard_mode_picks_the_sharding(batch, mode):
    lengths = [s.end - s.start for s in batch.segments]
    for r in range(2):
        ref = plan_cp_shards(lengths, 2, mode, cost=cp_cost(None))[r].token_index
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            d = pm.megatron_batch(batch, cp_size=2, cp_rank=r, cp_shard_mode=mode)
        assert np.array_equal(d["cp_shard"].token_index, ref)


def test_the_old_cp_mode_keyword_warns_and_shards_the_same(batch):
    new = pm.megatron_batch(batch, cp_size=2, cp_rank=1, cp_shard_mode="sequence")
    with pytest.warns(DeprecationWarning, match="cp_shard_mode"):
        old = pm.megatron_batch(batch, cp_size=2, cp_rank=1, cp_mode="sequence")
    assert np.array_equal(old["cp_shard"].token_index, new["cp_shard"].token_index)
    with pytest.warns(DeprecationWarning, match="MegatronDataIterator"):
        it = pm.MegatronDataIterator([batch], cp_size=2, cp_rank=1, cp_mode="sequence", log_metrics=False)
    assert np.array_equal(next(it)["cp_shard"].token_index, new["cp_shard"].token_index)
