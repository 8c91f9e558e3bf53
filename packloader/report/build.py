"""Put the report together: draw the steps from the lengths, run every strategy over them, compute figures and
advice, write the JSON, the PNGs and the HTML page. The CLI (`packloader report`) is a thin layer over
`build_report`."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Sequence

import msgspec
import numpy as np

from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.resolve import load_cost_model
from packloader.balancers.planners.config_rules import validate_config
from packloader.balancers.planners.registry import report_strategies
from packloader.balancers.sim.simulator import simulate_step
from packloader.contracts import PlanConfig, plan_encoder
from packloader.report import doc_cp_row, plots
from packloader.report.advice import fits, recommend
from packloader.report.draw import Draw, draw_steps
from packloader.report.figures import (
    Report,
    Settings,
    StrategyFigures,
    doc_attention,
    fill_speedups,
    length_stats,
    strategy_figures,
)
from packloader.report.html import render_html
from packloader.report.lengths import Lengths
from packloader.report.run import StrategyRun, run_strategy


class ReportOptions(msgspec.Struct, kw_only=True):
    """What `build_report` does besides planning (the layout is the PlanConfig)."""

    steps: int = 8
    strategies: Sequence[str] = ()  # empty: the registry's report strategies (`report_strategies`)
    device: str | None = None  # a device profile name; None: the PlanConfig's
    out_dir: str | None = None  # None: no files, only the Report
    plots: bool = True
    advice: bool = True
    grouping: bool = True
    grid_steps: int = 4
    progress: bool = True
    plans_dir: str | None = None  # write each strategy's plans as JSON lines here
    input: str = ""
    tokenizer: str | None = None
    notes: list[str] = []


def memory_model_for(model_spec: str, config: PlanConfig, device: str):
    """The memory model of a preset (None for a calibration profile, whose shape is unknown); the same one the
    `auto` planner checks its plans against."""
    from packloader.balancers.cost.memory import memory_model_for as _for

    return _for(model_spec, config.parallel, config.schedule, device, config.memory_gib)


def _reference(figs: list[StrategyFigures]) -> StrategyFigures | None:
    bases = [f for f in figs if f.role == "baseline" and f.status == "ok"]
    return max(bases, key=lambda f: f.tokens_per_second) if bases else None


def _mb_costs(run: StrategyRun, model: CostModel, steps: int) -> np.ndarray:
    """Forward + backward time of every micro-batch of the drawn steps (a DP-Merge micro-batch once), each over
    the mean micro-batch of its own step: 1.0 is even. Raw times pooled over steps would mix steps whose
    micro-batches differ in size (auto picks a count per step), so a strategy that is even inside every step
    would look uneven; within a step is where the pipeline and the DP ranks wait for the slowest one."""
    out = []
    seen: set = set()
    for plan in run.plans[:steps]:
        step = []
        for rank in plan.ranks:
            for mb in rank.micro_batches:
                if mb.dp_group and len(mb.dp_group) > 1:
                    key = (plan.step, tuple(mb.dp_group), tuple(mb.segments))
                    if key in seen:
                        continue
                    seen.add(key)
                f, b = model.microbatch_times(mb)
                step.append(f + b)
        mean = float(np.mean(step)) if step else 0.0
        if mean > 0:
            out += [t / mean for t in step]
    return np.asarray(out)


@contextlib.contextmanager
def _quiet_planners():
    """The report plans many layouts and caps on purpose, and `auto` warns once per planner when none of its plans
    fits in memory: a flood here. The report's memory columns and notes say it instead."""
    log = logging.getLogger("packloader.planner")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def build_report(lengths: Lengths, config: PlanConfig, options: ReportOptions | None = None) -> tuple[Report, dict[str, StrategyRun]]:
    """The report of `config` (layout, caps, model, steps via `config.tokens_per_step`) over `lengths`."""
    with _quiet_planners():
        return _build_report(lengths, config, options)


