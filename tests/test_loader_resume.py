"""Stop the loader anywhere, restore it from state_dict() in a new process, and get the identical rest of the
stream: mid-epoch, mid-shard, with a planner holding pieces back, across an epoch's end."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import time

import pytest
from helpers.planners import SlowPlanner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource
from tests.helpers.ledger import TokenLedger

HERE = os.path.dirname(os.path.abspath(__file__))


def build_loader(spec: dict) -> PackedLoader:
    from helpers.docs import token_docs
    from helpers.planners import DelayingPlanner

    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=spec.get("context", 256),
                     tokens_per_step=spec["tokens_per_step"], parallel=ParallelConfig(dp=spec.get("dp", 1)))
    source = IterableSource(token_docs(spec["n_docs"], seed=spec["seed"])) if spec["kind"] == "iterable" else spec["paths"]
    planner = DelayingPlanner(cfg, threshold=spec["delay_over"]) if spec.get("delay_over") else None
    return PackedLoader(source, tokenizer="bytes", config=cfg, planner=planner, dp_rank=spec.get("dp_rank", 0),
                        num_threads=spec["threads"], chunk_docs=spec["chunk_docs"], epochs=spec["epochs"],
                        seed=spec.get("seed", 0))


def fingerprint(b) -> tuple:
    h = hashlib.blake2b(digest_size=8)
    for t in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens, b.cu_seqlens_k, b.doc_ids):
        h.update(t.numpy().tobytes())
    return (b.step, b.index_in_step, b.micro_batches_in_step, b.loss_tokens_in_step, b.epoch,
            b.last_in_epoch, h.hexdigest())


def segments_of(b) -> list[tuple[int, int, int]]:
    return [(s.doc, s.start, s.end) for s in b.segments]


def child_main(in_path: str, out_path: str) -> None:
    """Runs in a fresh interpreter: build the loader, load each saved state, return the rest of each stream."""
    with open(in_path, "rb") as f:
        spec, states = pickle.load(f)
    results = []
    for state in states:
        loader = build_loader(spec)
        loader.load_state_dict(state)
        rest = list(loader)
        # a state saved after the pass's last batch resumes into that pass, which ends: the next pass goes on
        after = [fingerprint(b) for b in list(loader)[:1]] if not rest else None
        results.append(([fingerprint(b) for b in rest], [segments_of(b) for b in rest], msgspec_stats(loader), after))
        loader.close()
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


def msgspec_stats(loader):
    import msgspec

    return msgspec.to_builtins(loader.stats)


def restore_in_new_process(tmp_path, spec, states):
    in_path, out_path = tmp_path / "in.pkl", tmp_path / "out.pkl"
    with open(in_path, "wb") as f:
        pickle.dump((spec, states), f)
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_loader_resume as m; m.child_main({str(in_path)!r}, {str(out_path)!r})"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out_path, "rb") as f:
        return pickle.load(f)


def check_resume(tmp_path, spec, stops):
    reference = build_loader(spec)
    ref = list(reference)
    ref_fp = [fingerprint(b) for b in ref]
    ref_stats = [msgspec_stats_of(b) for b in ref]
    ref_segs = [segments_of(b) for b in ref]
    # the reference itself covers every token once per epoch (all data-parallel ranks together)
    ledger = TokenLedger(reference.stream)
    ledger.add(ref)
    for r in range(spec.get("dp", 1)):
        if r != spec.get("dp_rank", 0):
            other = build_loader(dict(spec, dp_rank=r))
            ledger.add(list(other))
            other.close()
    for e in range(spec["epochs"]):
        ledger.check_epoch(e)
    reference.close()

    stops = sorted({min(s, len(ref)) for s in stops})
    states, heads = [], []
    for k in stops:
        loader = build_loader(spec)
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        states.append(loader.state_dict())
        heads.append(head)
        loader.close()
    results = restore_in_new_process(tmp_path, spec, states)
    for k, head, (rest_fp, rest_segs, stats, after) in zip(stops, heads, results):
        if k == len(ref):  # saved at the pass's last batch: the pass yields nothing more, the next one the next epochs
            assert rest_fp == []
            assert after and after[0][4] == spec["epochs"] and after[0][0] == ref_fp[-1][0] + 1
            continue
        got = [fingerprint(b) for b in head] + rest_fp
        assert got == ref_fp, f"stream differs after resuming at batch {k}"
        # the same segments, so with the other ranks' every token exactly once per epoch
        assert [segments_of(b) for b in head] + rest_segs == ref_segs
        if rest_fp:
            assert stats == ref_stats[-1]


def msgspec_stats_of(b):
    import msgspec

    return msgspec.to_builtins(b.stats)


def write_shards(tmp_path, kind, seed):
    from helpers.docs import text_docs, token_docs, write_text_shards, write_token_shards

    d = tmp_path / f"shards-{kind}-{seed}"
    d.mkdir(exist_ok=True)
    if kind == "parquet_tokens":
        return write_token_shards(d, token_docs(160, seed=seed), shards=4, row_group_size=11)
    return write_text_shards(d, text_docs(120, seed=seed), shards=3, row_group_size=9)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["iterable", "parquet_tokens", "parquet_text"]),
    delay=st.sampled_from([None, 40]),
    threads=st.sampled_from([0, 2]),
    chunk_docs=st.sampled_from([5, 64]),
    dp=st.sampled_from([(1, 0), (2, 1)]),
    seed=st.integers(0, 3),
    stops=st.lists(st.integers(0, 400), min_size=1, max_size=4),
)
@pytest.mark.multiprocess
def test_resume_in_a_new_process_continues_the_identical_stream(tmp_path, kind, delay, threads, chunk_docs, dp, seed, stops):
    spec = dict(kind=kind, n_docs=150, seed=seed, tokens_per_step=700, delay_over=delay, threads=threads,
                chunk_docs=chunk_docs, epochs=2, dp=dp[0], dp_rank=dp[1])
    if kind != "iterable":
        spec["paths"] = write_shards(tmp_path, kind, seed)
    check_resume(tmp_path, spec, stops)


@pytest.mark.multiprocess
def test_resume_at_the_edges(tmp_path):
    """Before the first batch, at an epoch's last batch, at the very end, and with pieces queued."""
    spec = dict(kind="iterable", n_docs=120, seed=5, tokens_per_step=900, delay_over=30, threads=2, chunk_docs=16,
                epochs=2)
    reference = build_loader(spec)
    ref = list(reference)
    ends = [i + 1 for i, b in enumerate(ref) if b.last_in_epoch]
    queued = [i + 1 for i, b in enumerate(ref) if b.plan.delayed and b.index_in_step == b.micro_batches_in_step - 1]
    assert queued, "the delaying planner should hold pieces back"
    check_resume(tmp_path, spec, [0, ends[0], len(ref), queued[0], ends[0] - 1])


