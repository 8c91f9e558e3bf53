"""A mixture through PackedLoader: token shares within one piece at every step, every document of an entry once
per pass of that entry, per-entry StepMetrics and batch entries, exact resume. The reference is the documents'
content: every token of document k of entry e is `TAG * e + k`, so what trained is read off the batches
themselves, independently of the loader's ids and bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.mixtures import TAG, tagged_entry, trained
from helpers.source_resume import check_exact_resume

from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.mixture import Mixture


def test_token_shares_of_five_entries_stay_within_one_piece_for_1000_steps():
    weights = [0.4, 0.25, 0.15, 0.12, 0.08]
    context = 128
    entries = [tagged_entry(e, 60 + 40 * e, seed=e, max_len=context if e % 2 else context // 4, weight=w)
               for e, w in enumerate(weights)]
    cfg = PlanConfig(strategy="fixed", max_tokens=context, context=context, tokens_per_step=4 * context)
    loader = PackedLoader(Mixture(entries=entries), tokenizer=None, config=cfg, num_threads=0, epochs=None)
    got = np.zeros(len(weights))
    steps = 0
    metrics_tokens = {}
    by_step: dict[int, list] = {}
    for b in loader:
        by_step.setdefault(b.step, []).append(b)
        metrics_tokens[b.step] = b.step_metrics.entry_tokens
        if len(by_step) > 1000:
            break
    loader.close()
    for step in sorted(by_step)[:1000]:
        counts = trained(by_step[step])[step]
        per_entry = np.zeros(len(weights))
        for tag, c in counts.items():
            per_entry[tag // TAG] += c
        assert metrics_tokens[step] == {f"src{e}": int(per_entry[e]) for e in range(len(weights))}
        got += per_entry
        steps += 1
        dev = np.abs(got - np.asarray(weights) * got.sum())
        assert dev.max() <= context, (step, dev.tolist())
    assert steps == 1000


def _sizes_and_lengths(entries):
    return [[len(d) for d in e.source._docs] for e in entries]


@pytest.mark.parametrize("weights", [dict(weight=[0.6, 0.3, 0.1]), dict(repeat=[2.0, 0.5, 1.0]),
                                     dict(choose=[30, 200, 5])])
def test_every_document_once_per_pass_of_its_entry(weights):
    (field, values), = weights.items()
    entries = [tagged_entry(e, n, seed=10 + e, max_len=300, **{field: v})
               for e, (n, v) in enumerate(zip([50, 70, 90], values))]
    lengths = _sizes_and_lengths(entries)
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)
    loader = PackedLoader(Mixture(entries=entries), tokenizer=None, config=cfg, num_threads=1, epochs=3)
    batches = list(loader)
    stream = loader.stream
    loader.close()
    total: dict[int, int] = {}
    for counts in trained(batches).values():
        for tag, c in counts.items():
            total[tag] = total.get(tag, 0) + c
    docs_drawn = [0, 0, 0]
    for epoch in range(3):
        ent = stream.entry_of(stream.doc_ids(epoch, np.arange(stream.num_docs)))
        docs_drawn = [d + int((ent == e).sum()) for e, d in enumerate(docs_drawn)]
    for e, lens in enumerate(lengths):
        n = len(lens)
        passes, extra = divmod(docs_drawn[e], n)
        times = np.array([total.get(TAG * e + k, 0) / lens[k] for k in range(n)])
        # whole documents only, each `passes` times and the first `extra` of the next pass once more
        assert np.all(times == np.round(times)), f"entry {e}: a document trained in part"
        assert sorted(times.tolist()) == sorted([passes + 1] * extra + [passes] * (n - extra)), e


def test_each_segment_names_its_entry_and_loss_tokens_per_entry():
    entries = [tagged_entry(e, 40, seed=20 + e, max_len=500, weight=w) for e, w in enumerate([0.5, 0.5])]
    cfg = PlanConfig(strategy="wlb", max_tokens=512, context=256, tokens_per_step=2048)
    loader = PackedLoader(Mixture(entries=entries), tokenizer=None, config=cfg, num_threads=1)
    loss: dict[int, dict[str, int]] = {}
    for b in loader:
        assert b.entry_names == ["src0", "src1"]
        cu = b.cu_seqlens.numpy()
        ids, labels = b.input_ids.numpy(), b.labels.numpy()
        for i, e in enumerate(b.entries.tolist()):
            assert (ids[cu[i]:cu[i + 1]] // TAG == e).all()  # the tag says the entry
        per = loss.setdefault(b.step, {"src0": 0, "src1": 0})
        for e in (0, 1):
            per[f"src{e}"] += int(((ids // TAG == e) & (labels != -100)).sum())
        assert b.step_metrics.entry_loss_tokens == per or b.index_in_step < b.micro_batches_in_step - 1
        assert sum(b.step_metrics.entry_loss_tokens.values()) == b.loss_tokens_in_step
    loader.close()


@pytest.mark.parametrize("stop", [1, 7, 19])
def test_resume_continues_the_mixture_exactly(stop):
    entries = [tagged_entry(e, 30 + 10 * e, seed=30 + e, max_len=400, weight=w) for e, w in enumerate([2, 1, 1])]
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)

    def make():
        return PackedLoader(Mixture(entries=entries), tokenizer=None, config=cfg, num_threads=1, epochs=2)

    check_exact_resume(make, stop)


def test_length_band_upsampling_takes_long_documents_k_times_per_pass():
    from packloader.sources.upsample import LengthBand

    plain = tagged_entry(0, 60, seed=40, max_len=300, repeat=1.0)
    long_up = tagged_entry(1, 50, seed=41, max_len=300, repeat=2.0)
    import msgspec

    long_up = msgspec.structs.replace(long_up, upsample=[LengthBand(min_tokens=150, times=3),
                                                         LengthBand(min_tokens=250, times=4)])
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)
    loader = PackedLoader(Mixture(entries=[plain, long_up]), tokenizer=None, config=cfg, num_threads=1, epochs=1)
    total: dict[int, int] = {}
    for per in trained(list(loader)).values():
        for tag, c in per.items():
            total[tag] = total.get(tag, 0) + c
    loader.close()
    import pickle  # as DataLoader workers receive it

    ids = loader.stream.doc_ids(0, np.arange(loader.stream.num_docs))
    clone = pickle.loads(pickle.dumps(loader.stream))
    assert [t.tolist() for t in clone.read(ids)] == [t.tolist() for t in loader.stream.read(ids)]
    for k, doc in enumerate(plain.source._docs):  # one pass, no band: each document once
        assert total[k] == len(doc)
    for k, doc in enumerate(long_up.source._docs):  # two passes: each document 2 x its band's times
        want = 4 if len(doc) >= 250 else 3 if len(doc) >= 150 else 1
        assert total[TAG + k] == 2 * want * len(doc), (k, len(doc))


def test_the_step_metrics_log_line_lists_each_entrys_tokens():
    from packloader.loader.step_metrics import format_step_metrics

    entries = [tagged_entry(e, 20, seed=60 + e, max_len=200, weight=0.5) for e in range(2)]
    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)
    loader = PackedLoader(Mixture(entries=entries), tokenizer=None, config=cfg, num_threads=0)
    b = next(iter(loader))
    per = trained([x for x in [b]])  # the first micro-batch only; the record covers the whole step
    loader.close()
    m = b.step_metrics
    assert f"; entries src0 {m.entry_tokens['src0']:,}, src1 {m.entry_tokens['src1']:,}" in format_step_metrics(m)
    assert sum(m.entry_tokens.values()) == m.tokens >= sum(per[b.step].values())
