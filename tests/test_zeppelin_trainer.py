"""Zeppelin in a trainer path: a real transformers Llama (float64, CPU) trained with hierarchical CP and layout
remapping over 2 and 3 gloo ranks (packloader.runtime.zeppelin, attention through packloader's transformers
attention) gives the loss and every parameter gradient of the same documents run whole in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess  # every test here starts processes

VOCAB = 53
LENGTHS = [200, 3, 17, 1, 60, 9, 22]


def _docs(lengths=LENGTHS):
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in lengths]


def _model(attn):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   use_cache=False)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float64).train()


def _batch(lengths):
    from packloader.collate.collate import collate
    from packloader.contracts import Segment

    docs = _docs(lengths)
    return collate([Segment(i, 0, n, 0) for i, n in enumerate(lengths)], dict(enumerate(docs)))


def _rank(rank, world, lengths):
    from packloader.runtime.zeppelin import ZeppelinContext, reduce_gradients
    from packloader_integrations.hf import register_packloader_attention

    model = _model(register_packloader_attention())
    b = _batch(lengths)
    # documents of 100 tokens or more are sharded over all ranks, shorter ones stay whole on one rank
    ctx = ZeppelinContext(b.segments, mode="hierarchical", hierarchical_threshold=100)
    ids, pos, lab = ctx.local(b.input_ids), ctx.local(b.position_ids), ctx.local(b.labels)
    with ctx.active():
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    loss = torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum")
    loss.backward()
    reduce_gradients(model.parameters())
    loss_total = loss.detach().clone()
    torch.distributed.all_reduce(loss_total)
    return (float(loss_total), len(ids), ctx.layout.shards.sharded_segments.tolist(), len(ctx.shard.token_index),
            {k: p.grad.numpy() for k, p in model.named_parameters()})


@pytest.mark.parametrize("world,lengths", [(2, LENGTHS), (3, LENGTHS), (2, [9])])
def test_zeppelin_cp_equals_whole_documents_in_one_process(world, lengths):
    ref = _model("sdpa")  # float64 throughout (eager attention takes its softmax in float32)
    loss = 0.0
    for d in _docs(lengths):
        x = torch.from_numpy(d).long()[None]
        lg = ref(input_ids=x).logits[0]
        loss = loss + torch.nn.functional.cross_entropy(lg[:-1], x[0, 1:], reduction="sum")
    loss.backward()
    results = run_ranks(_rank, world, lengths)
    assert sum(r[1] for r in results) == sum(lengths)  # the linear layout splits the tokens
    assert sum(r[3] for r in results) == sum(lengths)  # and so does the attention layout
    if lengths == LENGTHS:  # the long document runs as CP attention, the short ones whole on one rank each
        assert results[0][2] == [0]
    else:  # one short document whole on one rank: the other rank's attention shard is empty, its collectives run
        assert results[0][2] == [] and min(r[3] for r in results) == 0
    for got_loss, _, _, _, grads in results:
        assert got_loss == pytest.approx(float(loss), rel=1e-10)
        for k, p in ref.named_parameters():
            torch.testing.assert_close(torch.from_numpy(grads[k]), p.grad, rtol=1e-9, atol=1e-12, msg=k)
