"""`auto` with its candidates planned in threads at scale (candidate_pool, PACKLOADER_AUTO_THREADS): the same plans
and states, step after step, as the same planner planning them in turn, the threads really used, and the pool
neither pickled nor shared with a forked child."""

from __future__ import annotations

import pickle
import threading

import msgspec
import numpy as np
import pytest

from packloader.balancers.planners.auto import SMALL_WORK, AutoPlanner
from packloader.balancers.planners.candidate_pool import THREADS_ENV, auto_threads
from packloader.balancers.planners.registry import Window
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

CAP = 8192


def _config(dp: int, pp: int) -> PlanConfig:
    return PlanConfig(strategy="auto", parallel=ParallelConfig(dp=dp, pp=pp, tp=8), max_tokens=CAP, context=CAP,
                      tokens_per_step=dp * 4 * CAP, allow_slicing=True, model="llama3-8b", cost="measured")


def _windows(cfg: PlanConfig, steps: int, seed: int) -> list[Window]:
    """Steps of a long-tailed draw, cut at the context (pieces), each over tokens_per_step."""
    rng = np.random.default_rng(seed)
    out, doc = [], 0
    for _ in range(steps):
        lengths = np.minimum(rng.lognormal(4.8, 1.5, 6 * cfg.tokens_per_step // 300).astype(np.int64) + 1, 4 * CAP)
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), cfg.tokens_per_step)) + 1]
        docs, offs, lens = [], [], []
        for length in lengths.tolist():
            for o in range(0, length, CAP):
                docs.append(doc)
                offs.append(o)
                lens.append(min(CAP, length - o))
            doc += 1
        out.append(Window(np.array(docs, np.int64), np.array(offs, np.int64), np.array(lens, np.int64)))
    return out


def _run(planner: AutoPlanner, windows: list[Window]) -> list[bytes]:
    state, out = PlannerState(), []
    for s, w in enumerate(windows):
        plan, state = planner.plan(w, state, s)
        out.append(msgspec.msgpack.encode(plan) + msgspec.msgpack.encode(state))
    return out


@pytest.mark.parametrize("dp, pp", [(128, 1), (96, 2)])
def test_threads_plan_what_the_planner_plans_in_turn(dp, pp):
    cfg = _config(dp, pp)
    windows = _windows(cfg, 4, seed=dp + pp)
    assert all(len(w.doc) * dp > SMALL_WORK for w in windows)  # at scale: the threaded path
    in_turn = AutoPlanner(cfg)
    in_turn.pool.threads = 1
    threaded = AutoPlanner(cfg)
    threaded.pool.threads = 3
    names: set[str] = set()
    evaluate = threaded.evaluate

    def spy(*a, **k):
        names.add(threading.current_thread().name)
        return evaluate(*a, **k)

    threaded.evaluate = spy
    expected = _run(in_turn, windows)
    assert _run(threaded, windows) == expected
    assert names and all(n.startswith("packloader-auto") for n in names)
    # the scores and the memory the report shows are those of the planner in turn
    assert threaded.last_scores == in_turn.last_scores and threaded.memory_drops == in_turn.memory_drops
    # pickled (a spawned worker) without its threads, it plans the same again
    del threaded.evaluate
    again = pickle.loads(pickle.dumps(threaded))
    assert again.pool.threads == 3 and again.pool._pool is None
    assert _run(again, windows) == expected


def test_threads_env(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert auto_threads() == 1
    monkeypatch.setenv(THREADS_ENV, "4")
    assert auto_threads() == 4 and AutoPlanner(_config(8, 1)).pool.threads == 4
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"{THREADS_ENV}='{bad}': expected a whole number of threads, 1 or more"):
            auto_threads()
