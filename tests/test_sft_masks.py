"""Loss masks from the source to the batch: labels -100 where the target does not train, loss-token counts of
trained targets only, pieces and slices keeping their part of the mask, every trained target exactly once per
epoch, on one rank and over gloo ranks. The reference is a brute-force loop over each document's tokens and mask,
written here from the contract (token t's target is token t + 1 of the same document when the mask lets it train).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers.distributed import run_ranks

from packloader import PackedLoader
from packloader.collate.collate import collate_step, loss_tokens_in_plan
from packloader.contracts import MicroBatch, ParallelConfig, PlanConfig, RankPlan, Segment, StepPlan
from packloader.sources.loss_mask import MaskedTokens
from packloader.sources.sft import SftSource


def _masked_docs(n: int, seed: int, lo: int = 2, hi: int = 90) -> list[MaskedTokens]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        k = int(rng.integers(lo, hi))
        mask = rng.random(k) < 0.4
        mask[int(rng.integers(1, k))] = True  # at least one target trains
        docs.append(MaskedTokens(rng.integers(0, 400, k), mask))
    return docs


def _expected_labels(doc, start: int, end: int) -> list[int]:
    out = []
    for t in range(start, end):
        nxt = t + 1
        out.append(int(doc[nxt]) if nxt < len(doc) and doc.loss_mask[nxt] else -100)
    return out


@pytest.mark.parametrize("pad", [None, 8])
def test_collate_masks_labels_and_counts_like_brute_force(pad):
    docs = _masked_docs(12, seed=3)
    tokens = dict(enumerate(docs))
    rng = np.random.default_rng(7)
    mbs = []
    for _ in range(5):  # whole documents, pieces (attend_from == start > 0) and slices (attend_from < start)
        segs = []
        for d in rng.choice(len(docs), 3, replace=False).tolist():
            n = len(docs[d])
            a = int(rng.integers(0, n - 1))
            b = int(rng.integers(a + 1, n + 1))
            attend = a if rng.random() < 0.5 else int(rng.integers(0, a + 1))
            segs.append(Segment(d, a, b, attend))
        mbs.append(segs)
    step = collate_step(mbs, tokens, pad_to_multiple=pad)
    for segs, batch in zip(mbs, step):
        want, count = [], 0
        offsets = (batch.cu_seqlens_padded if pad else batch.cu_seqlens).tolist()
        labels = batch.labels.tolist()
        for i, s in enumerate(segs):
            exp = _expected_labels(docs[s.doc], s.start, s.end)
            got = labels[offsets[i] : offsets[i] + s.end - s.start]
            assert got == exp, (s, got, exp)
            want.append(exp)
            count += sum(x != -100 for x in exp)
        assert batch.num_loss_tokens == count
        # padding never trains
        assert sum(x != -100 for x in labels) == count
    plan = StepPlan(step=0, ranks=[RankPlan(micro_batches=[MicroBatch(segments=s) for s in mbs])])
    total = sum(sum(x != -100 for x in _expected_labels(docs[s.doc], s.start, s.end)) for segs in mbs for s in segs)
    assert loss_tokens_in_plan(plan, {d: len(t) for d, t in tokens.items()}, tokens) == total


def test_plain_documents_are_unchanged_beside_masked_ones():
    plain = np.arange(10, 30, dtype=np.int32)
    masked = MaskedTokens(np.arange(50, 60), [0] * 5 + [1] * 5)
    batch = collate_step([[Segment(0, 0, 20, 0), Segment(1, 0, 10, 0)]], {0: plain, 1: masked})[0]
    assert batch.labels.tolist() == list(range(11, 30)) + [-100] + [-100] * 4 + [55, 56, 57, 58, 59] + [-100]
    assert batch.num_loss_tokens == 19 + 5


def _targets(batches) -> Counter:
    """(doc id, token index) of every trained target the batches hold."""
    out = Counter()
    for b in batches:
        labels = b.labels.reshape(-1).tolist()
        offsets = b.cu_seqlens.tolist()
        for i, s in enumerate(b.segments):
            for j, lab in enumerate(labels[offsets[i] : offsets[i] + s.end - s.start]):
                if lab != -100:
                    out[(s.doc, s.start + j + 1)] += 1
    return out


def _rows(n: int, seed: int) -> list[dict]:
    docs = _masked_docs(n, seed, hi=300)
    return [{"input_ids": d.tolist(), "loss_mask": d.loss_mask.astype(int).tolist()} for d in docs]


@pytest.mark.parametrize("strategy,context,slicing", [("fixed", 128, False), ("wlb", 128, False),
                                                       ("slimpack", 256, True)])
def test_loader_trains_every_target_once_per_epoch(strategy, context, slicing):
    rows = _rows(40, seed=11)
    cfg = PlanConfig(strategy=strategy, max_tokens=128, context=context, tokens_per_step=512, allow_slicing=slicing,
                     num_micro_batches=8 if strategy == "slimpack" else None)
    loader = PackedLoader(SftSource(rows), tokenizer=None, config=cfg, num_threads=1)
    batches = list(loader)
    stream = loader.stream
    loader.close()
    got = _targets(batches)
    assert set(got.values()) == {1}  # nothing twice
    want = set()
    for doc_id in range(stream.num_docs):
        (shard,), (row,) = stream.locate([doc_id])
        mask = rows[int(row)]["loss_mask"]
        want |= {(doc_id, t) for t in range(1, len(mask)) if mask[t]}
    assert set(got) == want
    # the normaliser of a step is the sum of its micro-batches' trained targets
    per_step = Counter()
    for b in batches:
        per_step[b.step] += b.num_loss_tokens
    assert {b.step: b.loss_tokens_in_step for b in batches} == dict(per_step)
    assert batches[-1].stats.split_documents > 0  # some documents were longer than the context: pieces


def _rank_run(rank, world, rows, lengths):
    import torch.distributed as dist

    cfg = PlanConfig(strategy="fixed", max_tokens=128, context=128, tokens_per_step=256 * world,
                     parallel=ParallelConfig(dp=world))
    loader = PackedLoader(SftSource(rows), tokenizer=None, config=cfg, lengths=lengths, num_threads=1, timeout=60)
    mode = loader.lengths_mode
    batches = list(loader)
    loader.close()
    dist.barrier()
    return mode, [(b.step, b.num_loss_tokens, b.loss_tokens_in_step) for b in batches], dict(_targets(batches))


@pytest.mark.multiprocess
@pytest.mark.parametrize("lengths", ["gather", "local"])
def test_ranks_share_the_masked_normaliser_and_train_each_target_once(lengths):
    rows = _rows(30, seed=5)
    results = run_ranks(_rank_run, 2, rows, lengths)
    assert {m for m, _, _ in results} == {lengths}
    steps = {s for _, r, _ in results for s, _, _ in r}
    for s in steps:  # every rank's normaliser is the sum over both ranks' micro-batches of the step
        total = sum(n for _, r, _ in results for st, n, _ in r if st == s)
        assert {tot for _, r, _ in results for st, _, tot in r if st == s} == {total}
    got = Counter()
    for _, _, t in results:
        got.update(t)
    assert set(got.values()) == {1}
    want = sum(sum(r["loss_mask"][1:]) for r in rows)
    assert len(got) == want


def test_the_cost_model_prices_masked_tokens_too():
    """The same rows with their masks and with every token trained plan alike (segments and predicted costs): a
    mask changes the labels and the normaliser, never the packing."""
    rows = _rows(40, seed=2)
    cfg = PlanConfig(strategy="wlb", max_tokens=128, context=128, tokens_per_step=512)
    plans = []
    for loss_on in (None, "all"):
        loader = PackedLoader(SftSource(rows, loss_on=loss_on), tokenizer=None, config=cfg, num_threads=1)
        batches = list(loader)
        loader.close()
        plans.append([(b.step, [(s.doc, s.start, s.end) for s in b.segments], b.plan.ranks[0].micro_batches[0].fwd_cost)
                      for b in batches])
        losses = sum(b.num_loss_tokens for b in batches)
        if loss_on is None:
            assert losses == sum(sum(r["loss_mask"][1:]) for r in rows)
        else:
            assert losses == sum(len(r["input_ids"]) - 1 for r in rows)
    assert plans[0] == plans[1]


def test_a_state_saved_before_the_sft_counts_existed_resumes():
    """LoaderStats gained dropped_no_loss, dropped_too_long and no_loss_documents: a state without them (saved by
    the version before) resumes, with them at 0, to the same batches."""
    from packloader.sources.base import IterableSource

    docs = [np.arange(1, n + 2, dtype=np.int32) for n in range(60)]
    cfg = PlanConfig(strategy="fixed", max_tokens=128, context=128, tokens_per_step=256)
    a = PackedLoader(IterableSource(docs), config=cfg, tokenizer=None, append_eos=False, num_threads=1)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    rest = [b.input_ids.tolist() for b in it]
    a.close()
    for name in ("dropped_no_loss", "dropped_too_long", "no_loss_documents"):
        state["stats"].pop(name)
        state["loader"]["step_state"]["stats"].pop(name)
    b = PackedLoader(IterableSource(docs), config=cfg, tokenizer=None, append_eos=False, num_threads=1)
    b.load_state_dict(state)
    assert [x.input_ids.tolist() for x in b] == rest
    b.close()


@pytest.mark.multiprocess
def test_dataloader_workers_keep_the_masks(tmp_path):
    """PackedDataset under two spawned DataLoader workers: the source (a JSONL of conversations with a transformers
    tokenizer folder) is pickled into each worker, and every trained target arrives exactly once per epoch, as the
    source renders it in this process."""
    import json

    from helpers.sft_data import CONVERSATIONS, TOKENIZER_DIR
    from torch.utils.data import DataLoader

    from packloader.loader.dataset import PackedDataset

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 6))
    source = SftSource(str(path), str(TOKENIZER_DIR))
    cfg = PlanConfig(strategy="fixed", max_tokens=64, context=64, tokens_per_step=256)
    ds = PackedDataset(source, tokenizer=None, config=cfg, epochs=1)
    steps = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    got = _targets([b for mbs in steps for b in mbs])
    assert set(got.values()) == {1}
    stream = ds._p.stream
    want = set()
    for doc_id, tokens in zip(range(stream.num_docs), stream.read(np.arange(stream.num_docs))):
        want |= {(doc_id, t) for t in range(1, len(tokens)) if tokens.loss_mask[t]}
    assert set(got) == want and len(want) > 0
