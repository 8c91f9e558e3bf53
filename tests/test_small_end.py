"""The small end of the cost model (issue 38 part 1): the key-buffer assembly of a launch holding a slice, the
fit of its cost and a per-slice floor, and the refit of the H200 proof's recorded measurements."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from packloader.balancers.cost.measured import base_profile
from packloader.balancers.cost.slice_fit import SliceTimings, assembly_times, fit_slice_term
from packloader.contracts import Segment
from packloader.runtime.slice_cache import SliceKVCache
from packloader.runtime.slices import SliceContext

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, HD = 4, 2, 8


def _key_buffer_inputs(kk: torch.Tensor) -> list[str]:
    """The autograd nodes the key buffer's concatenation takes its pieces from (the attention kernel's own
    graph, which the reference backend builds by slicing, left out)."""
    assert type(kk.grad_fn).__name__ == "CatBackward0"
    return [type(fn).__name__ for fn, _ in kk.grad_fn.next_functions if fn is not None]


def _launch(docs: int, split: bool, monkeypatch=None):
    """`docs` whole documents of 6 tokens and one slice of 5 tokens after 7 cached keys, through SliceContext
    (split=True) or through the per-segment indexing it replaced (the reference assembly)."""
    g = torch.Generator().manual_seed(docs)
    segs = [Segment(doc=i, start=0, end=6, attend_from=0) for i in range(docs)]
    segs.append(Segment(doc=docs, start=7, end=12, attend_from=0))
    T = 6 * docs + 5
    cache = SliceKVCache()
    ck, cv = torch.randn(7, HKV, HD, generator=g), torch.randn(7, HKV, HD, generator=g)
    cache.put(0, docs, 0, 7, ck, cv)
    q = torch.randn(T, HQ, HD, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(T, HKV, HD, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(T, HKV, HD, generator=g, dtype=torch.float64).requires_grad_()
    ctx = SliceContext(segs, cache, backend="reference")
    from packloader.runtime import attention as attn_mod

    if split:
        seen, real = [], attn_mod.varlen_attention

        def spy(q_, kk, vv, *a, **kw):
            seen.append((kk, vv))
            return real(q_, kk, vv, *a, **kw)

        monkeypatch.setattr(attn_mod, "varlen_attention", spy)
        out = ctx.attention(q, k, v, layer=0)
        monkeypatch.undo()
        return out, (q, k, v), seen[0]
    else:
        varlen_attention = attn_mod.varlen_attention
        kp, vp = [], []
        for i in range(docs):
            kp.append(k[6 * i:6 * i + 6])
            vp.append(v[6 * i:6 * i + 6])
        kp += [ck.double(), k[6 * docs:]]
        vp += [cv.double(), v[6 * docs:]]
        cu_q = torch.tensor([6 * i for i in range(docs + 1)] + [T], dtype=torch.int32)
        cu_k = torch.tensor([6 * i for i in range(docs + 1)] + [T + 7], dtype=torch.int32)
        kk, vv = torch.cat(kp), torch.cat(vp)
        out = varlen_attention(q, kk, vv, cu_q, cu_k, 6, 12, causal=True, backend="reference")
    return out, (q, k, v), (kk, vv)


@pytest.mark.parametrize("docs", [3, 40])
def test_a_slice_launch_assembles_its_keys_with_one_split(docs, monkeypatch):
    """The key buffer's pieces come from one split of the micro-batch's keys, not from a slice per segment
    (each such slice's backward writes a zero-filled tensor of all T keys: segments x T); the gradients equal
    the per-segment assembly's."""
    out, (q, k, v), (kk, vv) = _launch(docs, True, monkeypatch)
    for buf in (kk, vv):
        names = _key_buffer_inputs(buf)
        assert len(names) == docs + 1  # every document and the slice (the cached keys take no gradient here)
        assert names.count("SplitWithSizesBackward0") == docs + 1 and "SliceBackward0" not in names, names
    ref, (rq, rk, rv), (rkk, _) = _launch(docs, split=False)
    assert _key_buffer_inputs(rkk).count("SliceBackward0") == docs + 1  # the assembly it replaced, for contrast
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad(out, (q, k, v), gy)
    want = torch.autograd.grad(ref, (rq, rk, rv), gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


Q = [128, 144, 256, 512, 1024, 4096, 16384, 128, 144, 512, 2048, 8192, 16384]
P = [1024, 65536, 4096, 16384, 131072, 8192, 65536, 0, 0, 65536, 1024, 131072, 0]


def test_the_fit_recovers_a_known_floor_and_assembly():
    """A table made by hand from known x, y, f and beta (the launch: 33 documents of 16,385 tokens) gives them
    back; the same table without its launch cannot, and its fit is worse."""
    prof = base_profile()
    S, T = 33, 16385
    q, p = np.array(Q, dtype=np.float64), np.array(P, dtype=np.float64)
    sliced = (p > 0).astype(np.float64)
    coef = {"fwd": (0.8 * prof.attn_fwd.a, 4e-8, 2e-5, 5e-10), "bwd": (1.05 * prof.attn_bwd.a, 5e-8, 1e-4, 1.3e-8)}
    times = {}
    for name, poly in (("fwd", prof.attn_fwd), ("bwd", prof.attn_bwd)):
        x, y, f, beta = coef[name]
        whole = poly.a * q * q + poly.b * q + poly.c  # tile 1: a whole document by hand
        times[name] = (whole + x * 2 * q * p + y * p + f * sliced + beta * (T + (S + 1) * q)).tolist()
    t = SliceTimings(q=Q, p=P, fwd=times["fwd"], bwd=times["bwd"], launch_segments=S, launch_tokens=T)
    term = fit_slice_term(prof, t, tile=1)
    for name in ("fwd", "bwd"):
        got, (x, y, f, beta) = getattr(term, name), coef[name]
        assert (got.x, got.y, got.floor, got.assembly) == pytest.approx((x, y, f, beta), rel=1e-6)
        assert got.mape_pct < 1e-6
    assert assembly_times(term, 49, 25600) == pytest.approx((5e-10 * 49 * 25600, 1.3e-8 * 49 * 25600))
    blind = fit_slice_term(prof, SliceTimings(q=Q, p=P, fwd=times["fwd"], bwd=times["bwd"]), tile=1)
    assert blind.bwd.floor == 0.0 and blind.bwd.assembly == 0.0 and blind.bwd.mape_pct > 1.0


def _bench():
    spec = importlib.util.spec_from_file_location("cost_small_end", ROOT / "benchmarks" / "cost_small_end.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_h200_slice_packs_are_priced_within_the_target_by_the_refit():
    """Part 4's four measured slice packs (recorded, H200) against the refit: the assembly fitted on part 3's
    slice table alone brings them from 23.9 % to about 5 %; fitted on the other three packs, each within 3.5 %.
    The whole-document classes keep their recorded errors (no slice, nothing refitted)."""
    b = _bench()
    prof, old, new = b.fits(b.RUN)
    assert new.fwd.floor == 0.0 and new.bwd.floor == 0.0  # no floor left once the assembly is fitted
    assert 12e-9 < new.bwd.assembly < 15e-9 and new.fwd.assembly < 1e-9
    assert new.bwd.mape_pct < 7.0 < old.bwd.mape_pct  # bwd: 22.6 % without the launch, 5.9 % with it
    acc = b.accuracy(b.RUN, prof, new)
    c = acc["classes"]
    assert c["slices"]["recorded"] == pytest.approx(23.9, abs=0.05)
    assert c["slices"]["refit_table_beta"] < 5.6
    assert c["slices"]["refit_held_out_beta"] < 3.0
    for r in acc["slice_packs"]:
        assert abs(r["refit_held_out_ms"] / r["measured_ms"] - 1) < 0.035
        assert abs(r["recorded_ms"] / r["measured_ms"] - 1) > 0.2
    for kind in ("one long", "many short", "mixed"):
        assert c[kind]["refit_table_beta"] == c[kind]["recorded"] < 3.0
    assert max(acc["beta_packs_ns"]) < 1.6 * acc["beta_table_ns"]


def test_the_slice_csv_keeps_its_launch(tmp_path):
    """The timer's table names the launch it timed beside, so a refit from the CSV fits what the CLI fitted; a
    table with two launches is refused, naming the file."""
    from packloader.balancers.cost.slice_fit import read_slice_csv, write_slice_csv

    t = SliceTimings(q=[128, 256], p=[0, 1024], fwd=[1e-4, 2e-4], bwd=[3e-4, 4e-4], launch_segments=33,
                     launch_tokens=16385)
    path = tmp_path / "slices.csv"
    write_slice_csv(t, path)
    back = read_slice_csv(path)
    assert (back.launch_segments, back.launch_tokens) == (33, 16385)
    old = tmp_path / "old.csv"
    old.write_text("q,p,fwd_ms,bwd_ms\n128,0,0.1,0.3\n")
    assert read_slice_csv(old).launch_segments == 0
    assert read_slice_csv(old, launch=(33, 16385)).launch_tokens == 16385
    bad = tmp_path / "bad.csv"
    bad.write_text("q,p,fwd_ms,bwd_ms,launch_segments,launch_tokens\n128,0,0.1,0.3,33,16385\n256,0,0.1,0.3,17,8193\n")
    with pytest.raises(ValueError, match=r"bad\.csv: expected one launch"):
        read_slice_csv(bad)


def _floored(profile, extra_s: float):
    """`profile` with `extra_s` seconds more per micro-batch (forward a third, backward two thirds), on its
    measured linear table: the per-micro-batch floor a calibration can carry."""
    import msgspec

    from packloader.contracts import LinTable

    t = profile.lin_table
    table = LinTable(tokens=list(t.tokens), fwd=[x + extra_s / 3 for x in t.fwd],
                     bwd=[x + 2 * extra_s / 3 for x in t.bwd])
    return msgspec.structs.replace(profile, lin_table=table, name=f"{profile.name}+floor")


def test_auto_takes_no_more_micro_batches_than_its_floor_pays(tmp_path):
    """The H200's calibrated stage profile, and the same with 30 ms more per micro-batch: auto splits a DP 2 / PP 4
    step into fewer micro-batches under the larger floor, and under each profile its plan simulates no slower
    than concat's or fixed's priced by the same profile (the simulator is the judge auto itself uses, the
    baselines are independent planners)."""
    import msgspec

    from packloader.balancers.cost import presets
    from packloader.balancers.cost.measured import measured_profile
    from packloader.balancers.cost.model import CostModel
    from packloader.balancers.cost.profile_io import load_profile, save_profile
    from packloader.balancers.draw import draw_windows
    from packloader.balancers.factory import make_planner
    from packloader.balancers.sim.simulator import simulate_step
    from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

    b = _bench()
    par = ParallelConfig(dp=2, pp=4)
    cal = msgspec.structs.replace(load_profile(b.RUN / "profile-llama2-7b.json"), slice_term=None)
    stage = measured_profile(presets.get_shape("llama2-7b"), par, base=cal)
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(np.log(1500), 1.2, 400), 64, 16384).astype(np.int64)
    window = draw_windows(lengths, 65536, 16384, 1, incomplete=False).windows[0]
    counts = {}
    for label, prof in (("calibrated", stage), ("floored", _floored(stage, 0.030))):
        path = tmp_path / f"{label}.json"
        save_profile(prof, path)
        times = {}
        for strategy in ("auto", "concat", "fixed"):
            cfg = PlanConfig(strategy=strategy, parallel=par, max_tokens=16384, context=16384, tokens_per_step=65536,
                             model=str(path), device="h200")
            plan, _ = make_planner(cfg).plan(window, PlannerState(), 0)
            times[strategy] = simulate_step(plan, CostModel(prof), par).step_time
            if strategy == "auto":
                counts[label] = len(plan.ranks[0].micro_batches)
        assert times["auto"] <= 1.001 * min(times["concat"], times["fixed"]), (label, times)
    assert counts["floored"] < counts["calibrated"], counts
