"""The report's PNGs (matplotlib, Agg backend, no display needed). Each plot has a title, axis labels with
units and a one-line takeaway under the title, written for a reader who has never heard of imbalance degree."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

COLORS = {"baseline": "#9a9a9a", "packloader": "#1f77b4"}
DPI = 100


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _title(fig, ax, title: str, takeaway: str) -> None:
    """Title and takeaway at fixed distances (inches) from the top, whatever the figure's height."""
    h = fig.get_figheight()
    fig.suptitle(title, fontsize=13, fontweight="bold", x=0.01, ha="left", va="top", y=1 - 0.1 / h)
    fig.text(0.01, 1 - 0.45 / h, takeaway, fontsize=10, ha="left", va="top", color="#333333", wrap=True)


def _save(fig, path: str) -> str:
    """PNG with a 256-colour palette: a third of the size of full colour for these flat-colour plots."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _plt().close(fig)
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)
    return path


def _fmt_tokens(x: float) -> str:
    if x >= 1024 and x % 1024 == 0:
        return f"{int(x) // 1024}K"
    if x >= 1000:
        return f"{x / 1000:.0f}k"
    return f"{x:.0f}"


def plot_lengths(path: str, lengths: np.ndarray, doc_attention: np.ndarray, context: int, takeaway: str) -> str:
    """Documents per length bin (share of documents) next to each bin's share of tokens and of attention work."""
    plt = _plt()
    lengths = np.asarray(lengths, dtype=np.float64)
    lo, hi = max(1.0, lengths.min()), max(2.0, lengths.max())
    edges = np.unique(np.geomspace(lo, hi * 1.0001, 25).round())
    if len(edges) < 2:  # every document has the same length
        edges = np.array([lo, lo + 1.0])
    idx = np.clip(np.searchsorted(edges, lengths, side="right") - 1, 0, len(edges) - 2)
    nb = len(edges) - 1
    docs = np.bincount(idx, minlength=nb) / len(lengths)
    toks = np.bincount(idx, weights=lengths, minlength=nb) / lengths.sum()
    attn = np.bincount(idx, weights=doc_attention, minlength=nb) / max(float(doc_attention.sum()), 1e-300)
    fig, ax = plt.subplots(figsize=(10, 5.2))
    fig.subplots_adjust(top=0.82, bottom=0.13, left=0.08, right=0.98)
    width = np.diff(np.log10(edges))
    x = np.log10(edges[:-1])
    w3 = width / 3.2
    ax.bar(x, docs * 100, width=w3, align="edge", color="#bbbbbb", label="share of documents")
    ax.bar(x + w3, toks * 100, width=w3, align="edge", color="#6baed6", label="share of tokens")
    ax.bar(x + 2 * w3, attn * 100, width=w3, align="edge", color="#d62728", label="share of attention work (time)")
    ticks = [t for t in (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576) if lo / 2 <= t <= hi * 2]
    ax.set_xticks(np.log10(ticks))
    ax.set_xticklabels([_fmt_tokens(t) for t in ticks])
    if lo <= context <= hi * 1.5:
        ax.axvline(np.log10(context), color="k", ls="--", lw=1)
        ax.text(np.log10(context), ax.get_ylim()[1] * 0.95, f" context {_fmt_tokens(context)}:\n longer documents\n are cut", fontsize=8, va="top")
    ax.set_xlabel("document length (tokens, log scale)")
    ax.set_ylabel("share in this length bin (%)")
    ax.legend(loc="upper left", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    _title(fig, ax, "Document lengths and where the attention work is", takeaway)
    return _save(fig, path)


def plot_costs(path: str, costs: dict[str, np.ndarray], roles: dict[str, str], takeaway: str) -> str:
    """One row per strategy: the time of each micro-batch (forward + backward on one pipeline stage)."""
    plt = _plt()
    names = list(costs)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.55 * len(names) + 1.6))
    fig.subplots_adjust(top=1 - 1.25 / fig.get_figheight(), bottom=0.75 / fig.get_figheight(), left=0.17, right=0.98)
    rng = np.random.default_rng(0)
    for i, n in enumerate(names):
        c = np.asarray(costs[n]) * 1e3
        y = len(names) - 1 - i
        if len(c) == 0:
            continue
        show = c if len(c) <= 3000 else rng.choice(c, 3000, replace=False)
        col = COLORS.get(roles.get(n, ""), "#1f77b4")
        ax.scatter(show, y + rng.uniform(-0.22, 0.22, len(show)), s=6, alpha=0.35, color=col, linewidths=0)
        ax.boxplot([c], positions=[y], vert=False, widths=0.6, whis=(0, 100), showfliers=False,
                   medianprops={"color": "k"}, boxprops={"color": "k"}, whiskerprops={"color": "k"}, capprops={"color": "k"})
        med = float(np.median(c))
        ax.text(c.max(), y + 0.32, f" slowest {c.max() / med:.1f}x the median" if med > 0 else "", fontsize=8, va="center")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{n}\n({roles.get(n, '')})" for n in reversed(names)], fontsize=9)
    ax.set_xlabel("time of one micro-batch, forward + backward on one pipeline stage (ms)")
    ax.grid(axis="x", alpha=0.3)
    top = max((float(np.max(v)) for v in costs.values() if len(v)), default=1.0) * 1e3
    ax.set_xlim(0, top * 1.2)
    ax.set_title("each dot is one micro-batch of one step; box: middle half, line: median, whiskers: min to max", fontsize=9, loc="left", color="#555555")
    _title(fig, ax, "How even are the micro-batches?", takeaway)
    return _save(fig, path)