def _build_report(lengths: Lengths, config: PlanConfig, options: ReportOptions | None) -> tuple[Report, dict[str, StrategyRun]]:
    from tqdm.auto import tqdm

    opt = options or ReportOptions()
    if opt.device is not None and config.device != opt.device:  # the planners price the device the report is for
        config = msgspec.structs.replace(config, device=opt.device)
    config = validate_config(config, strategy_rules=False)  # each strategy is run (or reported refused) on its own
    device = config.device
    model = load_cost_model(config.model, config.parallel, device=device, cost=config.cost)
    memory = memory_model_for(config.model, config, device)
    draw: Draw = draw_steps(lengths.lengths, config.tokens_per_step, config.context, opt.steps)
    notes = list(opt.notes)
    if model.profile.source.startswith("analytic: no measured"):
        notes.append(f"times use the analytic cost model: {model.profile.source.removeprefix('analytic: ')}")
    if draw.steps < opt.steps:
        notes.append(f"the input holds only {draw.steps} complete steps of {config.tokens_per_step:,} tokens; the report covers those")
    if lengths.empty:
        notes.append(f"{lengths.empty:,} empty documents left out, as the loader does")
    mem_cap = None
    if memory is not None:
        mem_cap = memory.tokens_that_fit(tile=model.profile.tile)
        if mem_cap == 0:
            notes.append(f"{config.model} does not fit on one {device.upper()} under this layout even without activations "
                         f"(weights, gradients and optimizer state); raise --tp or --pp: memory figures show how far off it is")
        elif config.max_tokens > mem_cap:
            notes.append(f"--max-tokens {config.max_tokens:,} exceeds what {config.model} fits in one micro-batch on this layout "
                         f"({mem_cap:,} tokens by the memory model); plans at this cap would run out of memory")
    else:
        notes.append("peak memory is not reported: the cost profile does not name a model shape (use a preset for --model)")
    p = config.parallel
    settings = Settings(
        input=opt.input or lengths.origin, tokenizer=opt.tokenizer, model=config.model, cost_profile=model.name, device=device,
        dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp, vpp=p.vpp, schedule=config.schedule, gpus=p.dp * p.pp * p.cp * p.tp,
        tokens_per_step=config.tokens_per_step, max_tokens=config.max_tokens, context=config.context, steps=draw.steps,
        seed=config.seed, memory_cap_tokens=mem_cap,
    )
    runs: dict[str, StrategyRun] = {}
    figs: list[StrategyFigures] = []
    strategies = tuple(opt.strategies) or report_strategies()
    bar = tqdm(total=len(strategies) * draw.steps, desc="plan", unit="step", disable=not opt.progress, leave=False, dynamic_ncols=True)
    try:
        for name in strategies:
            bar.set_postfix_str(name, refresh=True)
            before = bar.n
            run = run_strategy(name, config, draw, tick=bar.update)
            bar.update(before + draw.steps - bar.n)
            runs[name] = run
            if run.memory_summary:
                notes.append(run.memory_summary)
            try:
                figs.append(strategy_figures(run, draw, model, config, memory))
            except Exception as e:  # e.g. a schedule the plan's micro-batch count cannot run: report, don't die
                run.error = f"scoring failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
                figs.append(strategy_figures(run, draw, model, config, memory))
    finally:
        bar.close()
    advice_figs = list(figs)  # the advice tries fixed-CP strategies only
    if doc_cp_row.wanted(config):  # per-document CP's row and whether it wins (issue 26)
        run, fig, note = doc_cp_row.dynamic_cp_row(config, draw, model, runs, figs, memory)
        runs[fig.name] = run
        figs.append(fig)
        notes.append(note)
    fill_speedups(figs)
    report = Report(settings=settings, lengths=length_stats(draw, model, lengths.empty), reference_baseline="", strategies=figs, notes=notes)
    ref = _reference(figs)
    report.reference_baseline = ref.name if ref else ""
    if opt.advice:
        report.advice = recommend(advice_figs, config, draw, model, memory, grid_steps=opt.grid_steps, grouping=opt.grouping,
                                  progress=opt.progress)
    if opt.out_dir is not None:
        _write(report, runs, draw, model, config, opt, memory)
    return report, runs


def _write(report: Report, runs: dict[str, StrategyRun], draw: Draw, model: CostModel, config: PlanConfig, opt: ReportOptions, memory=None) -> None:
    out = Path(opt.out_dir)  # type: ignore[arg-type]
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    images: dict[str, str] = {}
    if opt.plans_dir:
        pdir = Path(opt.plans_dir)
        pdir.mkdir(parents=True, exist_ok=True)
        enc = plan_encoder()
        for name, run in runs.items():
            if run.ok:
                (pdir / f"{name}.jsonl").write_bytes(b"".join(enc.encode(p) + b"\n" for p in run.plans))
        files["plans"] = str(pdir)
    if opt.plots:
        images = _plots(report, runs, draw, model, config, out, memory)
        files.update({k: str(v) for k, v in images.items()})
        html_path = out / "report.html"
        captions = {
            "Simulated throughput per strategy": images.get("summary"),
            "Document lengths and attention work": images.get("lengths"),
            "Micro-batch time over its step's mean, per strategy": images.get("costs"),
            "One step's pipeline timeline": images.get("timeline"),
        }
        files["html"] = str(html_path)
        report.files = dict(files, json=str(out / "report.json"))
        html_path.write_text(render_html(report, {k: v for k, v in captions.items() if v}), encoding="utf-8")
    files["json"] = str(out / "report.json")
    report.files = files
    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")


