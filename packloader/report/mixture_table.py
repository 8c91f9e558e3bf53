"""A mixture's entries in the report: each entry's length distribution, its share of tokens and of GPU time, and
its delay, over the steps the report planned (documents are positions in the blend's order, as the report's)."""

from __future__ import annotations

import msgspec
import numpy as np

from packloader.balancers.sim.metrics import drawn_steps
from packloader.contracts import PlanConfig


class EntryRow(msgspec.Struct, kw_only=True):
    name: str
    target_share: float  # the entry's share of tokens by its weight or quota
    documents: int  # drawn in the steps planned
    tokens: int
    token_share: float
    gpu_share: float  # of the cost model's forward + backward time of every drawn piece (attention + linear)
    length_mean: float
    length_p50: float
    length_p90: float
    length_p99: float
    length_max: int
    delay_mean: float  # steps between a token's draw and its training, token-weighted
    delayed_share: float  # of the entry's trained tokens, those trained after their draw step


def entry_rows(lengths: np.ndarray, entries: np.ndarray, names: list[str], targets: np.ndarray, plans, windows,
               config: PlanConfig, model) -> list[EntryRow]:
    """Rows over the documents the planned steps drew (`windows`: each step's pieces; `plans`: their plans)."""
    lengths, entries = np.asarray(lengths, np.int64), np.asarray(entries, np.int64)
    drawn = drawn_steps(windows)
    docs = np.fromiter(drawn, np.int64, len(drawn))
    piece_docs = np.concatenate([w.doc for w in windows]) if windows else np.zeros(0, np.int64)
    piece_len = np.concatenate([w.length for w in windows]) if windows else np.zeros(0, np.int64)
    piece_time = model.doc_time(piece_len)  # each piece alone: attention + its linear share, no floor
    total_tokens = max(1, int(lengths[docs].sum()))
    total_time = float(piece_time.sum()) or 1.0
    delay_tok = np.zeros(len(names))
    delayed = np.zeros(len(names))
    trained = np.zeros(len(names))
    for plan in plans:
        seen = set()
        for rank in plan.ranks:
            for mb in rank.micro_batches:
                for s in mb.segments:
                    if (s.doc, s.start, s.end) in seen:
                        continue
                    seen.add((s.doc, s.start, s.end))
                    e, q, late = int(entries[s.doc]), s.end - s.start, plan.step - drawn.get(s.doc, plan.step)
                    trained[e] += q
                    delay_tok[e] += q * late
                    delayed[e] += q if late > 0 else 0
    rows = []
    for e, name in enumerate(names):
        mine = docs[entries[docs] == e]
        lens = lengths[mine]
        pct = np.percentile(lens, [50, 90, 99]) if len(lens) else np.zeros(3)
        rows.append(EntryRow(
            name=name, target_share=float(targets[e]), documents=len(mine), tokens=int(lens.sum()),
            token_share=float(lens.sum()) / total_tokens,
            gpu_share=float(piece_time[entries[piece_docs] == e].sum()) / total_time,
            length_mean=float(lens.mean()) if len(lens) else 0.0, length_p50=float(pct[0]),
            length_p90=float(pct[1]), length_p99=float(pct[2]), length_max=int(lens.max()) if len(lens) else 0,
            delay_mean=float(delay_tok[e] / trained[e]) if trained[e] else 0.0,
            delayed_share=float(delayed[e] / trained[e]) if trained[e] else 0.0))
    return rows


def render_entries(rows: list[EntryRow], strategy: str) -> str:
    head = (f"mixture entries (delay as {strategy} plans them):\n"
            f"{'entry':<16}{'target':>8}{'tokens':>8}{'GPU':>8}{'docs':>9}{'mean':>9}{'p50':>8}{'p90':>8}{'p99':>9}"
            f"{'max':>9}{'delay':>8}{'late':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r.name:<16}{r.target_share:>8.3f}{r.token_share:>8.3f}{r.gpu_share:>8.3f}{r.documents:>9,}"
                     f"{r.length_mean:>9.0f}{r.length_p50:>8.0f}{r.length_p90:>8.0f}{r.length_p99:>9.0f}"
                     f"{r.length_max:>9,}{r.delay_mean:>8.3f}{r.delayed_share:>7.3f}")
    lines.append("target/tokens/GPU: shares of the drawn tokens and of their predicted GPU time; delay: mean steps "
                 "from a token's draw to its training; late: share of the entry's tokens trained after their draw step")
    return "\n".join(lines)