def plot_summary(path: str, names: Sequence[str], roles: dict[str, str], tokens_per_s: Sequence[float],
                 bound_tokens_per_s: Sequence[float], step_ms: Sequence[float], flags: dict[str, str], gpus: int,
                 takeaway: str) -> str:
    """Simulated throughput per strategy next to what the no-bubble ideal would give; `flags` marks strategies
    with a caveat (e.g. over the memory budget) with a hatched bar and the reason."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.5 * len(names) + 1.6))
    fig.subplots_adjust(top=1 - 1.25 / fig.get_figheight(), bottom=0.75 / fig.get_figheight(), left=0.17, right=0.98)
    y = np.arange(len(names))[::-1]
    k = np.asarray(tokens_per_s) / 1e3
    for yi, n, v in zip(y, names, k):
        col = COLORS.get(roles.get(n, ""), "#1f77b4")
        ax.barh(yi, v, color=col if n not in flags else "white", edgecolor=col, hatch="//" if n in flags else None,
                height=0.6)
    ax.scatter(np.asarray(bound_tokens_per_s) / 1e3, y, marker="|", s=400, color="k", zorder=3, label="no-bubble ideal")
    bk = np.asarray(bound_tokens_per_s) / 1e3
    for yi, n, v, b, ms in zip(y, names, k, bk, step_ms):
        ax.text(max(v, 0) * 0.01, yi, f" {v:,.0f}k tokens/s ({ms:,.0f} ms per step)", va="center", fontsize=8,
                color="white" if n not in flags else "black", bbox=None if n not in flags else {"facecolor": "white", "edgecolor": "none", "pad": 1})
        if n in flags:
            ax.text(max(v, b) * 1.01, yi, f" {flags[n]}", va="center", fontsize=8, color="#d62728")
    ax.set_yticks(y)
    ax.set_yticklabels([f"{n}\n({roles.get(n, '')})" for n in names], fontsize=9)
    ax.set_xlabel(f"simulated training throughput, all {gpus} GPUs (thousand tokens per second)")
    ax.set_xlim(0, max(list(k) + list(bk) + [1e-9]) * (1.5 if flags else 1.08))
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    _title(fig, ax, "Training throughput per strategy (longer is better)", takeaway)
    return _save(fig, path)


def shown_ranks(sim, limit: int) -> list[int]:
    """At most `limit` DP ranks of a step: the slowest one and the first others."""
    n = len(sim.ranks)
    if n <= limit:
        return list(range(n))
    slowest = int(np.argmax([r.step_time for r in sim.ranks]))
    others = [r for r in range(n) if r != slowest][: limit - 1]
    return sorted([slowest, *others])


def plot_timeline(path: str, sims: Sequence[tuple[str, object]], bounds: Sequence[float], step: int, takeaway: str,
                  max_ranks: int = 8) -> str:
    """Gantt chart of one step: a row per (DP rank, pipeline stage), forward and backward of each micro-batch.
    `sims`: (label, simulator.StepSim) panels sharing the time axis; at most `max_ranks` DP ranks are drawn
    (the slowest always)."""
    plt = _plt()
    from matplotlib.patches import Patch

    rows = max(len(shown_ranks(s, max_ranks)) * s.ranks[0].pp for _, s in sims)
    fig, axes = plt.subplots(len(sims), 1, figsize=(11, 1.9 + len(sims) * (0.32 * rows + 0.9)), sharex=True, squeeze=False)
    fig.subplots_adjust(top=1 - 1.6 / fig.get_figheight(), bottom=0.9 / fig.get_figheight(), left=0.13, right=0.98, hspace=0.7 / (0.32 * rows + 0.2))
    tmax = max(s.step_time for _, s in sims) * 1e3
    for ax, (label, sim), bound in zip(axes[:, 0], sims, bounds):
        ylabels = []
        row = 0
        ranks = shown_ranks(sim, max_ranks)
        for i, r in enumerate(ranks):
            res = sim.ranks[r]
            for s in range(res.pp):
                y = -row
                ylabels.append((y, f"rank {r} stage {s}"))
                for v in range(s, res.pp * res.vpp, res.pp):
                    for u in range(res.m):
                        for kind, col in ((0, "#6baed6"), (1, "#fd8d3c")):
                            a, b = res.start[v, u, kind] * 1e3, res.finish[v, u, kind] * 1e3
                            ax.barh(y, b - a, left=a, height=0.8, color=col, edgecolor="white", linewidth=0.4)
                            if b - a > tmax / 45:
                                ax.text((a + b) / 2, y, str(u), ha="center", va="center", fontsize=6)
                row += 1
            if i < len(ranks) - 1:
                ax.axhline(-row + 0.5, color="#444444", lw=0.6)
        ax.axvline(sim.step_time * 1e3, color="#d62728", lw=1.2)
        ax.axvline(bound * 1e3, color="k", ls="--", lw=1)
        ax.set_yticks([y for y, _ in ylabels])
        ax.set_yticklabels([t for _, t in ylabels], fontsize=7)
        more = f"; {len(ranks)} of {len(sim.ranks)} DP ranks shown" if len(ranks) < len(sim.ranks) else ""
        ax.set_title(f"{label}: step ends at {sim.step_time * 1e3:,.0f} ms (when its slowest rank does){more}", fontsize=10, loc="left")
        ax.set_xlim(0, tmax * 1.02)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time within the step (ms); numbers are micro-batch indices")
    fig.legend(handles=[Patch(color="#6baed6", label="forward"), Patch(color="#fd8d3c", label="backward"),
                        Patch(color="#d62728", label="step end"), Patch(facecolor="white", edgecolor="k", ls="--", label="no-bubble ideal")],
               loc="lower right", ncol=4, fontsize=8, frameon=False)
    _title(fig, axes[0, 0], f"One step ({step}) on every GPU: pipeline timeline per DP rank and stage", takeaway)
    return _save(fig, path)


def is_png(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"
