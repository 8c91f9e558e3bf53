"""The report as text: one column per strategy, one row per figure (the same rows the HTML page shows)."""

from __future__ import annotations

from typing import Callable

from packloader.report.figures import Report, StrategyFigures

Row = tuple[str, Callable[[StrategyFigures], str]]

# what the advice is, against the table above it (text and HTML)
ADVICE_SCOPE = ("the table is at your settings; the advice also tries other caps and micro-batch counts, so its "
                "figures can differ from the table's")


def _gib(xs: list[float]) -> str:
    return "/".join(f"{x:.0f}" for x in xs) if xs else "-"


def rows_for(report: Report) -> list[Row]:
    bases = [f.name for f in report.strategies if f.role == "baseline" and f.status == "ok"]
    rows: list[Row] = [
        ("kind", lambda f: f.role),
        ("step time, simulated (ms, mean)", lambda f: f"{f.step_time_mean * 1e3:,.0f}"),
        ("throughput (k tokens/s)", lambda f: f"{f.tokens_per_second / 1e3:,.0f}"),
    ]
    for b in bases:
        rows.append((f"speedup over {b} (tokens/s)", lambda f, b=b: f"{f.speedup[b]:.2f}x" if b in f.speedup else "-"))
    rows += [
        ("efficiency vs no-bubble ideal", lambda f: f"{f.efficiency:.0%}"),
        ("imbalance degree (mean / max)", lambda f: f"{f.imbalance_mean:.2f}/{f.imbalance_max:.2f}"),
        ("DP spread (mean / max)", lambda f: f"{f.dp_spread_mean:.2f}/{f.dp_spread_max:.2f}"),
        ("pipeline bubble share", lambda f: f"{f.bubble_share_mean:.0%}"),
        ("peak activations per stage (GiB)", lambda f: _gib(f.peak_activation_gib)),
        ("peak memory, worst stage (GiB)", lambda f: f"{max(f.peak_memory_gib):.0f}" if f.peak_memory_gib else "-"),
        ("micro-batches per rank", lambda f: f"{f.micro_batches_mean:.1f}"),
        ("packing efficiency", lambda f: f"{f.packing_efficiency:.0%}"),
        ("tokens delayed (share)", lambda f: f"{f.delay_share:.1%}"),
        ("delay mean / max (steps)", lambda f: f"{f.delay_mean:.2f}/{f.delay_max}"),
        ("queued after last step (tokens)", lambda f: f"{f.tokens_queued_at_end:,}"),
        ("extra steps to train them", lambda f: f"{f.drain_steps}"),
        ("tokens split into slices", lambda f: f"{f.split_share:.1%}"),
        ("tokens dropped / duplicated", lambda f: f"{f.tokens_dropped}/{f.tokens_duplicated}"),
        ("planning time per step (ms)", lambda f: f"{f.plan_ms_mean:.1f}"),
    ]
    return rows


def render_table(report: Report, width: int = 9) -> str:
    ok = [f for f in report.strategies if f.status == "ok"]
    rows = rows_for(report)
    cells = [[get(f) for f in ok] for _, get in rows]
    label_w = max(len(r[0]) for r in rows) + 1
    widths = [max([width, len(f.name)] + [len(row[j]) for row in cells]) + 2 for j, f in enumerate(ok)]
    lines = [" " * label_w + "".join(f.name.rjust(w) for f, w in zip(ok, widths))]
    lines.append("-" * len(lines[0]))
    for (label, _), row in zip(rows, cells):
        lines.append(label.ljust(label_w) + "".join(c.rjust(w) for c, w in zip(row, widths)))
    return "\n".join(lines)


def render_text(report: Report) -> str:
    """The whole report for a terminal: settings, lengths, the table, skipped strategies, advice."""
    s, L = report.settings, report.lengths
    out = [
        f"packloader report: {s.input}",
        f"layout dp={s.dp} pp={s.pp} cp={s.cp} tp={s.tp} ({s.gpus} GPUs, {s.schedule}), model {s.model} ({s.cost_profile}), "
        f"{s.tokens_per_step:,} tokens per step, micro-batch cap {s.max_tokens:,}, context {s.context:,}, {s.steps} steps, seed {s.seed}",
        f"documents: {L.documents:,} drawn ({L.tokens:,} tokens), median {L.median:,.0f}, p99 {L.p99:,.0f}, max {L.max:,} tokens; "
        f"{L.documents_cut:,} cut at the context; the longest {L.long_doc_share:.0%} (> {L.long_threshold:,} tokens) hold "
        f"{L.long_token_share:.0%} of tokens and {L.long_attention_share:.0%} of attention work",
        "",
        render_table(report),
        "(imbalance degree: slowest micro-batch x micro-batches / total on a DP rank, 1.00 = even; DP spread: slowest rank"
        " / mean rank; efficiency: the no-bubble ideal (the work spread over every GPU, none idle) / simulated step time,"
        " at most 100 %; speedups compare tokens/s; times are simulated with the cost model)",
    ]
    skipped = [f for f in report.strategies if f.status != "ok"]
    if skipped:
        out.append("")
        out += [f"skipped {f.name}: {f.note}" for f in skipped]
    a = report.advice
    if a is not None:
        out += ["", f"advice ({ADVICE_SCOPE}):", f"  strategy {a.strategy}: {a.reason}",
                f"  settings: {a.settings_text()}"]
        if a.grouping is not None:
            out.append(f"  heterogeneous grouping: {a.grouping_text()}")
        out += [f"  note: {n}" for n in a.notes]
    out += [f"note: {n}" for n in report.notes]
    if report.files:
        out += ["", "files: " + ", ".join(report.files.values())]
    return "\n".join(out)
