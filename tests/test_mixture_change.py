"""A mixture changed at resume (new weights, an entry added or removed), from the next step: every document drawn
before the change still trained once, each entry's passes going on where they stood, the new weights' shares
after it, the change recorded in the state and the log; what cannot be honoured refused, naming the entry. The
reference is the documents' content (`TAG * entry + doc` in every token), as in test_mixture_loader."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers.mixtures import TAG, tagged_entry, trained

from packloader.contracts import PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.mixture import Mixture, MixtureError

CONTEXT = 256
CONFIG = PlanConfig(strategy="wlb", max_tokens=CONTEXT, context=CONTEXT, tokens_per_step=4 * CONTEXT)


def entries(weights: dict[str, float]):
    made = {f"src{e}": tagged_entry(e, 40 + 15 * e, seed=50 + e, max_len=CONTEXT) for e in range(4)}
    import msgspec

    return [msgspec.structs.replace(made[n], weight=w) for n, w in weights.items()]


def loader(weights, **kw) -> PackedLoader:
    return PackedLoader(Mixture(entries=entries(weights)), tokenizer=None, config=CONFIG, num_threads=0,
                        epochs=None, **kw)


def run_until(ld: PackedLoader, steps: int) -> list:
    """Batches up to the end of step `steps - 1` (a step boundary)."""
    out = []
    for b in ld:
        out.append(b)
        if b.step == steps - 1 and b.index_in_step == b.micro_batches_in_step - 1:
            break
    return out


def counts(batches) -> dict[int, int]:
    total: dict[int, int] = {}
    for per in trained(batches).values():
        for tag, c in per.items():
            total[tag] = total.get(tag, 0) + c
    return total


def check_whole_passes(total: dict[int, int], lengths: dict[int, list[int]]) -> None:
    """Every document trained whole, and within an entry the counts differ by at most one (a pass is finished
    before the next starts, none repeats a document)."""
    for e, lens in lengths.items():
        times = [total.get(TAG * e + k, 0) / n for k, n in enumerate(lens)]
        assert all(t == int(t) for t in times), f"entry {e}: a document trained in part"
        assert max(times) - min(times) <= 1, (e, sorted(set(times)))


def lengths_of(weights) -> dict[int, list[int]]:
    return {int(e.name[3:]): [len(d) for d in e.source._docs] for e in entries(weights)}


def test_new_weights_from_the_next_step(caplog):
    before = {"src0": 0.5, "src1": 0.3, "src2": 0.2}
    after = {"src0": 0.1, "src1": 0.3, "src2": 0.6}
    first = loader(before)
    head = run_until(first, 37)
    state = first.state_dict()
    first.close()
    second = loader(after)
    with caplog.at_level(logging.WARNING, logger="packloader"):
        second.load_state_dict(state)
    assert "the mixture changed at resume, from step 37" in caplog.text
    assert "'src0': weight 0.5 -> 0.1" in caplog.text and "'src2': weight 0.2 -> 0.6" in caplog.text
    tail = run_until(second, 37 + 300)
    saved = second.state_dict()["mixture"]["changes"]
    assert len(saved) == 1 and saved[0]["step"] == 37 and "'src0': weight 0.5 -> 0.1" in saved[0]["what"]
    second.close()
    check_whole_passes(counts(head + tail), lengths_of(before))
    # after the change: the new shares, within one piece, apart from what was drawn before it (pending pieces)
    got = np.zeros(3)
    pending = 0
    for step, per in sorted(trained(tail).items()):
        for tag, c in per.items():
            got[tag // TAG] += c
        if step == 37:
            pending = got.sum()
    w = np.array(list(after.values()))
    assert np.abs(got - w * got.sum()).max() <= CONTEXT + pending


def test_added_entry_starts_its_first_pass_and_removed_one_stops():
    before = {"src0": 0.5, "src1": 0.5, "src2": 0.0}
    after = {"src0": 0.5, "src1": 0.25, "src3": 0.25}  # src2 (never drawn) removed, src3 added
    first = loader(before)
    head = run_until(first, 20)
    state = first.state_dict()
    first.close()
    second = loader(after)
    second.load_state_dict(state)
    assert "added 'src3'" in second.state_dict()["mixture"]["changes"][0]["what"]
    tail = run_until(second, 120)
    second.close()
    total = counts(head + tail)
    assert not any(t // TAG == 2 for t in total)
    assert any(t // TAG == 3 for t in counts(tail))
    check_whole_passes(total, {**lengths_of(before), **lengths_of(after)})


def test_removed_entry_with_documents_left_to_train_is_refused_naming_it():
    before = {"src0": 0.4, "src1": 0.6}
    first = loader(before)
    for b in first:  # a step boundary where src1 still has a document to train (queued or begun)
        if b.index_in_step == b.micro_batches_in_step - 1:
            mix = first.state_dict()["mixture"]
            if any(name == "src1" for _, name, _ in mix["origin"]["pending"]):
                break
    else:
        pytest.fail("no state with a pending src1 document")
    state = first.state_dict()
    first.close()
    second = loader({"src0": 1.0})
    with pytest.raises(MixtureError, match="mixture entry 'src1' was removed, but the saved state still holds its"):
        second.load_state_dict(state)


def test_an_entry_reading_other_shards_is_refused_naming_it():
    first = loader({"src0": 0.5, "src1": 0.5})
    run_until(first, 3)
    state = first.state_dict()
    first.close()
    import msgspec

    changed = entries({"src0": 0.5, "src1": 0.5})
    changed[1] = msgspec.structs.replace(changed[1], source=type(changed[1].source)(changed[1].source._docs[:-1],
                                                                                     name="src1"))
    second = PackedLoader(Mixture(entries=changed), tokenizer=None, config=CONFIG, num_threads=0, epochs=None)
    with pytest.raises(MixtureError, match="mixture entry 'src1' reads other shards than when the state was saved"):
        second.load_state_dict(state)


def test_same_mixture_after_a_change_resumes_exactly():
    """A state saved after a change, loaded with the changed mixture, goes on as the run that made the change."""
    from helpers.source_resume import batch_digest

    first = loader({"src0": 0.5, "src1": 0.5})
    run_until(first, 10)
    state = first.state_dict()
    first.close()
    after = {"src0": 0.2, "src1": 0.5, "src3": 0.3}
    a = loader(after)
    a.load_state_dict(state)
    run_until(a, 25)
    mid = a.state_dict()
    rest_a = [batch_digest(b) for b in run_until(a, 60)]
    a.close()
    b = loader(after)
    b.load_state_dict(mid)
    assert [batch_digest(x) for x in run_until(b, 60)] == rest_a
    assert len(b.state_dict()["mixture"]["changes"]) == 1
    b.close()


def test_packed_dataset_resumes_its_mixture_and_refuses_a_changed_one():
    from packloader import PackedDataset

    def dataset(weights):
        return PackedDataset(Mixture(entries=entries(weights)), tokenizer=None, config=CONFIG, epochs=1)

    it = iter(dataset({"src0": 0.5, "src1": 0.5}))
    for _ in range(4):
        next(it)
    state = it.state_dict()
    rest = [[(s.doc, s.start, s.end) for b in step for s in b.segments] for step in it]
    it.close()
    same = iter(dataset({"src0": 0.5, "src1": 0.5}))
    same.load_state_dict(state)
    assert [[(s.doc, s.start, s.end) for b in step for s in b.segments] for step in same] == rest
    same.close()
    changed = iter(dataset({"src0": 0.2, "src1": 0.8}))
    with pytest.raises(ValueError, match="source.mixture"):
        changed.load_state_dict(state)
    changed.close()
