"""`packloader report`: the CLI on a lengths file and on Parquet/JSONL shards the test writes; every figure
checked against values recomputed here from the written plans and the test's own draw of the lengths (cost
polynomials by hand, no packloader scoring code), the PNGs and the HTML page checked as files."""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
from html.parser import HTMLParser

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packloader.balancers.cost.presets import get_shape
from packloader.cli.main import main
from packloader.contracts import ParallelConfig, decode_step_plan

STRATS = "fixed,wlb,hydraulis,slimpack"


# ----------------------------------------------------------------------------------------------- references


def drawn_docs(lengths, tokens_per_step, steps):
    """(doc -> step) for the complete steps only."""
    out, fill, k = {}, 0, 0
    pending = []
    for i, v in enumerate(lengths):
        pending.append(i)
        fill += int(v)
        if fill >= tokens_per_step:
            out.update({d: k for d in pending})
            pending, fill, k = [], 0, k + 1
            if k == steps:
                break
    return out


def poly(p, x):
    return p[0] * x * x + p[1] * x + p[2]


def lin(profile, part, x):
    """The linear part: the polynomial, or the measured table (floor, interpolated, per token past its end)."""
    t = profile["lin_table"]
    if t is None:
        return poly(profile[part], x)
    times = t.fwd if part == "lin_fwd" else t.bwd
    return float(np.interp(x, t.tokens, times)) if x <= t.tokens[-1] else times[-1] * x / t.tokens[-1]


def mb_cost(profile, mb):
    """forward + backward of a micro-batch on one stage, straight from the CostProfile formula."""
    tile = profile["tile"]
    g = len(mb.dp_group) if mb.dp_group else 1
    f = b = 0.0
    n = 0
    for s in mb.segments:
        q, p = s.end - s.start, s.start - s.attend_from
        qt = math.ceil(q / tile) * tile
        for key, acc in (("attn_fwd", "f"), ("attn_bwd", "b")):
            a, bb, c = profile[key]
            v = a * (qt * qt + 2 * qt * p) + bb * qt + c
            if acc == "f":
                f += v
            else:
                b += v
        n += q
    if g > 1:
        f, b = f / g, b / g
    return f + lin(profile, "lin_fwd", n / g) + b + lin(profile, "lin_bwd", n / g)


def read_plans(path):
    return [decode_step_plan(line) for line in path.read_text().splitlines() if line.strip()]


def profile_dict(model, parallel):
    from packloader.balancers.cost.resolve import load_cost_model

    pr = load_cost_model(model, parallel).profile
    return {"tile": pr.tile, "lin_table": pr.lin_table, **{k: (getattr(pr, k).a, getattr(pr, k).b, getattr(pr, k).c) for k in ("attn_fwd", "attn_bwd", "lin_fwd", "lin_bwd")}}


def longtail(n, seed=0, scale=200, cap=30000):
    rng = np.random.default_rng(seed)
    return np.minimum((rng.pareto(1.2, n) + 1) * scale, cap).astype(np.int64)


def run_cli(args, capsys):
    code = main(["report", *args, "--no-progress"])
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------------------------- lengths file


@pytest.fixture(scope="module")
def lengths_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rep")
    lengths = longtail(3000, seed=1)
    lengths[5] = 0  # an empty document: left out, as the loader does
    np.save(tmp / "lengths.npy", lengths)
    out = tmp / "out"
    args = ["--lengths", str(tmp / "lengths.npy"), "--dp", "2", "--pp", "1", "--tp", "1", "--model", "tiny",
            "--max-tokens", "16384", "--context", "8192", "--tokens-per-step", "65536", "--steps", "4",
            "--strategies", STRATS + ",concat,multipack,karmarkar_karp", "--out", str(out), "--plans"]
    code = main(["report", *args, "--no-progress"])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    return lengths[lengths > 0], rep, out