def _plots(report: Report, runs: dict[str, StrategyRun], draw: Draw, model: CostModel, config: PlanConfig, out: Path, memory=None) -> dict[str, str]:
    ok = [f for f in report.strategies if f.status == "ok" and f.name != doc_cp_row.pool_planner()]  # its plans: a pool of GPUs
    roles = {f.name: f.role for f in ok}
    images: dict[str, str] = {}
    L = report.lengths
    pieces = draw.pieces()
    attn = doc_attention(draw.lengths, pieces.doc, pieces.length, model)
    images["lengths"] = plots.plot_lengths(
        str(out / "lengths.png"), draw.lengths, attn, config.context,
        f"The longest {L.long_doc_share:.0%} of documents (over {L.long_threshold:,} tokens) hold {L.long_token_share:.0%} of the "
        f"tokens but {L.long_attention_share:.0%} of the attention work: packing by token count alone leaves some micro-batches far heavier.",
    )
    if not ok:
        return images
    ref = next((f for f in ok if f.name == report.reference_baseline), None)
    adv = report.advice
    # the plots compare at the user's settings: the fastest packloader strategy whose plans fit in memory
    ours = [f for f in ok if f.role == "packloader"]
    best = max([f for f in ours if fits(f, memory)] or ours, key=lambda f: f.tokens_per_second, default=None)
    fastest = max(ok, key=lambda f: f.tokens_per_second)
    names = [f.name for f in ok]
    flags = {f.name: f"needs {max(f.peak_memory_gib):.0f} GiB per GPU: does not fit" for f in ok if not fits(f, memory)}
    if best is not None:
        take = f"At your settings, {best.name} is the fastest packloader strategy that fits in memory: {best.tokens_per_second / 1e3:,.0f}k tokens/s"
        if ref is not None:
            take += f" = {best.speedup.get(ref.name, 0):.2f}x the fastest baseline ({ref.name})"
        take += f", {best.efficiency:.0%} of the no-bubble ideal."
        if flags:
            take += " Hatched bars need more memory than a GPU has."
        if adv is not None and (adv.strategy, adv.max_tokens, adv.num_micro_batches) != (
                best.name, report.settings.max_tokens, round(best.micro_batches_mean)):
            take += (f" Advice after trying other caps and micro-batch counts: {adv.settings_text()} "
                     f"({adv.speedup_vs_baseline:.2f}x the fastest baseline).")
    else:
        take = f"Fastest: {fastest.name} at {fastest.tokens_per_second / 1e3:,.0f}k tokens/s."
    images["summary"] = plots.plot_summary(
        str(out / "summary.png"), names, roles, [f.tokens_per_second for f in ok],
        [f.tokens_planned / f.bound_time_total if f.bound_time_total > 0 else 0.0 for f in ok],
        [f.step_time_mean * 1e3 for f in ok], flags, report.settings.gpus, take)
    costs = {f.name: _mb_costs(runs[f.name], model, f.steps) for f in ok}
    spread = {n: float(c.max()) for n, c in costs.items() if len(c)}
    take = "A pipeline waits for its slowest micro-batch."
    if spread:
        even = min(spread, key=spread.get)
        take += f" Most even: {even} (slowest {spread[even]:.2f}x its step's mean)"
        if ref is not None and ref.name in spread and ref.name != even:
            take += f"; the fastest baseline, {ref.name}: {spread[ref.name]:.2f}x"
        take += "."
    images["costs"] = plots.plot_costs(str(out / "costs.png"), costs, roles, take)
    if ref is not None and best is not None and ref.per_step and best.per_step:
        n = min(ref.steps, best.steps)
        # among steps where both train about the same tokens (outlier delay moves tokens between steps), the one
        # where the baseline is furthest from its no-bubble ideal: where imbalance costs most
        gap = [abs(best.per_step[i].tokens - ref.per_step[i].tokens) / max(ref.per_step[i].tokens, 1) for i in range(n)]
        close = [i for i in range(n) if gap[i] <= 0.05] or [int(np.argmin(gap))]
        k = max(close, key=lambda i: ref.per_step[i].step_time / max(ref.per_step[i].bound_time, 1e-12))
        report.timeline_step = k
        rp, bp = ref.per_step[k], best.per_step[k]
        sims = [(f"{ref.name} (baseline), {rp.tokens:,} tokens",
                 simulate_step(runs[ref.name].plans[k], model, config.parallel, schedule=config.schedule)),
                (f"{best.name} (packloader), {bp.tokens:,} tokens",
                 simulate_step(runs[best.name].plans[k], model, config.parallel, schedule=config.schedule))]
        bounds = [rp.bound_time, bp.bound_time]
        t0, t1 = sims[0][1].step_time, sims[1][1].step_time
        take = (f"Step {k}: {ref.name} needs {t0 * 1e3:,.0f} ms ({rp.efficiency:.0%} of the no-bubble ideal), {best.name} "
                f"{t1 * 1e3:,.0f} ms ({bp.efficiency:.0%}). White gaps are GPUs waiting: pipeline fill and drain, "
                f"a slower micro-batch upstream, or a slower rank.")
        if gap[k] > 0.05:
            take += " The two train different token counts in this step (outlier delay moves tokens between steps)."
        images["timeline"] = plots.plot_timeline(str(out / "timeline.png"), sims, bounds, k, take,
                                                 max_ranks=max(2, 16 // config.parallel.pp))
    return images
