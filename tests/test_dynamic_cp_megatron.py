"""Per-document CP for Megatron-core, checked against megatron-core 0.16's own hybrid context parallelism on CPU:
the sub-samples' `PackedSeqParams` carry `local_cp_size` and `cp_group` as its code reads them (TransformerEngine's
attention: a group, or CP off at size 1; `get_batch_on_this_hybrid_cp_rank`: the group's size is `local_cp_size`;
the group is the very block `parallel_state.create_hybrid_dp_cp_groups` forms, the whole DP x CP group at full size;
the rotary table sized from the params covers every position), and `PackloaderCoreAttention` run on them over gloo
gives the dense single-process attention of the whole documents."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.dense_attention import dense_causal_reference
from helpers.distributed import run_ranks

pytest.importorskip("megatron.core")

from packloader.contracts import CPPlacement as P  # noqa: E402
from packloader.contracts import MicroBatch, Segment  # noqa: E402

D, HQ, HKV = 4, 4, 2
LENGTHS = {1: 37, 2: 10, 3: 5, 4: 9, 5: 3, 6: 2}
PLACED = {1: P(4, 0), 2: P(2, 0), 3: P(1, 2), 4: P(2, 2), 5: P(1, 3), 6: P(4, 0)}


def _tensors(doc: int):
    g = torch.Generator().manual_seed(2000 + doc)
    return tuple(torch.randn(LENGTHS[doc], h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))


def _check_sub(sub: dict, gpu: int, megatron_groups: dict) -> tuple[int, int]:
    """The sub-sample's params against what megatron-core reads; returns (size, first) of its group."""
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    p = sub["packed_seq_params"]
    assert type(p) is PackedSeqParams and p.qkv_format == "thd"
    size, group = p.local_cp_size, p.cp_group
    assert isinstance(size, int) and size == sub["cp_shard"].cp_size
    if size == 1:
        assert group is None  # TransformerEngine: "local_cp_size must be == 1 if provided without cp_group"
        first = gpu
    else:
        assert dist.get_world_size(group) == size  # get_batch_on_this_hybrid_cp_rank: cp_group.size() == local_cp_size
        ranks = dist.get_process_group_ranks(group)
        want = list(range(dist.get_world_size())) if size == dist.get_world_size() \
            else dist.get_process_group_ranks(megatron_groups[size])
        assert ranks == want
        first = ranks[0]
        assert dist.get_rank(group) == gpu - first == sub["cp_shard"].rank
    rope = RotaryEmbedding(kv_channels=D, rotary_percent=1.0, use_cpu_initialization=True)
    seq = rope.get_rotary_seq_len(None, None, None, None, p)  # GPTModel's call with packed_seq_params
    # the rotary table GPTModel builds from it (its forward moves it to CUDA first: read on CPU here) has a row for
    # every position of the group's documents
    assert rope.get_freqs_non_repeated(seq).shape[0] == seq > int(sub["position_ids"].max())
    return size, first