def test_resume_in_the_same_process_after_more_iteration():
    """load_state_dict on a loader that already ran ahead rewinds it exactly."""
    from helpers.docs import token_docs

    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=600)
    loader = PackedLoader(IterableSource(token_docs(100, seed=1)), config=cfg, num_threads=2)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    after = [fingerprint(b) for b in it]
    loader.load_state_dict(state)
    assert [fingerprint(b) for b in loader] == after


def _fixed(tokens_per_step=900):
    return PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=tokens_per_step)


def test_a_state_saved_at_the_pass_last_batch_resumes_the_ended_pass(tmp_path):
    """epochs=1. A state taken inside the loop after the pass's last batch resumes into that pass, which yields
    nothing more (as the uninterrupted loop would), and the next pass is epoch 1; a state taken after the loop
    resumes before the next pass. Token by token against the uninterrupted run: no epoch is trained twice."""
    from helpers.docs import token_docs

    docs = token_docs(120, seed=7)

    def make():
        return PackedLoader(IterableSource(docs), config=_fixed(), num_threads=2, epochs=1)

    ref = make()
    ref_passes = [[fingerprint(b) for b in ref] for _ in range(2)]  # epochs 0 and 1
    ref.close()
    assert {f[4] for f in ref_passes[0]} == {0} and {f[4] for f in ref_passes[1]} == {1}

    a = make()
    first = []
    for b in a:
        first.append(b)
        inside = a.state_dict()  # the last one: after the pass's last batch, inside the loop
    after_loop = a.state_dict()
    a.close()
    assert [fingerprint(b) for b in first] == ref_passes[0]

    b = make()
    b.load_state_dict(pickle.loads(pickle.dumps(inside)))
    resumed = [list(b) for _ in range(2)]
    assert resumed[0] == [], "the pass the state was saved in had ended"
    assert [fingerprint(x) for x in resumed[1]] == ref_passes[1]
    ledger = TokenLedger(b.stream)
    ledger.add(first + resumed[1])
    assert ledger.check_epoch(0) == ledger.check_epoch(1) == sum(len(d) for d in docs)
    assert all(d // b.stream.num_docs < 2 for d in ledger.segments), "no extra epoch"
    b.close()

    c = make()
    c.load_state_dict(after_loop)
    assert [fingerprint(x) for x in c] == ref_passes[1]
    c.close()

    d = make()  # leaving the loop with break after the last batch ends the pass too
    for x in d:
        if x.last_in_epoch:
            break
    assert [fingerprint(x) for x in d] == ref_passes[1]
    d.close()


@pytest.mark.parametrize("saved,loaded", [
    (dict(num_threads=2), dict(num_threads=0)),
    (dict(num_threads=0), dict(num_threads=2)),
    (dict(lengths="column"), dict(lengths="local")),
    (dict(lengths="local", num_threads=2), dict(lengths="column", num_threads=0, prefetch=1, chunk_docs=7)),
    (dict(num_threads=1, prefetch=3, chunk_docs=5), dict(num_threads=2, prefetch=1, chunk_docs=64, layout="hf")),
])
def test_resume_across_options_that_do_not_change_the_stream(tmp_path, saved, loaded):
    """Threads, prefetching, chunk size, the lengths mode and the layout are not part of the saved position: a
    state saved under one resumes under another, mid-step and at step ends, to the uninterrupted stream."""
    from helpers.docs import token_docs, write_token_shards

    docs = token_docs(160, seed=2)
    paths = write_token_shards(tmp_path, docs, shards=3, row_group_size=11)

    def make(**kw):
        return PackedLoader(paths, config=_fixed(700), epochs=2, **kw)

    def tokens(b):  # the layout changes the shape, not the tokens
        return (b.step, b.index_in_step, b.epoch, b.input_ids.reshape(-1).tolist(), segments_of(b))

    ref = make()
    ref_batches = list(ref)
    ref.close()
    stops = [1, 2, len(ref_batches) // 2 + 1, len(ref_batches) - 1]
    assert any(ref_batches[k - 1].index_in_step < ref_batches[k - 1].micro_batches_in_step - 1 for k in stops)
    for k in stops:
        a = make(**saved)
        it = iter(a)
        head = [next(it) for _ in range(k)]
        state = pickle.loads(pickle.dumps(a.state_dict()))
        a.close()
        b = make(**loaded)
        b.load_state_dict(state)
        rest = list(b)
        b.close()
        assert [tokens(x) for x in head + rest] == [tokens(x) for x in ref_batches], f"resumed after batch {k}"
    ledger = TokenLedger(b.stream)
    ledger.add(head + rest)
    assert ledger.check_epoch(0) == ledger.check_epoch(1) == sum(len(d) for d in docs)


def test_an_incomplete_or_old_state_is_refused_naming_the_key():
    from helpers.docs import token_docs

    docs = token_docs(50)
    a = PackedLoader(IterableSource(docs), config=_fixed(), num_threads=0)
    next(iter(a))
    state = a.state_dict()
    b = PackedLoader(IterableSource(docs), config=_fixed(), num_threads=0)
    for key in ("loader", "fingerprint", "pass_left"):
        with pytest.raises(ValueError, match=f"missing required field `{key}`"):
            b.load_state_dict({k: v for k, v in state.items() if k != key})
    with pytest.raises(ValueError, match=r"`step_state`"):
        b.load_state_dict(dict(state, loader={"skip": 0}))
    with pytest.raises(ValueError, match=r"\$\.loader\.skip"):
        b.load_state_dict(dict(state, loader=dict(state["loader"], skip=-1)))
    with pytest.raises(ValueError, match="'format' is 'packloader.loader/1'"):
        b.load_state_dict(dict(state, format="packloader.loader/1"))
    with pytest.raises(TypeError, match="got list"):
        b.load_state_dict([state])
    b.load_state_dict(state)  # the complete one still loads
    assert fingerprint(next(iter(b))) == fingerprint(list(a)[0])


def test_load_state_dict_while_the_planning_thread_is_busy(tmp_path):
    """A loader that ran ahead, its planning thread busy with a slow step, rewinds exactly: no thread of the
    replaced pipeline draws a step from the restored position."""
    from helpers.docs import token_docs, write_token_shards

    paths = write_token_shards(tmp_path, token_docs(70, seed=3), shards=2)
    cfg = _fixed()
    planner = SlowPlanner(cfg)
    loader = PackedLoader(paths, config=cfg, planner=planner, num_threads=2, prefetch=2)
    ref = [fingerprint(b) for b in loader]
    steps = len({f[0] for f in ref})
    assert steps >= 5
    planner.pause, planner.slow = 1.5, range(steps, 2 * steps)  # the second epoch's steps
    it = iter(loader)
    next(it)
    time.sleep(0.3)  # the pipeline is planning the second epoch's next step
    loader.load_state_dict(state_after(cfg, paths, 3))
    assert [fingerprint(b) for b in loader] == ref[3:]
    loader.close()


def state_after(cfg, paths, k):
    loader = PackedLoader(paths, config=cfg, num_threads=2, prefetch=2)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = loader.state_dict()
    loader.close()
    return state