def test_lengths_report_figures_match_hand_computation(lengths_report):
    lengths, rep, out = lengths_report
    s = rep["settings"]
    assert (s["dp"], s["pp"], s["steps"], s["tokens_per_step"]) == (2, 1, 4, 65536)
    assert rep["notes"] and any("1 empty documents left out" in n for n in rep["notes"])
    draw = drawn_docs(lengths, 65536, 4)
    assert rep["lengths"]["documents"] == len(draw)
    assert rep["lengths"]["tokens"] == int(lengths[: len(draw)].sum())
    profile = profile_dict("tiny", ParallelConfig(dp=2))
    ok = [f for f in rep["strategies"] if f["status"] == "ok"]
    assert {"fixed", "wlb", "hydraulis", "slimpack"} <= {f["name"] for f in ok}
    for fig in ok:
        plans = read_plans(out / "plans" / f"{fig['name']}.jsonl")
        assert fig["steps"] == 4 and len(plans) == 4 + fig["drain_steps"]
        assert [st["drain"] for st in fig["per_step"]] == [False] * 4 + [True] * fig["drain_steps"]
        planned = 0
        ideal = 0.0
        delayed = 0
        delay_sum = 0
        delay_max = 0
        seen = set()
        for plan, st in zip(plans, fig["per_step"]):
            costs = [[mb_cost(profile, mb) for mb in r.micro_batches] for r in plan.ranks]
            imb = [max(c) * len(c) / sum(c) for c in costs]
            assert st["imbalance"] == pytest.approx(max(imb), rel=1e-9), fig["name"]
            # pp = 1: a rank runs its micro-batches back to back, the step ends with the slowest rank
            times = [sum(c) for c in costs]
            assert st["step_time"] == pytest.approx(max(times), rel=1e-9), fig["name"]
            assert st["dp_spread"] == pytest.approx(max(times) / np.mean(times), rel=1e-9)
            assert st["bound_time"] == pytest.approx(sum(times) / 2, rel=1e-9)
            assert st["efficiency"] == pytest.approx(sum(times) / 2 / max(times), rel=1e-9)  # the no-bubble ideal
            ideal += sum(times) / 2
            assert st["micro_batches"] == len(costs[0])
            step_tokens = 0
            for r in plan.ranks:
                for mb in r.micro_batches:
                    key = (plan.step, tuple(mb.dp_group or ()), tuple(mb.segments))
                    if mb.dp_group and len(mb.dp_group) > 1:
                        if key in seen:
                            continue
                        seen.add(key)
                    for sg in mb.segments:
                        k = sg.end - sg.start
                        step_tokens += k
                        d = plan.step - draw[sg.doc]
                        assert d >= 0
                        delay_sum += d * k
                        if d > 0:
                            delayed += k
                            delay_max = max(delay_max, d)
            assert st["tokens"] == step_tokens
            planned += step_tokens
        total = int(lengths[: len(draw)].sum())
        assert planned + fig["tokens_left_queued"] == total, fig["name"]  # every drawn token planned or still queued
        assert fig["tokens_left_queued"] == 0  # outlier delay drained in the extra steps
        drained = sum(sg.end - sg.start for p in plans[4:] for r in p.ranks for mb in r.micro_batches for sg in mb.segments
                      if not (mb.dp_group and len(mb.dp_group) > 1))
        assert fig["tokens_queued_at_end"] == drained or any(mb.dp_group for p in plans[4:] for r in p.ranks for mb in r.micro_batches)
        assert fig["tokens_planned"] == planned and fig["tokens_drawn"] == total
        assert fig["tokens_dropped"] == 0 and fig["tokens_duplicated"] == 0
        assert fig["tokens_delayed"] == delayed and fig["delay_max"] == delay_max
        assert fig["delay_share"] == pytest.approx(delayed / planned)
        assert fig["delay_mean"] == pytest.approx(delay_sum / planned)
        step_total = sum(st["step_time"] for st in fig["per_step"])
        assert fig["step_time_total"] == pytest.approx(step_total)
        assert fig["tokens_per_second"] == pytest.approx(planned / step_total)
        assert fig["efficiency"] == pytest.approx(ideal / step_total)
        assert fig["imbalance_mean"] == pytest.approx(np.mean([st["imbalance"] for st in fig["per_step"][:4]]))
        assert fig["step_time_mean"] == pytest.approx(np.mean([st["step_time"] for st in fig["per_step"][:4]]))
        assert len(fig["peak_activation_gib"]) == 1 and fig["plan_ms_mean"] >= 0