def _rank(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as ps

    from packloader.collate.collate import collate
    from packloader.collate.cp_document_shards import localize
    from packloader.runtime.groups import ProcessGroupCache, prepare_cp_pool_groups
    from packloader_integrations.megatron import PackloaderCoreAttention, megatron_dynamic_cp_batches

    megatron_groups = ps.create_hybrid_dp_cp_groups(rank, list(range(world)), None)
    cache = prepare_cp_pool_groups(world, groups=ProcessGroupCache())
    docs = [d for d, p in PLACED.items() if p.first <= rank < p.first + p.size]
    mb = MicroBatch(segments=[Segment(d, 0, LENGTHS[d], 0) for d in docs], cp=[PLACED[d] for d in docs])
    tokens = {d: np.arange(LENGTHS[d], dtype=np.int32) + 100 * d for d in docs}
    batch = localize(collate(mb.segments, tokens), mb, gpu=rank, pool=world)
    core = PackloaderCoreAttention(SimpleNamespace(kv_channels=D, hidden_size=HQ * D, num_attention_heads=HQ), 1)
    ref = {d: dense_causal_reference(*_tensors(d), D ** -0.5) for d in docs}
    err, seen = 0.0, []
    for sub, g in zip(megatron_dynamic_cp_batches(batch, groups=cache), batch.cp.groups):
        seen.append(_check_sub(sub, rank, megatron_groups))
        doc = [int(t) // 100 for t in sub["tokens"][0].tolist()]  # the tokens name their document
        pos = sub["position_ids"][0].tolist()
        q, k, v, w = (torch.stack([_tensors(d)[j][p] for d, p in zip(doc, pos)]) for j in range(4))
        q, k, v = (t.unsqueeze(1).clone().requires_grad_(True) for t in (q, k, v))  # Megatron's [t, 1, h, d]
        out = core(q, k, v, None, packed_seq_params=sub["packed_seq_params"])
        (out.reshape(-1, HQ, D) * w).sum().backward()
        for j, got in enumerate((out.detach().reshape(-1, HQ, D), q.grad[:, 0], k.grad[:, 0], v.grad[:, 0])):
            want = torch.stack([ref[d][j][p] for d, p in zip(doc, pos)])
            err = max(err, float((got - want).abs().max()))
    return {"groups": seen, "err": err, "loss": batch.num_loss_tokens}


@pytest.mark.multiprocess
def test_dynamic_cp_megatron_params_are_megatron_hybrid_cp_and_run_over_gloo():
    res = run_ranks(_rank, 4, timeout=180)
    assert [r["groups"] for r in res] == [[(4, 0), (2, 0)], [(4, 0), (2, 0)], [(4, 0), (2, 2), (1, 2)],
                                          [(4, 0), (2, 2), (1, 3)]]
    assert max(r["err"] for r in res) < 1e-10
    assert sum(r["loss"] for r in res) == sum(n - 1 for n in LENGTHS.values())


def test_dynamic_cp_megatron_reads_local_cp_size_and_cp_group():
    """The fields are megatron-core's, and its attention and model still read them by these names."""
    from megatron.core.packed_seq_params import PackedSeqParams

    assert {"local_cp_size", "cp_group"} <= {f.name for f in dataclasses.fields(PackedSeqParams)}
    root = Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0])
    te = (root / "extensions" / "transformer_engine.py").read_text()
    assert "packed_seq_params.cp_group is not None" in te and "packed_seq_params.local_cp_size == 1" in te
    assert "cp_group=packed_seq_params.cp_group" in (root / "models" / "gpt" / "gpt_model.py").read_text()


def test_dynamic_cp_megatron_empty_slot_and_fixed_batches():
    from packloader.collate.collate import collate
    from packloader.collate.cp_document_shards import localize
    from packloader_integrations.megatron import megatron_dynamic_cp_batches

    empty = MicroBatch(segments=[], cp=[])
    subs = megatron_dynamic_cp_batches(localize(collate([], {}), empty, gpu=0))
    p = subs[0]["packed_seq_params"]
    assert len(subs) == 1 and (p.local_cp_size, p.cp_group) == (1, None) and subs[0]["loss_mask"].sum() == 0
    with pytest.raises(ValueError, match="not a per-document CP batch"):
        megatron_dynamic_cp_batches(collate([Segment(1, 0, 4, 0)], {1: np.arange(4)}))


def test_dynamic_cp_megatron_refuses_a_chain_slice_naming_it():
    # megatron-core's hybrid path runs each sub-sample alone: a chain's later slice (tokens 6..11 of document 1,
    # its first 6 run in the micro-batch before) is refused, naming it and the executor that runs it
    from packloader.collate.collate import collate
    from packloader.collate.cp_document_shards import localize
    from packloader.runtime.slice_check import SlicesNotSupported
    from packloader_integrations.megatron import megatron_dynamic_cp_batches

    mb = MicroBatch(segments=[Segment(2, 0, 3, 0), Segment(1, 6, 12, 0)], cp=[P(1, 0), P(2, 0)])
    batch = localize(collate(mb.segments, {1: np.arange(12), 2: np.arange(3)}, step=4, index_in_step=1), mb, gpu=0)
    with pytest.raises(SlicesNotSupported, match=r"step 4, rank 0, micro-batch 1: document 1 is sliced \(tokens "
                                                 r"6\.\.11.*chains.*DynamicCPExecutor"):
        megatron_dynamic_cp_batches(batch)
