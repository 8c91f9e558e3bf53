"""Stop the loader anywhere, restore it from state_dict() in a new process, and get the identical rest of the
stream: mid-epoch, mid-shard, with a planner holding pieces back, across an epoch's end."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.check import TokenLedger
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource

HERE = os.path.dirname(os.path.abspath(__file__))


def build_loader(spec: dict) -> PackedLoader:
    from test_loader_basic import DelayingPlanner, token_docs

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
    return (b.step, b.index_in_step, b.micro_batches_in_step, b.loss_tokens_in_step, b.extra["epoch"],
            b.extra["last_in_epoch"], h.hexdigest())


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
        results.append(([fingerprint(b) for b in rest], [segments_of(b) for b in rest], msgspec_stats(loader)))
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
    for k, head, (rest_fp, rest_segs, stats) in zip(stops, heads, results):
        if k == len(ref):  # saved after the pass ended: the restored loader's next pass is the next epochs
            assert rest_fp and rest_fp[0][4] == spec["epochs"] and rest_fp[0][0] == ref_fp[-1][0] + 1
            continue
        got = [fingerprint(b) for b in head] + rest_fp
        assert got == ref_fp, f"stream differs after resuming at batch {k}"
        # the same segments, so with the other ranks' every token exactly once per epoch
        assert [segments_of(b) for b in head] + rest_segs == ref_segs
        if rest_fp:
            assert stats == ref_stats[-1]


def msgspec_stats_of(b):
    import msgspec

    return msgspec.to_builtins(b.extra["stats"])


def write_shards(tmp_path, kind, seed):
    from test_loader_basic import text_docs, token_docs, write_text_shards, write_token_shards

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
def test_resume_in_a_new_process_continues_the_identical_stream(tmp_path, kind, delay, threads, chunk_docs, dp, seed, stops):
    spec = dict(kind=kind, n_docs=150, seed=seed, tokens_per_step=700, delay_over=delay, threads=threads,
                chunk_docs=chunk_docs, epochs=2, dp=dp[0], dp_rank=dp[1])
    if kind != "iterable":
        spec["paths"] = write_shards(tmp_path, kind, seed)
    check_resume(tmp_path, spec, stops)


def test_resume_at_the_edges(tmp_path):
    """Before the first batch, at an epoch's last batch, at the very end, and with pieces queued."""
    spec = dict(kind="iterable", n_docs=120, seed=5, tokens_per_step=900, delay_over=30, threads=2, chunk_docs=16,
                epochs=2)
    reference = build_loader(spec)
    ref = list(reference)
    ends = [i + 1 for i, b in enumerate(ref) if b.extra["last_in_epoch"]]
    queued = [i + 1 for i, b in enumerate(ref) if b.extra["plan"].delayed and b.index_in_step == b.micro_batches_in_step - 1]
    assert queued, "the delaying planner should hold pieces back"
    check_resume(tmp_path, spec, [0, ends[0], len(ref), queued[0], ends[0] - 1])


def test_resume_in_the_same_process_after_more_iteration():
    """load_state_dict on a loader that already ran ahead rewinds it exactly."""
    from test_loader_basic import token_docs

    cfg = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=600)
    loader = PackedLoader(IterableSource(token_docs(100, seed=1)), config=cfg, num_threads=2)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    after = [fingerprint(b) for b in it]
    loader.load_state_dict(state)
    assert [fingerprint(b) for b in loader] == after