def test_speedups_and_advice_follow_the_figures(lengths_report):
    _, rep, _ = lengths_report
    figs = {f["name"]: f for f in rep["strategies"] if f["status"] == "ok"}
    bases = [n for n, f in figs.items() if f["role"] == "baseline"]
    assert "fixed" in bases
    for f in figs.values():
        for b in bases:
            assert f["speedup"][b] == pytest.approx(f["tokens_per_second"] / figs[b]["tokens_per_second"])
    adv = rep["advice"]
    limit = 80 * 0.92 - 2  # GiB: the H100 memory model's usable share less its reserve
    grid = adv["cap_grid"]
    assert {c["strategy"] for c in grid} == {n for n, f in figs.items() if f["role"] == "packloader"}
    assert {c["max_tokens"] for c in grid} >= {8192, 16384, 32768}  # half, same and twice the cap
    for c in grid:
        if c["tokens_per_second"] > 0:
            assert c["fits_memory"] == (c["peak_memory_gib"] <= limit)
    fitting = sorted((c for c in grid if c["fits_memory"] and c["tokens_per_second"] > 0), key=lambda c: -c["tokens_per_second"])
    conf = adv["confirmed"]  # the grid's best, re-planned over all 4 steps in order until one fits
    assert conf and [(c["strategy"], c["max_tokens"], c["num_micro_batches"]) for c in conf] == \
        [(c["strategy"], c["max_tokens"], c["num_micro_batches"]) for c in fitting[: len(conf)]]
    assert all(not c["fits_memory"] for c in conf[:-1]) and conf[-1]["fits_memory"] and conf[-1]["steps"] == 4
    pick = conf[-1]
    assert (adv["strategy"], adv["max_tokens"]) == (pick["strategy"], pick["max_tokens"])
    assert adv["num_micro_batches"] == (pick["num_micro_batches"] or round(pick["micro_batches_mean"]))
    fastest_base = max((figs[b] for b in bases), key=lambda f: f["tokens_per_second"])
    assert adv["baseline"] == fastest_base["name"] == rep["reference_baseline"]
    assert adv["baseline_tokens_per_second"] == pytest.approx(fastest_base["tokens_per_second"])
    assert adv["speedup_vs_baseline"] == pytest.approx(pick["tokens_per_second"] / fastest_base["tokens_per_second"])
    if pick["max_tokens"] == 16384 and pick["num_micro_batches"] == 0:  # the user's settings: the main run's figures
        assert pick["tokens_per_second"] == pytest.approx(figs[pick["strategy"]]["tokens_per_second"])
    # dp = 2: the only heterogeneous shape merges both ranks; it is reported next to the homogeneous hydraulis run
    cands = adv["grouping_candidates"]
    assert [c["groups"][0]["gpus_per_group"] for c in cands] == [2]
    c = cands[0]
    assert c["groups"][0]["max_tokens"] == 2 * 16384 and c["groups"][0]["cp"] == 2
    if c["step_time_total"] > 0:
        assert c["gain_vs_homogeneous"] == pytest.approx(figs["hydraulis"]["step_time_total"] / c["step_time_total"])


def test_peak_activation_memory_pp1_is_largest_micro_batch(lengths_report):
    """pp = 1: one micro-batch in flight, so the activation peak is the largest micro-batch's tokens times the
    per-token bytes (activations kept for backward + the logits while it runs)."""
    lengths, rep, out = lengths_report
    shape = get_shape("tiny")
    h, kv, ffn, layers = shape.hidden, shape.kv_dim, shape.ffn, shape.layers
    act = (2 * h + 2 * h + 2 * (h + 2 * kv) + 2 * h + 4 * h + (2 * ffn * 2 + 2 * ffn) - 2 * ffn) * layers  # selective
    logits = shape.vocab * 6
    for fig in rep["strategies"]:
        if fig["status"] != "ok":
            continue
        plans = read_plans(out / "plans" / f"{fig['name']}.jsonl")
        biggest = max(mb.num_tokens / (len(mb.dp_group) if mb.dp_group else 1)
                      for p in plans for r in p.ranks for mb in r.micro_batches)
        if any(r.backward_order for p in plans for r in p.ranks):
            continue  # slices keep key/value gradients too: not this simple formula
        assert fig["peak_activation_gib"][0] * 1024**3 == pytest.approx(biggest * (act + logits), rel=1e-6), fig["name"]


