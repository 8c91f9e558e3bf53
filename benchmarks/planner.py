"""Planner quality and speed on long-tail length distributions: every strategy against the `fixed` baseline.

    .venv/bin/python benchmarks/planner.py --write docs/benchmarks.md
    .venv/bin/python benchmarks/planner.py --quick            # smoke run: small sizes, synthetic data only

Length distributions (documents drawn in a fixed seeded order; a document longer than the context is cut into
independent context-window pieces, as the loader does):

* ``synthetic-cc``: a lognormal body (median 1K tokens, sigma 1.6) with a 1 % Pareto tail (16K x (1 + Pareto(1.2)),
  documents up to 256K): SlimPack's description of Common Crawl (about 80 % of samples under 4K tokens, the
  longest 1 % carrying about half of the workload) and WLB-LLM's "mostly short, some as long as the context
  window". The table in the report gives the statistics measured on the generated lengths.
* ``synthetic-github``: right-shifted as SlimPack's GitHub corpus: lognormal median 2.5K, sigma 1.3, 2 % Pareto
  tail (16K x (1 + Pareto(1.5))).
* ``synthetic-longtail``: issue 25's target data: lognormal median 1.5K, sigma 1.6, a 3 % Pareto tail (32K x
  (1 + Pareto(1.1)), documents up to 1M tokens, well past the 64K context) and 1 % empty documents (skipped
  when drawn, as the loader does).
* ``stdlib``: the token lengths (default tokenizer, EOS appended) of the Python standard library's .py files
  (`packloader.sources.directory.stdlib_corpus`), repeated in fresh shuffled epochs.
* ``docs``: the token lengths of this machine's documentation: UTF-8 text files under /usr/share/doc (gzip ones
  decompressed) and the English man pages under /usr/share/man/man*, if present, texts up to 1 MB; shuffled
  epochs.

Cost model (`--cost`): `measured` (default) is the H100 profile fitted to timings measured on one H100
(`packloader/balancers/cost/measured.py`) scaled to `--model` at TP `--tp`; `analytic` the FLOP-rate model of
`packloader/balancers/cost/presets.py`. Every strategy plans and is scored under `--cost`; it is also planned and
scored under the other model (the sensitivity columns), and its plans under the other model are scored under
`--cost` ("wrong profile": what planning with the wrong cost model costs, as tokens per second lost against
planning with the right one). `--no-cross` skips the second planning.

Configurations (1F1B schedule):

* ``dp8-pp4``: DP 8, PP 4, 64K-token cap and context, 4M tokens per step (the `packloader plan` example);
* ``dp8-pp1``: the same at PP 1, for the "slowest rank within 0.5 % of the mean" target;
* ``dp1024``: DP 1024, PP 1, 64K cap and context, 3.2M tokens per step (Hydraulis' scale), for planning time;
* ``dp1024-8x64k``: the same with 8 x 64K tokens per rank (537M per step, 2 steps), issue 25's planning-time
  target; run only when named in --setups (each step plans about 130K pieces).

Each strategy plans `--steps` consecutive steps from a fresh PlannerState (one untimed warm-up plan first, so
numba compilation is not counted); plans are checked with `verify.verify_plan` (coverage of every drawn token,
cap, equal micro-batch counts) and scored with `metrics.score_plans`. A strategy that raises is reported as
skipped with its error. Figures per strategy: imbalance degree (WLB-LLM, worst rank per step, mean over
steps), DP spread (slowest rank / mean rank, simulated), simulated efficiency (the no-bubble ideal, the work
spread over every GPU with none idle, / simulated step time, summed over the run; the fill-credited figure
beside it), simulated tokens per second over `fixed`'s, delay in steps (mean over all tokens and max: `metrics.token_delay`, the report's definition), share of tokens in slices, and planning time per step (mean, median and max, wall clock;
after the warm-up the process heap is frozen with `gc.freeze()`, so a full garbage collection of the modules
imported so far, torch's included, is not counted as planning: it took 120-180 ms on the benchmark machine, and
it is a pause of the whole process, not of the planner; trainers that mind such pauses control collection
themselves, e.g. Megatron-LM's --manual-gc).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import gzip
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from sections import write_section  # benchmarks/, the script's own folder

from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.draw import cut_pieces
from packloader.balancers.factory import make_planner
from packloader.balancers.planners.registry import Window, planner_spec, report_strategies
from packloader.balancers.sim.metrics import drawn_steps, score_plans
from packloader.balancers.sim.verify import verify_plan
from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

REFERENCE = "fixed"  # the baseline every strategy's simulated tokens per second is measured over
SECTION = "planner"
TARGETS = {
    "imbalance": 1.05,  # auto, WLB-LLM's figure
    "delay_mean": 0.5,  # steps
    "efficiency": 0.92,  # dp8-pp4 with slicing, against the no-bubble ideal (issue 25; fill-credited in issue 12)
    "dp_spread": 1.001,  # PP 1: slowest rank within 0.1 % of the mean (issue 12; 0.5 % in issue 3)
    "plan_ms_dp8": 10.0,
    "plan_ms_dp1024": 100.0,
}


def default_strategies() -> list[str]:
    """The registry's strategies the report shows: `REFERENCE` first, then packloader's planners, then the other
    tools' baselines (each group in the report's order), so a planner registered anywhere is benchmarked too."""
    names = report_strategies()
    role = {n: planner_spec(n).role for n in names}
    ours = [n for n in names if role[n] == "packloader"]
    return [REFERENCE, *ours, *(n for n in names if role[n] == "baseline" and n != REFERENCE)]


@dataclass(frozen=True)
class Setup:
    name: str
    dp: int
    pp: int
    cap: int
    tokens_per_step: int
    steps: int


def setups(quick: bool, steps: int) -> list[Setup]:
    if quick:
        return [Setup("dp8-pp4", 8, 4, 65536, 1 << 20, 2), Setup("dp8-pp1", 8, 1, 65536, 1 << 20, 2),
                Setup("dp64", 64, 1, 65536, 400_000, 1)]
    return [Setup("dp8-pp4", 8, 4, 65536, 4 << 20, steps), Setup("dp8-pp1", 8, 1, 65536, 4 << 20, steps),
            Setup("dp1024", 1024, 1, 65536, 3_200_000, max(2, steps // 4)),
            # issue 25's planning-time scale, 8 x 64K tokens per rank (537M per step): only with --setups
            Setup("dp1024-8x64k", 1024, 1, 65536, 1024 * 8 * 65536, 2)]


# ----------------------------------------------------------------------------------------------- lengths


def synthetic(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale, top, empty = 16384, 262144, 0.0
    if kind == "synthetic-cc":
        median, sigma, tail, alpha = 1000, 1.6, 0.01, 1.2
    elif kind == "synthetic-github":
        median, sigma, tail, alpha = 2500, 1.3, 0.02, 1.5
    elif kind == "synthetic-longtail":
        median, sigma, tail, alpha = 1500, 1.6, 0.03, 1.1
        scale, top, empty = 32768, 1 << 20, 0.01
    else:
        raise ValueError(f"unknown synthetic distribution {kind!r}")
    body = rng.lognormal(np.log(median), sigma, n)
    long = scale * (1 + rng.pareto(alpha, n))
    x = np.clip(np.rint(np.where(rng.random(n) < tail, long, body)), 16, top).astype(np.int64)
    if empty:
        x[rng.random(n) < empty] = 0
    return x


def _tokenize_lengths(texts: list[str]) -> np.ndarray:
    from packloader.sources.tokenizers import get_tokenizer

    tok = get_tokenizer()
    out = []
    for i in range(0, len(texts), 256):
        out.extend(len(t) + 1 for t in tok.encode_batch(texts[i:i + 256]))  # + EOS
    return np.asarray(out, dtype=np.int64)


def _cached(name: str, cache: Path, build) -> np.ndarray:
    path = cache / f"{name}-lengths.npy"
    if path.exists():
        return np.load(path)
    lengths = build()
    cache.mkdir(parents=True, exist_ok=True)
    np.save(path, lengths)
    return lengths


def stdlib_lengths(cache: Path) -> np.ndarray:
    def build():
        from packloader.sources.directory import stdlib_corpus

        src = stdlib_corpus()
        texts = [t for s, info in enumerate(src.shards) for t in src.read(s, np.arange(info.num_rows))]
        return _tokenize_lengths(texts)

    return _cached(f"stdlib-py{sys.version_info.major}{sys.version_info.minor}", cache, build)


def doc_texts(max_bytes: int = 1 << 20) -> list[str]:
    """UTF-8 texts of /usr/share/doc (gzip decompressed) and English man pages; binaries, non-UTF-8 files and
    texts over `max_bytes` after decompression (a few huge changelogs, which would otherwise fill whole steps
    with 64K pieces of one file) skipped."""
    roots = [Path("/usr/share/doc")] + sorted(Path("/usr/share/man").glob("man*"))
    texts = []
    for root in roots:
        if not root.is_dir():
            continue
        for p in sorted(root.rglob("*")):
            try:
                if not p.is_file() or p.is_symlink() or p.stat().st_size > max_bytes:
                    continue
                data = p.read_bytes()
                if p.suffix == ".gz":
                    data = gzip.decompress(data)
                if len(data) > max_bytes or not data or b"\x00" in data[:8192]:
                    continue
                texts.append(data.decode("utf-8"))
            except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
                continue
    return texts


def docs_lengths(cache: Path) -> np.ndarray | None:
    if not Path("/usr/share/doc").is_dir():
        return None
    return _cached("usr-share-docs-1m", cache, lambda: _tokenize_lengths(doc_texts()))


def draw_stream(lengths: np.ndarray, total_tokens: int, seed: int) -> np.ndarray:
    """Document lengths in draw order: shuffled epochs of a corpus until `total_tokens` are covered."""
    rng = np.random.default_rng(seed)
    out, have = [], 0
    while have < total_tokens:
        e = lengths[rng.permutation(len(lengths))]
        out.append(e)
        have += int(e.sum())
    return np.concatenate(out)


def windows_for(stream: np.ndarray, setup: Setup, context: int) -> list[Window]:
    """Each step draws the next documents until tokens_per_step is reached (the crossing one included);
    document ids are draw positions, so repeated epochs give distinct ids."""
    cum = np.cumsum(stream)
    out, start, base = [], 0, 0
    for _ in range(setup.steps):
        end = int(np.searchsorted(cum, base + setup.tokens_per_step, side="left")) + 1
        end = min(end, len(stream))
        ids = np.arange(start, end, dtype=np.int64)
        ids = ids[stream[ids] > 0]  # empty documents are skipped, as the loader skips them
        w, _, _ = cut_pieces(ids, stream[ids], context)
        out.append(w)
        base = int(cum[end - 1])
        start = end
    return out


def describe(lengths: np.ndarray, context: int, model: str, cost: str = "measured") -> dict:
    from packloader.balancers.cost.resolve import load_cost_model

    lengths = lengths[lengths > 0]  # empty documents are skipped when drawn
    l = np.sort(lengths.astype(np.float64))
    work = load_cost_model(model, ParallelConfig(dp=8, pp=4), cost=cost).doc_time(np.sort(lengths).astype(np.int64))
    top = max(1, len(l) // 100)
    return {
        "docs": len(l), "median": float(np.median(l)), "mean": float(l.mean()), "max": int(l[-1]),
        "under_4k": float((l < 4096).mean()), "tokens_in_docs_over_context": float(l[l > context].sum() / l.sum()),
        "top1pct_work_share": float(work[-top:].sum() / work.sum()),
    }


# ------------------------------------------------------------------------------------------------- runs


class Row(msgspec.Struct):
    dataset: str
    setup: str
    strategy: str
    ok: bool
    note: str = ""
    imbalance: float = 0.0
    imbalance_fwd: float = 0.0
    dp_spread: float = 0.0
    dp_spread_max: float = 0.0
    efficiency: float = 0.0  # against the no-bubble ideal
    efficiency_fill: float = 0.0  # fill-credited
    speedup: float = 0.0
    step_time: float = 0.0
    tokens: int = 0
    delay_mean: float = 0.0
    delay_max: int = 0
    delay_share: float = 0.0
    split_share: float = 0.0
    packing: float = 0.0
    plan_ms: float = 0.0
    plan_ms_p50: float = 0.0
    plan_ms_max: float = 0.0
    micro_batches: float = 0.0
    peak_gib: float = 0.0  # auto at DP <= 64: the largest simulated peak of one GPU over the run's steps
    limit_gib: float = 0.0  # the device's usable memory auto planned for
    # planned and scored under the other cost model (sensitivity)
    alt_imbalance: float = 0.0
    alt_dp_spread: float = 0.0
    alt_efficiency: float = 0.0
    # planned under the other model, scored under this one: tokens/s lost against planning with this one
    wrong_loss: float | None = None
    # this run's plans scored under the other model
    cross_efficiency: float = 0.0


def other_cost(cost: str) -> str:
    return "analytic" if cost == "measured" else "measured"


def run_one(dataset: str, setup: Setup, strategy: str, windows: list[Window], model: str, slicing: bool = True,
            budget_s: float = float("inf"), tp: int = 8, cost: str = "measured", cross: bool = True) -> Row:
    row, plans, state, windows_done = _run_one(dataset, setup, strategy, windows, model, slicing, budget_s, tp, cost)
    if not row.ok or not cross:
        return row
    alt = other_cost(cost)
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=setup.dp, pp=setup.pp, tp=tp), max_tokens=setup.cap,
                     context=setup.cap, tokens_per_step=setup.tokens_per_step, allow_slicing=slicing, model=model, cost=cost)
    alt_cfg = msgspec.structs.replace(cfg, cost=alt)
    # this run's plans under the other model
    _, cr = score_plans(plans, cost_model_for(alt_cfg), cfg.parallel, max_tokens=setup.cap, drawn=drawn_steps(windows_done))
    row.cross_efficiency = cr.efficiency
    # planned under the other model: its own figures there (sensitivity), and its plans under this model
    arow, aplans, _, awin = _run_one(dataset, setup, strategy, windows[:len(windows_done)], model, slicing, budget_s, tp, alt)
    if arow.ok:
        row.alt_imbalance, row.alt_dp_spread, row.alt_efficiency = arow.imbalance, arow.dp_spread, arow.efficiency
        _, wr = score_plans(aplans, cost_model_for(cfg), cfg.parallel, max_tokens=setup.cap, drawn=drawn_steps(awin))
        if wr.step_time_total > 0 and row.step_time > 0 and row.tokens:
            row.wrong_loss = 1.0 - (wr.tokens / wr.step_time_total) / (row.tokens / row.step_time)
    return row


def _run_one(dataset: str, setup: Setup, strategy: str, windows: list[Window], model: str, slicing: bool,
             budget_s: float, tp: int, cost: str):
    cfg = PlanConfig(strategy=strategy, parallel=ParallelConfig(dp=setup.dp, pp=setup.pp, tp=tp), max_tokens=setup.cap,
                     context=setup.cap, tokens_per_step=setup.tokens_per_step, allow_slicing=slicing, model=model, cost=cost)
    label = strategy if slicing else f"{strategy} (no slicing)"
    plans, state = [], PlannerState()
    try:
        started = time.perf_counter()
        planner = make_planner(cfg)
        planner.plan(windows[0], PlannerState(), 0)  # warm-up: numba compilation, caches
        # the heap as it stands (torch, numba: ~200K objects) goes to the permanent generation; else a full
        # collection of it (120-180 ms here, a pause of the whole process) lands in whichever step triggers it
        # and shows as that step's planning time
        gc.collect()
        gc.freeze()
        state = PlannerState()
        plans, times = [], []
        for s, w in enumerate(windows):
            t0 = time.perf_counter()
            plan, state = planner.plan(w, state, s)
            times.append(time.perf_counter() - t0)
            plans.append(plan)
            if time.perf_counter() - started > budget_s:
                break  # a slow strategy: score the steps planned so far
        gc.unfreeze()
        windows = windows[:len(plans)]
        verify_plan(plans, windows, setup.cap, allow_slicing=slicing, final_state=state, dp=setup.dp)
        # auto's plans are checked against the device it plans for: every step's simulated peak memory (slower)
        memory = getattr(planner, "memory", None) if strategy == "auto" and setup.dp <= 64 else None
        per, run = score_plans(plans, cost_model_for(cfg), cfg.parallel, max_tokens=setup.cap, drawn=drawn_steps(windows),
                               pieces=windows, final_state=state, memory=memory)
    except Exception as e:  # a strategy that is not ready: skipped with a note
        gc.unfreeze()
        msg = f"{type(e).__name__}: {e}".replace("\n", " ")
        return Row(dataset, setup.name, label, False, note=msg[:160]), plans, state, windows
    if run.tokens_dropped or run.tokens_duplicated:
        return (Row(dataset, setup.name, label, False, note=f"{run.tokens_dropped} tokens dropped, {run.tokens_duplicated} duplicated"),
                plans, state, windows)
    return Row(
        dataset, setup.name, label, True,
        note="; ".join(x for x in (
            f"{len(state.queued)} pieces still queued" if state.queued else "",
            f"{len(plans)} of {setup.steps} steps (time budget)" if len(plans) < setup.steps else "") if x),
        imbalance=run.imbalance_mean, imbalance_fwd=run.imbalance_fwd_mean, dp_spread=run.dp_spread_mean,
        dp_spread_max=run.dp_spread_max, efficiency=run.efficiency, efficiency_fill=run.efficiency_fill, step_time=run.step_time_total, tokens=run.tokens,
        delay_mean=run.delay_mean, delay_max=run.delay_max, delay_share=run.delay_share, split_share=run.split_share,
        packing=run.packing_efficiency, plan_ms=1e3 * float(np.mean(times)), plan_ms_p50=1e3 * float(np.median(times)), plan_ms_max=1e3 * float(np.max(times)),
        micro_batches=float(np.mean([s.micro_batches for s in per])),
        peak_gib=run.peak_bytes / 1024**3, limit_gib=(planner.mem_limit or 0.0) / 1024**3 if memory is not None else 0.0,
    ), plans, state, windows


def run_all(args) -> tuple[list[Row], dict]:
    cache = Path(args.cache)
    sets = setups(args.quick, args.steps)
    datasets: dict[str, np.ndarray | None] = {}
    for d in args.datasets:
        if d.startswith("synthetic"):
            datasets[d] = synthetic(d, 200_000, args.seed)
        elif d == "stdlib":
            datasets[d] = stdlib_lengths(cache)
        elif d == "docs":
            datasets[d] = docs_lengths(cache)
        else:
            raise SystemExit(f"unknown dataset {d!r}; expected synthetic-cc, synthetic-github, synthetic-longtail, stdlib or docs")
    stats = {}
    rows: list[Row] = []
    for d, lengths in datasets.items():
        if lengths is None:
            print(f"[{d}] not present on this machine, skipped", flush=True)
            continue
        stats[d] = describe(lengths, 65536, args.model, args.cost)
        for setup in sets:
            if setup.name not in args.setups and not args.quick:
                continue
            stream = draw_stream(lengths, setup.tokens_per_step * (setup.steps + 1), args.seed)
            windows = windows_for(stream, setup, setup.cap)
            runs = [(s, True) for s in args.strategies]
            if setup.pp > 1 and "auto" in args.strategies:
                runs.append(("auto", False))
            for s, slicing in runs:
                cross = not args.no_cross and not setup.name.startswith("dp1024")  # DP 1024 is there for planning time
                row = run_one(d, setup, s, windows, args.model, slicing, args.budget_s, args.tp, args.cost, cross)
                rows.append(row)
                print(f"[{d} {setup.name}] {row.strategy:22s} " + (
                    f"imb {row.imbalance:.3f} spread {row.dp_spread:.4f} eff {row.efficiency:.3f} "
                    f"delay {row.delay_mean:.2f} plan {row.plan_ms:.1f} ms | other model: eff {row.alt_efficiency:.3f}, "
                    f"wrong-profile loss {100 * (row.wrong_loss or 0):.1f}%" if row.ok else f"skipped: {row.note}"), flush=True)
    for r in rows:  # simulated tokens per second over fixed's, same dataset and setup (delays plan fewer tokens)
        base = next((b for b in rows if b.dataset == r.dataset and b.setup == r.setup and b.strategy == REFERENCE and b.ok), None)
        if r.ok and base is not None and r.step_time > 0 and base.tokens:
            r.speedup = (r.tokens / r.step_time) / (base.tokens / base.step_time)
    return rows, stats


# ----------------------------------------------------------------------------------------------- report


def _fmt_row(r: Row) -> str:
    if not r.ok:
        return f"| {r.strategy} | skipped: {r.note.replace('|', '/')} |" + " |" * 11
    sp = f"{r.speedup:.2f}x" if r.speedup else "-"
    if r.alt_efficiency:
        alt = f"{r.alt_imbalance:.3f} / {r.alt_dp_spread:.4f} / {r.alt_efficiency:.3f}"
        wrong = f"{100 * r.wrong_loss:+.1f}%" if r.wrong_loss is not None else "-"
        cross = f"{r.cross_efficiency:.3f}"
    else:
        alt = wrong = cross = "-"
    return (f"| {r.strategy} | {r.imbalance:.3f} | {r.dp_spread:.4f} | {r.efficiency:.3f} | {r.efficiency_fill:.3f} | {sp} | {r.delay_mean:.2f} / "
            f"{r.delay_max} | {100 * r.split_share:.1f}% | {r.micro_batches:.1f} | {r.plan_ms:.1f} / {r.plan_ms_p50:.1f} / {r.plan_ms_max:.1f} "
            f"| {alt} | {wrong} | {cross} |" + (f" {r.note}" if r.note else ""))


def targets(rows: list[Row]) -> list[str]:
    """One line per target: met or not, from the `auto` rows (a missing `auto` is reported as not met)."""
    out = []

    def auto(setup, slicing=True):
        name = "auto" if slicing else "auto (no slicing)"
        return [r for r in rows if r.setup == setup and r.strategy == name]

    def line(text, rs, ok, show=None):
        if not rs or not all(r.ok for r in rs):
            out.append(f"- {text}: **not measured** (`auto` missing or failed: {next((r.note for r in rs if not r.ok), 'no rows')})")
            return
        good = [ok(r) for r in rs]
        verdict = "**met**" if all(good) else ("**not met**" if not any(good) else "**partly met**")
        out.append(f"- {text}: {verdict} (" + ", ".join(
            f"{r.dataset} {r.setup}{' ' + show(r) if show else ''} {'yes' if g else 'no'}" for r, g in zip(rs, good)) + ")")

    a = auto("dp8-pp4")
    line(f"`auto` imbalance degree <= {TARGETS['imbalance']} with mean delay <= {TARGETS['delay_mean']} steps (dp8-pp4; shown imbalance/delay)",
         a, lambda r: r.imbalance <= TARGETS["imbalance"] and r.delay_mean <= TARGETS["delay_mean"],
         lambda r: f"{r.imbalance:.3f}/{r.delay_mean:.2f}")
    line(f"DP 8 / PP 4 / 64K: simulated 1F1B efficiency against the no-bubble ideal >= {TARGETS['efficiency']} with slicing (`auto`)",
         a, lambda r: r.efficiency >= TARGETS["efficiency"], lambda r: f"{r.efficiency:.3f}")
    line("DP 8 / PP 4: `auto`'s simulated peak memory within the device's usable limit on every step (shown peak / limit GiB)",
         a, lambda r: 0 < r.peak_gib <= r.limit_gib, lambda r: f"{r.peak_gib:.1f}/{r.limit_gib:.1f}")
    line(f"PP 1: DP spread <= {TARGETS['dp_spread']} (`auto`, mean over steps of slowest rank / mean rank)",
         auto("dp8-pp1"), lambda r: r.dp_spread <= TARGETS["dp_spread"], lambda r: f"{r.dp_spread:.4f}")

    def verl(r):  # today's verl: its own row if the benchmark has one, else its Karmarkar-Karp re-implementation
        same = [b for b in rows if b.dataset == r.dataset and b.setup == r.setup and b.ok]
        return next((b for b in same if b.strategy.startswith("verl")), None) or next(
            (b for b in same if b.strategy == "karmarkar_karp"), None)

    line("PP 1: `auto` ahead of today's verl in simulated tokens per second (shown auto / verl, over `fixed`)",
         [r for r in auto("dp8-pp1") if verl(r) is not None] or auto("dp8-pp1"),
         lambda r: verl(r) is not None and r.speedup > verl(r).speedup,
         lambda r: f"{r.speedup:.3f}/{verl(r).speedup:.3f} ({verl(r).strategy})" if verl(r) else "no verl row")
    ms = lambda r: f"{r.plan_ms:.1f}/{r.plan_ms_p50:.1f} ms"  # noqa: E731
    for stat, key in (("mean", "plan_ms"), ("median", "plan_ms_p50")):
        line(f"planning <= {TARGETS['plan_ms_dp8']:g} ms per step at DP 8 (`auto`, {stat} over steps; shown mean/median)",
             a + auto("dp8-pp1"), lambda r, k=key: getattr(r, k) <= TARGETS["plan_ms_dp8"], ms)
        line(f"planning <= {TARGETS['plan_ms_dp1024']:g} ms per step at DP 1024 with 3.2M tokens, and with 8 x 64K per rank "
             f"(537M) where run (`auto`, {stat}; shown mean/median)",
             auto("dp1024") + auto("dp1024-8x64k"), lambda r, k=key: getattr(r, k) <= TARGETS["plan_ms_dp1024"], ms)
    return out


def report(rows: list[Row], stats: dict, args, commands: list[list[str]]) -> str:
    import numba

    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    alt = other_cost(args.cost)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"Measured {now} on {platform.machine()} with {cpus} CPUs usable ({os.cpu_count()} online), load average "
        f"{os.getloadavg()[0]:.1f} at the end; Python {platform.python_version()}, numba {numba.__version__}; "
        f"cost model `{args.model}`, {args.cost} ({'H100 timings, packloader/balancers/cost/measured.py' if args.cost == 'measured' else 'packloader/balancers/cost/presets.py'}), "
        f"TP {args.tp}, 1F1B:",
        "",
        "```",
        *("$ " + " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/planner.py", *cmd]) for cmd in commands),
        "```",
        "",
        "Strategies: `fixed` (BFD into fixed 64K bins, the baseline), `wlb`, `hydraulis`, `slimpack`, `auto` "
        "(packloader's planners, issue 3), and re-implementations of what users run today "
        "(`packloader/balancers/planners/concat.py`, `multipack.py`, `verl.py`): `concat` = Megatron-LM's concatenate-and-chunk samples "
        "(document-masked), `multipack` = Axolotl's multipack sampler (first-fit bins dealt round-robin to DP "
        "ranks), `karmarkar_karp` = verl's Karmarkar-Karp balancing of workload over DP ranks (equal-size groups) "
        "then micro-batches. "
        "`auto (no slicing)` is `auto` with `allow_slicing=False`. Every plan passed `verify_plan` (each drawn "
        "token exactly once, cap, equal micro-batch counts) before it was scored; \"N pieces still queued\" is "
        "what a delaying strategy still held after the last step (not lost). Planning times are wall clock on a "
        "shared machine and include the Python layer that builds the StepPlan.",
        "",
        "Data sets (lengths in tokens, before cutting at the 64K context; workload = the cost model's forward + "
        "backward time of each whole document):",
        "",
        "| data set | docs | median | mean | max | share < 4K | tokens in docs > 64K | longest 1% of docs' share of the workload |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d, s in stats.items():
        lines.append(f"| {d} | {s['docs']} | {s['median']:.0f} | {s['mean']:.0f} | {s['max']} | {100 * s['under_4k']:.0f}% | "
                     f"{100 * s['tokens_in_docs_over_context']:.1f}% | {100 * s['top1pct_work_share']:.0f}% |")
    lines += [
        "",
        "Columns: imbalance = WLB-LLM imbalance degree (max micro-batch cost x count / total, worst rank of each step, "
        "mean over steps; WLB-LLM's pipeline figure: the largest micro-batch sets the pace of a pipeline, so it is the "
        "target's figure at PP 4; at PP 1 the micro-batches of a rank run one after another, their sizes do not change "
        "the step time, and the balance that counts there is across ranks, the spread); spread = simulated slowest rank / mean rank (mean over steps); eff = the no-bubble ideal (the step's "
        "work spread over every GPU, none idle) / simulated step time over the run; fill-credited = the same with the "
        "pipeline's fill and drain, (m + pp - 1) / m, credited to the ideal (the figure before issue 25); vs fixed = simulated tokens per second over those of `fixed` (tokens planned / simulated step time, summed over the run; a strategy that delays plans fewer tokens in the same steps); delay = mean "
        "delay in steps over all tokens / max (metrics.token_delay, as in the report); split = tokens in slices; mbs = micro-batches per rank "
        "(mean); plan = planning wall time per step, mean / median / max, in ms on this machine. "
        f"Sensitivity: {alt} model = the same strategy planned and scored under the {alt} cost model (imbalance / "
        f"spread / eff); wrong profile = tokens per second lost, scored under the {args.cost} model, when the strategy "
        f"plans with the {alt} model instead (negative: the wrong model happened to plan faster); plans under {alt} = "
        f"eff of this row's plans scored under the {alt} model (what the other model would have predicted).",
        "",
    ]
    for setup in dict.fromkeys(r.setup for r in rows):
        s = next(x for x in setups(args.quick, args.steps) if x.name == setup)
        for d in dict.fromkeys(r.dataset for r in rows if r.setup == setup):
            lines += [
                f"**{d}, {setup}** (DP {s.dp}, PP {s.pp}, cap {s.cap}, {s.tokens_per_step} tokens per step, {s.steps} steps)",
                "",
                f"| strategy | imbalance | spread | eff | fill-credited | vs fixed | delay | split | mbs | plan ms | {alt} model: imb / spread / eff "
                f"| wrong profile | plans under {alt} |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
            lines += [_fmt_row(r) for r in rows if r.setup == setup and r.dataset == d]
            lines.append("")
    lines += [f"Targets (issues 3, 12 and 25), under the {args.cost} cost model:", ""] + targets(rows)
    return "\n".join(lines) + "\n"


def merge_rows(rows: list[Row], stats: dict, files: list[Path]) -> tuple[list[Row], dict, list[list[str]]]:
    """This run's rows after those of earlier runs' JSON files, a row of this run replacing an earlier one of
    the same data set, setup and strategy; rows keep the order setup, data set, strategy of first appearance.
    Also the earlier runs' command lines, so the section says how to reproduce every row."""
    if not files:
        return rows, stats, []
    merged: dict[tuple[str, str, str], Row] = {}
    all_stats: dict = {}
    commands: list[list[str]] = []
    for f in files:
        old = msgspec.json.decode(f.read_bytes(), type=dict[str, object])
        commands += [c for c in old.get("commands", []) if c not in commands]
        for r in msgspec.convert(old["rows"], list[Row]):
            merged[(r.setup, r.dataset, r.strategy)] = r
        all_stats.update(old["stats"])
    for r in rows:
        merged[(r.setup, r.dataset, r.strategy)] = r
    all_stats.update(stats)
    order = [s.name for s in setups(False, 1)] + [s.name for s in setups(True, 1)]
    out = sorted(merged.values(), key=lambda r: order.index(r.setup) if r.setup in order else len(order))
    return out, all_stats, commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small steps, synthetic-cc only")
    ap.add_argument("--steps", type=int, default=20, help="steps per run at DP 8 (DP 1024 runs a quarter)")
    ap.add_argument("--datasets", nargs="+", default=None)
    ap.add_argument("--setups", nargs="+", default=["dp8-pp4", "dp8-pp1", "dp1024"])
    ap.add_argument("--strategies", nargs="+", default=None,
                    help="default: the reference baseline, then the registry's packloader planners and the other "
                         "tools' baselines, each in the report's order")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cost", choices=["measured", "analytic"], default="measured",
                    help="cost model the strategies plan and are scored with (the other one is the sensitivity column)")
    ap.add_argument("--no-cross", action="store_true", help="skip planning under the other cost model")
    ap.add_argument("--tp", type=int, default=8,
                    help="tensor parallelism of the cost and memory model: Llama-3-8B with 64K-token micro-batches fits "
                         "an 80 GB H100 only with TP 8, and auto keeps only plans that fit")
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop a strategy's run after this many seconds (steps done so far are scored)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "packloader-bench"), help="token-length cache")
    ap.add_argument("--write", type=Path, default=None, help="replace the planner section of this markdown file")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    ap.add_argument("--merge", type=Path, nargs="+", default=[],
                    help="rows of earlier runs (--json files) to report with this run's (this run's rows win): the "
                         "section assembled from several short runs on a busy machine")
    args = ap.parse_args(argv)
    if args.strategies is None:
        args.strategies = default_strategies()
    if args.datasets is None:
        args.datasets = ["synthetic-cc"] if args.quick else ["synthetic-cc", "synthetic-github", "synthetic-longtail", "stdlib", "docs"]
    rows, stats = run_all(args)
    rows, stats, commands = merge_rows(rows, stats, args.merge)
    text = report(rows, stats, args, commands + [argv])
    print(text)
    if args.json:
        args.json.write_bytes(msgspec.json.encode({"rows": rows, "stats": stats, "commands": commands + [argv]}))
    if args.write:
        write_section(args.write, SECTION, "Planners", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
