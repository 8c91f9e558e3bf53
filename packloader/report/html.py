"""One self-contained HTML page: settings, the figures table, the advice and the PNGs inlined as base64 (no
external files, scripts or fonts, so it can be mailed or attached to a ticket)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from packloader.report.figures import Report
from packloader.report.table import ADVICE_SCOPE, rows_for

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em} td,th{padding:.25em .6em;border-bottom:1px solid #eee;text-align:right}
td:first-child,th:first-child{text-align:left} th{background:#f5f5f5} .pk{background:#eef5fc}
img{max-width:100%;border:1px solid #eee;margin:.5em 0} .note{color:#555} code{background:#f3f3f3;padding:0 .2em}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em} dt{font-weight:600}
"""

EXPLAIN = {
    "imbalance degree (mean / max)": "slowest micro-batch x number of micro-batches / total, per DP rank (1.00 = even)",
    "DP spread (mean / max)": "slowest DP rank's step / the mean rank's (1.00 = no rank waits)",
    "efficiency vs no-bubble ideal": "the step time if all work were spread evenly over every GPU, none ever idle / simulated step time",
    "pipeline bubble share": "share of GPU time idle in the step (pipeline fill and drain, waiting for slower ranks)",
    "packing efficiency": "tokens / (micro-batches x token cap)",
    "throughput (k tokens/s)": "tokens trained / simulated time; speedups compare it, so tokens held back past the last step do not count as a gain",
}


def _e(x) -> str:
    return html.escape(str(x))


def _grid_table(a) -> str:
    """The advice's evidence: every (strategy, cap, micro-batches) tried, and every grouping, in a details block."""
    rows = [f"<details><summary>every combination tried (first {a.grid_steps} steps)</summary><table><tr><th>strategy</th><th>token cap</th>"
            "<th>micro-batches per rank</th><th>k tokens/s</th><th>peak GiB</th><th>fits</th><th>note</th></tr>"]
    for c in sorted(a.cap_grid, key=lambda c: -c.tokens_per_second):
        m = str(c.num_micro_batches) if c.num_micro_batches else f"own ({c.micro_batches_mean:.1f})"
        rows.append(f"<tr><td>{_e(c.strategy)}</td><td>{c.max_tokens:,}</td><td>{m}</td><td>{c.tokens_per_second / 1e3:,.0f}</td>"
                    f"<td>{c.peak_memory_gib:.0f}</td><td>{'yes' if c.fits_memory else 'no'}</td><td>{_e(c.note)}</td></tr>")
    rows.append("</table>")
    if a.confirmed:
        rows.append("<p>the best of the grid, planned again over every step:</p><table><tr><th>strategy</th><th>token cap</th>"
                    "<th>micro-batches per rank</th><th>k tokens/s</th><th>peak GiB</th><th>fits</th><th>note</th></tr>")
        for c in a.confirmed:
            m = str(c.num_micro_batches) if c.num_micro_batches else f"own ({c.micro_batches_mean:.1f})"
            rows.append(f"<tr><td>{_e(c.strategy)}</td><td>{c.max_tokens:,}</td><td>{m}</td><td>{c.tokens_per_second / 1e3:,.0f}</td>"
                        f"<td>{c.peak_memory_gib:.0f}</td><td>{'yes' if c.fits_memory else 'no'}</td><td>{_e(c.note)}</td></tr>")
        rows.append("</table>")
    if a.grouping_candidates:
        rows.append("<table><tr><th>grouping</th><th>step time total (s)</th><th>vs homogeneous</th><th>vs fastest baseline</th><th>note</th></tr>")
        for g in a.grouping_candidates:
            rows.append(f"<tr><td>{_e(g.description)}</td><td>{g.step_time_total:,.1f}</td><td>{g.gain_vs_homogeneous:.2f}x</td>"
                        f"<td>{g.gain_vs_baseline:.2f}x</td><td>{_e(g.note)}</td></tr>")
        rows.append("</table>")
    rows.append("</details>")
    return "".join(rows)


def render_html(report: Report, images: dict[str, str | Path]) -> str:
    """The page; `images` maps a caption to a PNG path (read and inlined)."""
    s, L = report.settings, report.lengths
    ok = [f for f in report.strategies if f.status == "ok"]
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>packloader report: {_e(s.input)}</title><style>{_CSS}</style></head><body>",
        f"<h1>packloader balance report</h1><p class='note'>{_e(s.input)}</p>",
        "<h2>Settings</h2><dl>",
        f"<dt>layout</dt><dd>dp={s.dp} pp={s.pp} cp={s.cp} tp={s.tp} ({s.gpus} GPUs), schedule {_e(s.schedule)}</dd>",
        f"<dt>model</dt><dd>{_e(s.model)} (cost profile {_e(s.cost_profile)}, {_e(s.device)})</dd>",
        f"<dt>steps</dt><dd>{s.steps} steps of {s.tokens_per_step:,} tokens, micro-batch cap {s.max_tokens:,}, "
        f"context {s.context:,}, seed {s.seed}</dd>",
        f"<dt>documents</dt><dd>{L.documents:,} ({L.tokens:,} tokens), median {L.median:,.0f}, p99 {L.p99:,.0f}, "
        f"max {L.max:,}; the longest {L.long_doc_share:.0%} hold {L.long_token_share:.0%} of tokens and "
        f"{L.long_attention_share:.0%} of attention work</dd></dl>",
    ]
    a = report.advice
    if a is not None:
        parts.append(f"<h2>Advice</h2><p class='note'>{_e(ADVICE_SCOPE)}</p><ul>")
        parts.append(f"<li><b>strategy {_e(a.strategy)}</b>: {_e(a.reason)}</li>")
        parts.append(f"<li><b>settings</b>: {_e(a.settings_text())}</li>")
        if a.grouping is not None:
            parts.append(f"<li><b>heterogeneous grouping</b>: {_e(a.grouping_text())}</li>")
        parts += [f"<li class='note'>{_e(n)}</li>" for n in a.notes]
        parts.append("</ul>")
        parts.append(_grid_table(a))
    parts.append("<h2>Figures</h2><table><tr><th></th>")
    parts += [f"<th class='{'pk' if f.role == 'packloader' else ''}' title='{_e(f.description)}'>{_e(f.name)}</th>" for f in ok]
    parts.append("</tr>")
    for label, get in rows_for(report):
        tip = EXPLAIN.get(label, "")
        parts.append(f"<tr><td title='{_e(tip)}'>{_e(label)}</td>" + "".join(f"<td>{_e(get(f))}</td>" for f in ok) + "</tr>")
    parts.append("</table>")
    parts += [f"<p class='note'>skipped {_e(f.name)}: {_e(f.note)}</p>" for f in report.strategies if f.status != "ok"]
    parts.append("<dl class='note'>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in EXPLAIN.items()) + "</dl>")
    for caption, path in images.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        parts.append(f"<h2>{_e(caption)}</h2><img alt='{_e(caption)}' src='data:image/png;base64,{data}'>")
    parts += [f"<p class='note'>{_e(n)}</p>" for n in report.notes]
    parts.append("</body></html>")
    return "\n".join(parts)
