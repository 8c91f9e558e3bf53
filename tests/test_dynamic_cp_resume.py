"""Resume under per-document CP (issue 26): a state saved before `cp_mode` existed loads as cp_mode "fixed"
(exactly, at the same layout); cp_mode may change on resume (an elastic change: both modes draw the same steps);
and a per-document CP epoch interrupted mid-step and resumed, at the same pool or another layout, trains the same
token multiset as an uninterrupted epoch: every token of every document once (checked against the source)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers.docs import token_docs

from packloader import PackedLoader, ParallelConfig, PlanConfig, merge_states
from packloader.sources.base import IterableSource

CONTEXT = 128


def _docs():
    return token_docs(40, seed=3, max_len=200)


def _config(dp: int, cp: int = 1, cp_mode: str = "fixed", max_tokens: int | None = None) -> PlanConfig:
    """Per-document CP at 64 / cp tokens a GPU (long pieces need a subgroup); fixed CP 1 at 128, the context."""
    max_tokens = max_tokens or (64 if cp_mode == "dynamic" else CONTEXT)
    return PlanConfig(strategy="auto", parallel=ParallelConfig(dp=dp, cp=cp), max_tokens=max_tokens, context=CONTEXT,
                      tokens_per_step=400, allow_slicing=False, cp_mode=cp_mode)  # type: ignore[arg-type]


def _loader(cfg: PlanConfig, gpu: int, state=None) -> PackedLoader:
    """Pool GPU `gpu` (dp_rank gpu // cp, cp_rank gpu % cp under cp_mode dynamic; dp_rank gpu under fixed CP 1)."""
    cp = cfg.parallel.cp
    kw = {"dp_rank": gpu // cp, "cp_rank": gpu % cp} if cfg.cp_mode == "dynamic" else {"dp_rank": gpu}
    ld = PackedLoader(IterableSource(_docs()), config=cfg, shuffle=False, num_threads=0, **kw)
    if state is not None:
        ld.load_state_dict(state)
    return ld


def _tokens(b, ld: PackedLoader) -> list[tuple[int, int]]:
    """(document, position in it) of every token of the micro-batch, its ids checked against the source."""
    runs = np.diff(b.cu_seqlens.numpy())
    which = b.cp.run_segment if b.cp is not None else np.arange(len(b.segments))
    segs = [b.segments[i] for i in np.repeat(which, runs)]
    out = [(s.doc, s.start + p) for s, p in zip(segs, b.position_ids.tolist())]
    for (d, at), t in zip(out, b.input_ids.tolist()):
        assert t == ld.stream.read([d])[0][at], (d, at)
    return out


def _take(ld: PackedLoader, stop, seen: Counter) -> None:
    """Micro-batches up to `stop` (None: the rest of the epoch; (step, i): up to micro-batch i of that step)."""
    for b in ld:
        seen.update(_tokens(b, ld))
        if stop is not None and (b.step, b.index_in_step) == stop:
            return


def _phase(cfg: PlanConfig, state, stops, seen: Counter) -> list[dict]:
    """Every GPU of a layout in this process; GPU g stops at stops[its DP rank]; one state per DP rank after."""
    pool = cfg.parallel.dp * (cfg.parallel.cp if cfg.cp_mode == "dynamic" else 1)
    per_dp = pool // cfg.parallel.dp
    states = []
    for g in range(pool):
        ld = _loader(cfg, g, state)
        _take(ld, stops[g // per_dp], seen)
        if g % per_dp == 0:
            states.append(ld.state_dict())
        ld.close()
    return states


def _epoch_tokens() -> Counter:
    """Every token of every document once: the multiset an uninterrupted epoch trains."""
    return Counter((d, p) for d, doc in enumerate(_docs()) for p in range(len(doc)))


def test_dynamic_cp_uninterrupted_epoch_trains_every_token_once():
    seen: Counter = Counter()
    _phase(_config(2, 2, "dynamic"), None, [None, None], seen)
    assert seen == _epoch_tokens()


@pytest.mark.parametrize("then", [
    ("same pool", _config(2, 2, "dynamic")),
    ("another pool", _config(1, 4, "dynamic", max_tokens=128)),
    ("fixed CP", _config(3)),
])
def test_dynamic_cp_interrupted_mid_step_resumes_with_the_epoch_token_multiset(then):
    """DP 2 x CP 2 per-document CP stops inside step 2 (after slot 1: CP groups span both DP ranks, so the pool
    stops at one slot), every DP rank's state merged; resumed at the same pool, at DP 1 x CP 4, or with cp_mode
    changed to fixed at DP 3."""
    seen: Counter = Counter()
    states = _phase(_config(2, 2, "dynamic"), None, [(2, 1), (2, 1)], seen)
    assert all(st["loader"]["skip"] for st in states)  # inside the step
    _phase(then[1], merge_states(states), [None] * then[1].parallel.dp, seen)
    assert seen == _epoch_tokens()


def test_dynamic_cp_fixed_state_resumes_per_document_mid_step():
    """cp_mode changed the other way: fixed CP at DP 2 stops inside step 1, resumed with cp_mode dynamic."""
    seen: Counter = Counter()
    states = _phase(_config(2), None, [(1, 0), (1, 0)], seen)
    assert all(st["loader"]["skip"] for st in states)
    _phase(_config(2, 2, "dynamic"), merge_states(states), [None, None], seen)
    assert seen == _epoch_tokens()


def _without_cp_mode(state: dict) -> dict:
    config = {k: v for k, v in state["fingerprint"]["config"].items() if k != "cp_mode"}
    return dict(state, fingerprint=dict(state["fingerprint"], config=config))


def test_dynamic_cp_state_saved_before_cp_mode_resumes_as_fixed_exactly():
    """A mid-step state of one of two DP ranks (which only an exact, same-layout resume accepts) without
    config.cp_mode, as states were saved before it existed: it resumes as cp_mode fixed, and the rest equals what
    an uninterrupted loader yields."""
    cfg = _config(2)
    ref = _loader(cfg, 1)
    want = [(b.step, b.index_in_step, _tokens(b, ref)) for b in ref]
    ref.close()
    ld = _loader(cfg, 1)
    it = iter(ld)
    for _ in range(3):
        next(it)
    state = _without_cp_mode(ld.state_dict())
    ld.close()
    assert state["loader"]["skip"] and "cp_mode" not in state["fingerprint"]["config"]
    resumed = _loader(cfg, 1, state)
    got = [(b.step, b.index_in_step, _tokens(b, resumed)) for b in resumed]
    resumed.close()
    assert got == want[3:]


def test_dynamic_cp_state_saved_before_cp_mode_resumes_per_document():
    """Such a state, saved at a step boundary, also resumes with cp_mode dynamic (an elastic change)."""
    seen: Counter = Counter()
    ld = _loader(_config(1), 0)
    for b in ld:
        seen.update(_tokens(b, ld))
        if b.step == 1 and b.index_in_step == b.micro_batches_in_step - 1:
            break
    state = _without_cp_mode(ld.state_dict())
    ld.close()
    assert state["loader"]["skip"] == 0
    _phase(_config(2, 2, "dynamic"), state, [None, None], seen)
    assert seen == _epoch_tokens()


def test_dynamic_cp_state_other_fields_still_refused():
    """Filling in cp_mode does not loosen the check: a state without it but with another context is refused."""
    ld = _loader(_config(1), 0)
    next(iter(ld))
    state = _without_cp_mode(ld.state_dict())
    ld.close()
    other = PlanConfig(strategy="auto", parallel=ParallelConfig(dp=1), max_tokens=64, context=64,
                       tokens_per_step=400, allow_slicing=False)
    with pytest.raises(ValueError, match=r"config.context: saved 128, now 64"):
        PackedLoader(IterableSource(_docs()), config=other, shuffle=False, num_threads=0,
                     dp_rank=0).load_state_dict(state)
