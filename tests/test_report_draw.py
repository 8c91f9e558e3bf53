"""The report's library pieces on their own: drawing complete steps, reading lengths files, the merged
cost model of a heterogeneous group."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packloader.balancers.cost.resolve import load_cost_model
from packloader.balancers.draw import draw_windows, step_ends
from packloader.contracts import MicroBatch, ParallelConfig, Segment
from packloader.report.advice import merged_model
from packloader.report.draw import StepCounter, draw_steps
from packloader.report.lengths import LengthsError, read_lengths

lengths_st = st.lists(st.integers(1, 5000), min_size=1, max_size=200)


def reference_steps(lengths, target, context, steps=None, incomplete=False):
    """Brute force: every piece (doc, offset, length) in stream order, steps taking pieces until they reach
    the target (the crossing piece included)."""
    out, cur, fill = [], [], 0
    for d, n in enumerate(lengths):
        for off in range(0, n, context):
            cur.append((d, off, min(context, n - off)))
            fill += cur[-1][2]
            if fill >= target:
                out.append(cur)
                cur, fill = [], 0
                if steps is not None and len(out) == steps:
                    return out
    if cur and incomplete:
        out.append(cur)
    return out


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 20000), st.integers(1, 3000), st.integers(1, 6))
def test_step_ends_and_counter_agree_with_a_plain_loop(lengths, target, context, steps):
    ref = reference_steps(lengths, target, context, steps)
    ends = step_ends(np.array(lengths), target, context, steps=steps)
    cursors = []
    for step in ref:
        d, off, n = step[-1]
        cursors.append((d + 1, 0) if off + n == lengths[d] else (d, off + n))
    assert [tuple(e) for e in ends.tolist()] == cursors
    counter = StepCounter(target, steps, context)
    done = any(counter(np.array(lengths[i:i + 7])) for i in range(0, len(lengths), 7))
    assert done == (len(ref) == steps)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=120), st.integers(1, 5000), st.integers(1, 700), st.integers(1, 9))
def test_step_counter_counts_like_a_plain_loop_across_batches(lengths, target, context, batch):
    ref = reference_steps([v for v in lengths if v], target, context)  # empty documents never end a step
    counter = StepCounter(target, 10**9, context)
    for i in range(0, len(lengths), batch):
        counter(np.array(lengths[i:i + batch], np.int64))
    assert counter.done == len(ref)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9000), max_size=60), st.integers(1, 3000), st.integers(1, 700))
def test_a_step_holds_tokens_per_step_within_one_piece(lengths, target, context):
    """draw_windows against the brute force: the same pieces per step; each step but the last holds from
    tokens_per_step to tokens_per_step + context - 1 tokens; the cursor and draw steps match."""
    d = draw_windows(np.array(lengths, np.int64), target, context)
    nonempty = [i for i, v in enumerate(lengths) if v]
    ref = reference_steps([lengths[i] for i in nonempty], target, context, incomplete=True)
    got = [list(zip(w.doc.tolist(), w.offset.tolist(), w.length.tolist())) for w in d.windows]
    assert got == [[(nonempty[p], o, n) for p, o, n in step] for step in ref]
    sizes = [sum(n for _, _, n in step) for step in ref]
    assert all(target <= s < target + context for s in sizes[:-1])
    first = {}
    for s, step in enumerate(got):
        for doc, _, _ in step:
            first.setdefault(doc, s)
    assert {i: int(s) for i, s in enumerate(d.first_step.tolist()) if s >= 0} == first


def test_a_giant_document_spreads_over_steps_in_order():
    """Hand-worked: tokens_per_step 10, context 4; a 30-token document after a 3-token one."""
    d = draw_windows(np.array([3, 30, 5]), 10, 4)
    # pieces: 0:[0,3) 1:[0,4) [4,8) ... [28,30) 2:[0,4) [4,5); steps close at 11, 12, 10 tokens, the last holds 5
    assert [w.doc.tolist() for w in d.windows] == [[0, 1, 1], [1, 1, 1], [1, 1, 1], [2, 2]]
    assert [w.offset.tolist() for w in d.windows] == [[0, 0, 4], [8, 12, 16], [20, 24, 28], [0, 4]]
    assert [w.length.tolist() for w in d.windows] == [[3, 4, 4], [4, 4, 4], [4, 4, 2], [4, 1]]
    assert d.ends.tolist() == [[1, 8], [1, 20], [2, 0], [3, 0]]
    assert d.first_step.tolist() == [0, 0, 3]


def test_draw_steps_windows_and_draw_steps():
    lengths = np.array([5, 3, 9, 1, 1, 1, 20, 2, 4])
    d = draw_steps(lengths, tokens_per_step=8, context=6, steps=4)
    # pieces of 6: steps [5, 3] -> 8; [6, 3] -> 9; [1, 1, 1, 6] -> 9; [6, 6] of the 20-token document -> 12 (its
    # last 2 tokens go to step 4, which is not drawn); the two documents after it are left over
    assert d.steps == 4 and d.leftover_documents == 2
    assert d.doc_step.tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert d.windows[1].length.tolist() == [6, 3] and d.windows[1].offset.tolist() == [0, 6]
    assert d.windows[2].doc.tolist() == [3, 4, 5, 6] and d.windows[2].length.tolist() == [1, 1, 1, 6]
    assert d.windows[3].doc.tolist() == [6, 6] and d.windows[3].offset.tolist() == [6, 12]
    assert d.tokens == 40 and d.docs_cut == 2
    with pytest.raises(ValueError, match="fewer than one step"):
        draw_steps(lengths, tokens_per_step=1000, context=6, steps=1)


def test_read_lengths_formats(tmp_path):
    np.save(tmp_path / "a.npy", np.array([3.0, 0.0, 7.0]))
    r = read_lengths(tmp_path / "a.npy")
    assert r.lengths.tolist() == [3, 7] and r.empty == 1
    (tmp_path / "b.txt").write_text("# lengths\n12\n\n40  # a comment\n0\n")
    r = read_lengths(tmp_path / "b.txt")
    assert r.lengths.tolist() == [12, 40] and r.empty == 1
    pq.write_table(pa.table({"length": pa.array([4, 5], pa.int32())}), tmp_path / "c.parquet")
    assert read_lengths(tmp_path / "c.parquet").lengths.tolist() == [4, 5]
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4]], pa.list_(pa.int32()))}), tmp_path / "d.parquet")
    assert read_lengths(tmp_path / "d.parquet").lengths.tolist() == [3, 1]
    pq.write_table(pa.table({"n": pa.array([9, 8])}), tmp_path / "e.parquet")
    assert read_lengths(tmp_path / "e.parquet", column="n").lengths.tolist() == [9, 8]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("f.npy", np.array([1.5, 2.0]), "entry 0 is 1.5"),
        ("g.npy", np.array([[1, 2]]), "1-D"),
        ("h.npy", np.array(["a"]), "integer lengths"),
        ("i.txt", "1\n2\n-3\n", "line 3: -3 is negative"),
        ("j.txt", b"\xff\xfe\n", "line 1: not UTF-8"),
        ("k.txt", "# nothing\n0\n", "no non-empty"),
        ("l.parquet", pa.table({"length": pa.array([1, None])}), "row 1 is null"),
        ("m.parquet", pa.table({"length": pa.array(["x"])}), "expected integer lengths"),
    ],
)
def test_read_lengths_errors_name_the_place(tmp_path, name, content, message):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, content)
    elif name.endswith(".parquet"):
        pq.write_table(content, path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(LengthsError) as e:
        read_lengths(path)
    assert message in str(e.value) and name in str(e.value)
    with pytest.raises(FileNotFoundError, match="nope.npy"):
        read_lengths(tmp_path / "nope.npy")


def test_merged_model_is_a_g_way_split_with_the_floor_kept():
    base = load_cost_model("llama3-8b", ParallelConfig(tp=2), cost="analytic")  # the polynomial form, by hand below
    pr = base.profile
    for g in (2, 4):
        m = merged_model(base, g)
        mb = MicroBatch(segments=[Segment(0, 0, 3000, 0), Segment(1, 0, 700, 0)])
        f, b = m.microbatch_times(mb)
        tile = pr.tile
        qts = [math.ceil(q / tile) * tile for q in (3000, 700)]
        attn_f = sum(pr.attn_fwd.a * qt**2 + pr.attn_fwd.b * qt for qt in qts)
        attn_b = sum(pr.attn_bwd.a * qt**2 + pr.attn_bwd.b * qt for qt in qts)
        assert pr.attn_fwd.c == pr.attn_bwd.c == 0.0
        assert f == pytest.approx(attn_f / g + pr.lin_fwd.b * 3700 / g + pr.lin_fwd.c, rel=1e-12)
        assert b == pytest.approx(attn_b / g + pr.lin_bwd.b * 3700 / g + pr.lin_bwd.c, rel=1e-12)
        # the analytic preset at cp x g gives the same polynomials (ideal sharding, floors not divided)
        # plus, at fixed CP, its group's K/V all-gather (llama3-8b: 32 layers, 2 x 1024 x 2 bytes a token / TP 2;
        # h100's 360 GB/s and 8 us a ring step inside a node), which merged_model leaves to `with_group_traffic`
        ag = (g - 1) / g * 3700 * 2048 * 32 / 360e9 + (g - 1) * 32 * 8e-6
        cp = load_cost_model("llama3-8b", ParallelConfig(tp=2, cp=g), cost="analytic")
        assert cp.microbatch_times(mb) == pytest.approx((f + ag, b + ag), rel=1e-9)
        # so does the measured profile (its per-document attention term and linear floor kept per CP rank)
        measured = load_cost_model("llama3-8b", ParallelConfig(tp=2))
        measured_cp = load_cost_model("llama3-8b", ParallelConfig(tp=2, cp=g))
        mf, mb_ = merged_model(measured, g).microbatch_times(mb)
        assert measured_cp.microbatch_times(mb) == pytest.approx((mf + ag, mb_ + ag), rel=1e-9)


def test_merged_model_runs_the_linear_part_on_n_over_g_tokens():
    """A quadratic linear term (lin a != 0): each of g GPUs runs lin(n / g) = a n^2 / g^2 + b n / g + c, by hand."""
    from packloader.balancers.cost.model import CostModel
    from packloader.contracts import CostProfile, Poly

    pr = CostProfile(name="hand", tile=1, attn_fwd=Poly(2e-9, 3e-7, 1e-5), attn_bwd=Poly(4e-9, 6e-7, 2e-5),
                     lin_fwd=Poly(1e-10, 5e-6, 3e-4), lin_bwd=Poly(2e-10, 1e-5, 6e-4))
    mb = MicroBatch(segments=[Segment(0, 0, 1000, 0), Segment(1, 0, 600, 0)])
    for g in (2, 4):
        f, b = merged_model(CostModel(pr), g).microbatch_times(mb)
        n = 1600 / g
        assert f == pytest.approx(sum(2e-9 * q * q / g + 3e-7 * q / g + 1e-5 for q in (1000, 600))
                                  + 1e-10 * n * n + 5e-6 * n + 3e-4, rel=1e-12)
        assert b == pytest.approx(sum(4e-9 * q * q / g + 6e-7 * q / g + 2e-5 for q in (1000, 600))
                                  + 2e-10 * n * n + 1e-5 * n + 6e-4, rel=1e-12)


def test_read_lengths_can_reject_empty_documents(tmp_path):
    (tmp_path / "z.txt").write_text("5\n0\n7\n")
    assert read_lengths(tmp_path / "z.txt").lengths.tolist() == [5, 7]
    with pytest.raises(LengthsError, match="entry 1 is 0"):
        read_lengths(tmp_path / "z.txt", empty="error")


def test_plots_survive_degenerate_inputs(tmp_path):
    """One length for every document, one strategy: the plots still come out as PNGs."""
    from packloader.report import plots

    p = plots.plot_lengths(str(tmp_path / "l.png"), np.full(10, 512), np.ones(10), 512, "all alike")
    q = plots.plot_costs(str(tmp_path / "c.png"), {"fixed": np.array([0.5, 0.5])}, {"fixed": "baseline"}, "one")
    assert plots.is_png(p) and plots.is_png(q)