def test_pngs_and_html_are_valid(lengths_report):
    import matplotlib.image as mpimg

    _, rep, out = lengths_report
    pngs = {k: v for k, v in rep["files"].items() if v.endswith(".png")}
    assert set(pngs) == {"lengths", "summary", "costs", "timeline"}
    for path in pngs.values():
        data = open(path, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 400_000
        img = mpimg.imread(path)
        assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.imgs, self.tags, self.text = [], [], []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            if tag == "img":
                self.imgs.append(dict(attrs)["src"])

        def handle_data(self, data):
            self.text.append(data)

    page = Page()
    page.feed(open(rep["files"]["html"], encoding="utf-8").read())
    page.close()
    assert page.tags.count("table") >= 2 and "details" in page.tags and "html" in page.tags  # figures, advice grid
    embedded = [base64.b64decode(src.split(",", 1)[1]) for src in page.imgs if src.startswith("data:image/png;base64,")]
    assert len(embedded) == len(page.imgs) == 4  # self-contained: no external image
    assert sorted(embedded) == sorted(open(p, "rb").read() for p in pngs.values())
    text = " ".join(page.text)
    assert "imbalance degree" in text and "hydraulis" in text and rep["advice"]["strategy"] in text


# ----------------------------------------------------------------------------------------------- shards


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    return [f"doc {seed}.{i} " + "x" * int(min(rng.pareto(1.0) * 300 + 20, 20000)) for i in range(n)]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_report_on_text_shards(tmp_path, capsys, fmt):
    a, b = _texts(300, 0), _texts(200, 1)
    paths = []
    for name, texts in (("a", a), ("b", b)):
        if fmt == "parquet":
            p = tmp_path / f"{name}.parquet"
            pq.write_table(pa.table({"text": texts}), p)
        else:
            p = tmp_path / f"{name}.jsonl"
            p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        paths.append(str(p))
    out = tmp_path / "out"
    code, stdout, err = run_cli([*paths, "--tokenizer", "bytes", "--no-shuffle", "--dp", "2", "--pp", "2", "--model", "tiny",
                                 "--max-tokens", "8192", "--context", "4096", "--tokens-per-step", "32768", "--steps", "3",
                                 "--strategies", STRATS, "--out", str(out), "--no-advice", "--no-plots"], capsys)
    assert code == 0, err
    rep = json.loads((out / "report.json").read_text())
    lengths = np.array([len(t.encode()) + 1 for t in a + b])  # bytes + EOS, in file order
    draw = drawn_docs(lengths, 32768, 3)
    assert rep["lengths"]["documents"] == len(draw)
    assert rep["lengths"]["tokens"] == int(lengths[: len(draw)].sum())
    assert rep["lengths"]["documents_cut"] == int((lengths[: len(draw)] > 4096).sum())
    assert rep["settings"]["tokenizer"] == "bytes" and rep["settings"]["pp"] == 2
    for f in rep["strategies"]:
        assert f["status"] == "ok", f
        assert f["tokens_planned"] + f["tokens_left_queued"] == int(lengths[: len(draw)].sum())
        assert len(f["peak_activation_gib"]) == 2 and f["bubble_share_mean"] > 0  # pp = 2 fills and drains
    assert "imbalance degree" in stdout and "fixed" in stdout
    assert not (out / "report.html").exists()


def test_report_on_pretokenized_parquet_uses_length_column(tmp_path, capsys):
    rng = np.random.default_rng(3)
    toks = [rng.integers(0, 1000, int(n), dtype=np.int32) for n in longtail(400, seed=3, scale=100, cap=6000)]
    table = pa.table({"tokens": pa.array(toks, type=pa.list_(pa.int32())), "length": pa.array([len(t) for t in toks], pa.int32())})
    pq.write_table(table, tmp_path / "tok.parquet")
    out = tmp_path / "out"
    code, stdout, err = run_cli([str(tmp_path / "tok.parquet"), "--no-shuffle", "--dp", "2", "--model", "tiny", "--max-tokens", "8192",
                                 "--tokens-per-step", "16384", "--steps", "2", "--strategies", "fixed,hydraulis",
                                 "--out", str(out), "--no-advice", "--no-plots"], capsys)
    assert code == 0, err
    rep = json.loads((out / "report.json").read_text())
    lengths = np.array([len(t) for t in toks])  # no EOS metadata: lengths as stored
    draw = drawn_docs(lengths, 16384, 2)
    assert rep["lengths"]["tokens"] == int(lengths[: len(draw)].sum())
    assert "pre-tokenized" in rep["settings"]["input"]


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "setup, args, expect",
    [
        (None, ["--lengths", "{tmp}/nope.npy"], "nope.npy"),
        ("bad_text", ["--lengths", "{tmp}/bad.txt"], "line 3"),
        ("neg_npy", ["--lengths", "{tmp}/neg.npy"], "entry 1 is -5"),
        (None, [], "exactly one of"),
        ("ok_npy", ["--lengths", "{tmp}/ok.npy", "--tokens-per-step", "100000000"], "fewer than one step"),
        ("ok_npy", ["--lengths", "{tmp}/ok.npy", "--model", "gpt-17"], "unknown model preset"),
        ("ok_npy", ["--lengths", "{tmp}/ok.npy", "--dp", "0"], "argument --dp: must be >= 1"),
        ("ok_npy", ["--lengths", "{tmp}/ok.npy", "--max-tokens", "10**21"], "argument --max-tokens"),
        ("ok_npy", ["--lengths", "{tmp}/ok.npy", "--steps", "0"], "argument --steps"),
        ("huge_npy", ["--lengths", "{tmp}/huge.npy"], "at most 65,536 pieces per document"),
        ("ok_npy", ["--lengths", "{tmp}/ok.npy", "--global-batch", "4", "--tokens-per-step", "9"], "not both"),
        ("parquet_nolen", ["--lengths", "{tmp}/x.parquet"], "no column 'length'"),
        ("ok_npy", ["--lengths", "{tmp}/ok.npy", "--strategies", "nosuch"], "no strategy could plan"),
        (None, ["{tmp}/missing.jsonl"], "missing.jsonl"),
    ],
)
def test_bad_input_gives_a_clear_error(tmp_path, capsys, setup, args, expect):
    if setup == "bad_text":
        (tmp_path / "bad.txt").write_text("12\n40\nforty-two\n")
    elif setup == "neg_npy":
        np.save(tmp_path / "neg.npy", np.array([3, -5, 7]))
    elif setup == "ok_npy":
        np.save(tmp_path / "ok.npy", longtail(2000))
    elif setup == "huge_npy":
        np.save(tmp_path / "huge.npy", np.array([3, 10**12, 7]))
    elif setup == "parquet_nolen":
        pq.write_table(pa.table({"n": [1, 2]}), tmp_path / "x.parquet")
    code, out, err = run_cli([a.format(tmp=tmp_path) for a in args] + ["--out", str(tmp_path / "o"), "--no-advice", "--no-plots"], capsys)
    assert code == 2, err  # bad input, and argparse's status for a bad option value
    assert expect in err, err
    assert "Traceback" not in err


def test_failing_strategy_is_skipped_with_a_note(tmp_path, capsys):
    from packloader.balancers.planners import registry

    class Broken:
        def __init__(self, config):
            self.config = config

        def plan(self, window, state, step):
            raise RuntimeError("this planner always fails")

    registry.register_planner("broken_for_test")(lambda config, options, model: Broken(config))
    try:
        np.save(tmp_path / "l.npy", longtail(2000))
        code, out, err = run_cli(["--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--model", "tiny", "--max-tokens", "8192",
                                  "--context", "8192", "--steps", "2", "--strategies", "fixed,broken_for_test,not_a_strategy",
                                  "--out", str(tmp_path / "o"), "--no-advice", "--no-plots"], capsys)
    finally:
        registry._REGISTRY.pop("broken_for_test")
    assert code == 0, err
    assert "skipped broken_for_test: RuntimeError: this planner always fails" in out
    assert "skipped not_a_strategy: ValueError: unknown planner strategy" in out
    assert "warning: --strategies: no planner is named 'not_a_strategy'" in err  # said at once, before the run
    assert "named 'broken_for_test'" not in err and "named 'fixed'" not in err  # registered names: no warning
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert [f["status"] for f in rep["strategies"]] == ["ok", "skipped", "skipped"]


@pytest.mark.multiprocess
def test_demo_runs_in_a_subprocess(tmp_path):
    """The README's main job, cut short (one step, no advice): the stdlib corpus, tokenized, no download."""
    res = subprocess.run(
        [sys.executable, "-m", "packloader.cli.main", "report", "--demo", "--steps", "1", "--no-advice", "--no-plots",
         "--strategies", "fixed,hydraulis", "--out", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "Python standard library" in res.stdout and "tokenized with tekken" in res.stdout
    assert "tokenize" in res.stderr  # the progress bar
    rep = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert rep["settings"]["gpus"] == 16 and rep["lengths"]["tokens"] >= 4 * 4 * 32768
    assert any("skipped" in n for n in rep["notes"])  # empty and non-UTF-8 stdlib files are skipped and counted


def test_report_with_a_calibration_profile(tmp_path, capsys):
    """--model takes a profile JSON (as `packloader calibrate` writes it): times follow it, memory is unknown."""
    from packloader.balancers.cost.profile_io import save_profile
    from packloader.balancers.cost.resolve import load_cost_model

    save_profile(load_cost_model("tiny", ParallelConfig(dp=2)).scaled(3.0).profile, tmp_path / "prof.json")
    np.save(tmp_path / "l.npy", longtail(2000, seed=4))
    common = ["--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--tp", "1", "--max-tokens", "8192", "--steps", "2",
              "--strategies", "fixed", "--no-advice", "--no-plots"]
    code, out, err = run_cli(common + ["--model", str(tmp_path / "prof.json"), "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    code, _, err = run_cli(common + ["--model", "tiny", "--out", str(tmp_path / "b")], capsys)
    assert code == 0, err
    a = json.loads((tmp_path / "a" / "report.json").read_text())
    b = json.loads((tmp_path / "b" / "report.json").read_text())
    fa, fb = a["strategies"][0], b["strategies"][0]
    assert fa["step_time_total"] == pytest.approx(3.0 * fb["step_time_total"], rel=1e-9)  # same plans, 3x slower device
    assert fa["peak_memory_gib"] == [] and any("peak memory is not reported" in n for n in a["notes"])
    assert a["settings"]["cost_profile"].endswith("x3")


def test_report_json_decodes_as_the_report_struct(lengths_report):
    import msgspec

    from packloader.report.figures import Report

    _, rep, out = lengths_report
    typed = msgspec.json.decode((out / "report.json").read_bytes(), type=Report)
    assert typed.settings.dp == 2 and len(typed.strategies) == len(rep["strategies"])
    assert typed.advice is not None and typed.advice.strategy == rep["advice"]["strategy"]


def test_report_notes_the_candidates_auto_drops_for_memory(tmp_path, capsys):
    """Llama-3-8B at TP 1 with 32K micro-batches: slicing candidates peak over the 80 GiB H100's limit, and the
    report's notes name them with their peaks, above 80 x 0.92 - 2 = 71.6 GiB (worked by hand)."""
    import re

    rng = np.random.default_rng(0)
    np.save(tmp_path / "l.npy", np.minimum(32768, (rng.pareto(1.2, 1500) * 800 + 50).astype(np.int64)))
    code, out, err = run_cli(["--lengths", str(tmp_path / "l.npy"), "--dp", "4", "--pp", "2", "--max-tokens", "32768",
                              "--steps", "2", "--strategies", "auto", "--out", str(tmp_path / "o"), "--no-advice",
                              "--no-plots"], capsys)
    assert code == 0, err
    assert "auto dropped" in out and "against 71.6 GiB usable of the 80 GiB H100" in out, out
    peaks = [float(x) for x in re.findall(r"\(peak ([0-9.]+) GiB", out)]
    assert peaks and min(peaks) > 71.6
