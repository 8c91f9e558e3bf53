"""An independent checker for plans: it trusts nothing a planner computed and raises `PlanError` with a
message naming the step, rank, micro-batch and document at the first kind of violation it finds.

Checked (`verify_plan`):

* coverage: every token of every expected piece appears exactly once over the run (delayed ones in a later
  step), in the plans or, when a final planner state is given, still queued in it; no token outside the
  pieces; no segment empty or reversed;
* the token cap: no micro-batch holds more than `max_tokens` tokens (a DP-Merge micro-batch shared by g ranks
  holds at most max_tokens per rank, i.e. ceil(n / g) <= max_tokens);
* slices (attend_from < start): only when slicing is allowed; the prefix attend_from..start-1 lies in earlier
  micro-batches of the same step and rank (or the same DP-Merge group), as segments of the same slice chain
  (same attend_from), the last of which ends at `start`; a slice never attends across the start of an
  independent piece;
* shape: every step has `dp` ranks (when given), every rank the same number of micro-batches, steps in
  increasing order, backward orders are permutations, DP-Merge groups name valid ranks including the holder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from packloader.contracts import PlannerState, StepPlan


class PlanError(ValueError):
    """A plan breaks the planner contract."""


@dataclass(frozen=True)
class Coverage:
    """Token accounting of a run against its expected pieces."""

    expected_tokens: int
    planned_tokens: int  # tokens in plans (counted once per DP-Merge micro-batch)
    queued_tokens: int
    missing_tokens: int  # expected, neither planned nor queued
    duplicated_tokens: int  # planned or queued more than once
    extra_tokens: int  # planned or queued but not expected
    first_problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.missing_tokens == 0 and self.duplicated_tokens == 0 and self.extra_tokens == 0


def _pieces_array(pieces) -> np.ndarray:
    """(N, 3) int64 array of (doc, offset, length) from a Window, a sequence of Windows, or triples."""
    if pieces is None:
        return np.zeros((0, 3), np.int64)
    if hasattr(pieces, "doc") and hasattr(pieces, "length"):
        return np.stack([np.asarray(pieces.doc), np.asarray(pieces.offset), np.asarray(pieces.length)], axis=1).astype(np.int64).reshape(-1, 3)
    if isinstance(pieces, np.ndarray):
        return pieces.astype(np.int64).reshape(-1, 3)
    items = list(pieces)
    if items and isinstance(getattr(items[0], "doc", None), np.ndarray):  # a list of Windows
        return np.concatenate([_pieces_array(w) for w in items])
    rows = [(int(p.doc), int(p.offset), int(p.length)) if hasattr(p, "doc") else tuple(int(x) for x in p) for p in items]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def _seg(s) -> str:
    return f"(doc {s.doc}, start {s.start}, end {s.end}, attend_from {s.attend_from})"


def _plans_list(plans: StepPlan | Iterable[StepPlan]) -> list[StepPlan]:
    return [plans] if isinstance(plans, StepPlan) else list(plans)


def _unique_micro_batches(plan: StepPlan):
    """(rank, index, micro-batch) once each: a DP-Merge micro-batch listed by several ranks counts once."""
    seen: set = set()
    for r, rank in enumerate(plan.ranks):
        for i, mb in enumerate(rank.micro_batches):
            if mb.dp_group and len(mb.dp_group) > 1:
                key = (tuple(mb.dp_group), tuple(mb.segments))
                if key in seen:
                    continue
                seen.add(key)
            yield r, i, mb


def owned_segments(mb, r: int):
    """The segments of micro-batch `mb` that pool GPU `r` owns: all of them in a fixed-CP plan; in a per-document
    CP plan (`mb.cp`) those whose subgroup starts at r, so a segment listed by each GPU of its group counts once."""
    if mb.cp is None:
        return mb.segments
    return [s for s, c in zip(mb.segments, mb.cp) if c.first == r]


def _merge(intervals: np.ndarray) -> np.ndarray:
    """Union of (doc, start, end) rows, as sorted disjoint maximal rows."""
    if len(intervals) == 0:
        return intervals.reshape(0, 3)
    iv = intervals[np.lexsort((intervals[:, 1], intervals[:, 0]))]
    out = []
    d, s, e = (int(x) for x in iv[0])
    for doc, st, en in iv[1:]:
        if doc == d and st <= e:
            e = max(e, int(en))
        else:
            out.append((d, s, e))
            d, s, e = int(doc), int(st), int(en)
    out.append((d, s, e))
    return np.asarray(out, dtype=np.int64)


def _total(iv: np.ndarray) -> int:
    return int((iv[:, 2] - iv[:, 1]).sum()) if len(iv) else 0


def _intersection_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens in both unions (both merged and sorted)."""
    i = j = 0
    tot = 0
    while i < len(a) and j < len(b):
        if a[i, 0] != b[j, 0]:
            if a[i, 0] < b[j, 0]:
                i += 1
            else:
                j += 1
            continue
        lo = max(a[i, 1], b[j, 1])
        hi = min(a[i, 2], b[j, 2])
        if hi > lo:
            tot += int(hi - lo)
        if a[i, 2] < b[j, 2]:
            i += 1
        else:
            j += 1
    return tot


def _diff_examples(a: np.ndarray, b: np.ndarray, limit: int = 3) -> list[tuple[int, int, int]]:
    """A few (doc, start, end) ranges of union a not in union b."""
    out = []
    j = 0
    for doc, s, e in a:
        cur = int(s)
        while j < len(b) and (b[j, 0] < doc or (b[j, 0] == doc and b[j, 2] <= cur)):
            j += 1
        k = j
        while k < len(b) and b[k, 0] == doc and b[k, 1] < e:
            if b[k, 1] > cur:
                out.append((int(doc), cur, int(b[k, 1])))
            cur = max(cur, int(b[k, 2]))
            k += 1
        if cur < e:
            out.append((int(doc), cur, int(e)))
        if len(out) >= limit:
            break
    return out[:limit]


def coverage(plans: StepPlan | Iterable[StepPlan], pieces, final_state: PlannerState | None = None) -> Coverage:
    """Count expected, planned, queued, missing, duplicated and extra tokens (never raises)."""
    plans = _plans_list(plans)
    exp = _pieces_array(pieces)
    exp_iv = np.stack([exp[:, 0], exp[:, 1], exp[:, 1] + exp[:, 2]], axis=1) if len(exp) else np.zeros((0, 3), np.int64)
    rows = []
    for p in plans:
        for r, _, mb in _unique_micro_batches(p):
            for s in owned_segments(mb, r):
                rows.append((s.doc, s.start, s.end))
    planned = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    qrows = [(q.doc, q.offset, q.offset + q.length) for q in (final_state.queued if final_state else [])]
    queued = np.asarray(qrows, dtype=np.int64).reshape(-1, 3)
    allrows = np.concatenate([planned, queued])
    got_u = _merge(allrows)
    exp_u = _merge(exp_iv)
    raw = int((allrows[:, 2] - allrows[:, 1]).clip(min=0).sum()) if len(allrows) else 0
    dup = raw - _total(got_u)
    both = _intersection_tokens(got_u, exp_u)
    missing = _total(exp_u) - both
    extra = _total(got_u) - both
    problems = []
    if dup:
        problems.append(f"{dup} tokens appear more than once")
    if missing:
        problems.append(f"{missing} tokens of the drawn pieces appear nowhere, e.g. (doc, start, end) {_diff_examples(exp_u, got_u)}")
    if extra:
        problems.append(f"{extra} planned tokens belong to no drawn piece, e.g. (doc, start, end) {_diff_examples(got_u, exp_u)}")
    return Coverage(
        expected_tokens=_total(exp_iv), planned_tokens=_total(planned), queued_tokens=_total(queued),
        missing_tokens=missing, duplicated_tokens=dup, extra_tokens=extra, first_problems=tuple(problems),
    )


def _duplicate_examples(plans: list[StepPlan], final_state: PlannerState | None, limit: int = 3) -> list[str]:
    rows = []
    for p in plans:
        for r, i, mb in _unique_micro_batches(p):
            for s in owned_segments(mb, r):
                rows.append((s.doc, s.start, s.end, f"step {p.step} rank {r} micro-batch {i}"))
    for q in (final_state.queued if final_state else []):
        rows.append((q.doc, q.offset, q.offset + q.length, "the final queue"))
    rows.sort(key=lambda x: (x[0], x[1]))
    out = []
    last: dict[int, tuple[int, str]] = {}
    for doc, s, e, where in rows:
        if doc in last and s < last[doc][0]:
            out.append(f"doc {doc} tokens {s}..{min(e, last[doc][0]) - 1} in {last[doc][1]} and in {where}")
            if len(out) >= limit:
                break
        if doc not in last or e > last[doc][0]:
            last[doc] = (e, where)
    return out


class _PieceStarts:
    """Sorted piece starts per doc, to reject slices that attend across an independent piece's start; looked up
    by binary search (no per-document work up front: most plans hold no slice)."""

    def __init__(self, exp: np.ndarray) -> None:
        e = exp[np.lexsort((exp[:, 1], exp[:, 0]))] if len(exp) else exp.reshape(0, 3)
        self.docs, self.starts = e[:, 0], e[:, 1]

    def get(self, doc: int) -> np.ndarray | None:
        a, b = np.searchsorted(self.docs, doc, "left"), np.searchsorted(self.docs, doc, "right")
        return self.starts[a:b] if b > a else None


def _piece_starts(exp: np.ndarray) -> _PieceStarts:
    return _PieceStarts(exp)


def _check_slice(where: str, s, i: int, ends: dict, piece_starts: _PieceStarts, allow_slicing: bool) -> None:
    """The slice rules for segment `s` of micro-batch i; `ends` maps (doc, end) of this rank's earlier segments
    to (micro-batch index, attend_from)."""
    if not allow_slicing:
        raise PlanError(f"{where}: doc {s.doc} tokens {s.start}..{s.end - 1} are a slice (attend_from {s.attend_from} < start) but slicing is not allowed")
    prev = ends.get((s.doc, s.start))
    if prev is None:
        raise PlanError(
            f"{where}: slice of doc {s.doc} tokens {s.start}..{s.end - 1} attends from {s.attend_from}, "
            f"but no earlier micro-batch of this rank in this step ends that document at {s.start}"
        )
    if prev[1] != s.attend_from:
        raise PlanError(
            f"{where}: slice of doc {s.doc} at {s.start} attends from {s.attend_from} but the slice before it "
            f"(micro-batch {prev[0]}) starts its chain at {prev[1]}: slices of one piece share attend_from"
        )
    if prev[0] == i:
        raise PlanError(f"{where}: slice of doc {s.doc} at {s.start} and its prefix sit in the same micro-batch; a slice's prefix must be in an earlier one")
    starts = piece_starts.get(s.doc)
    if starts is not None:
        k = np.searchsorted(starts, s.start, side="right") - 1
        if k >= 0 and s.attend_from < starts[k]:
            raise PlanError(f"{where}: slice of doc {s.doc} at {s.start} attends from {s.attend_from}, across the start {int(starts[k])} of an independent piece")


def _check_rank(where_step: str, r: int, rank, num_ranks: int, piece_starts: _PieceStarts,
                max_tokens: int | None, allow_slicing: bool) -> int:
    """Every rule on one rank's micro-batches; returns the number of slices."""
    m = len(rank.micro_batches)
    if rank.backward_order is not None and sorted(rank.backward_order) != list(range(m)):
        raise PlanError(f"{where_step} rank {r}: backward_order {rank.backward_order} is not a permutation of range({m})")
    slices = 0
    ends: dict[tuple[int, int], tuple[int, int]] = {}
    for i, mb in enumerate(rank.micro_batches):
        where = f"{where_step} rank {r} micro-batch {i}"
        group = mb.dp_group
        if group is not None and len(group) > 1:
            if any(g < 0 or g >= num_ranks for g in group) or r not in group or len(set(group)) != len(group):
                raise PlanError(f"{where}: dp_group {group} must be distinct ranks of 0..{num_ranks - 1} including {r}")
        g = len(group) if group else 1
        n = 0
        sizes = [c.size for c in mb.cp] if mb.cp is not None else [1] * len(mb.segments)
        for s, size in zip(mb.segments, sizes):
            if s.start < 0 or s.end <= s.start:
                raise PlanError(f"{where}: segment {_seg(s)} of doc {s.doc} is empty or reversed")
            if s.attend_from < 0 or s.attend_from > s.start:
                raise PlanError(f"{where}: segment {_seg(s)} has attend_from {s.attend_from} outside 0..start={s.start}")
            n += -(-(s.end - s.start) // size)  # per-document CP: this GPU's shard
            if s.attend_from < s.start:
                slices += 1
                _check_slice(where, s, i, ends, piece_starts, allow_slicing)
            ends[(s.doc, s.end)] = (i, s.attend_from)
        if max_tokens is not None and -(-n // g) > max_tokens:
            raise PlanError(f"{where} holds {n} tokens{f' over {g} ranks' if g > 1 else ''}, more than max_tokens={max_tokens}")
    return slices


def _check_placements(where_step: str, plan: StepPlan) -> None:
    """A per-document CP plan's shape: one placement per segment, a power-of-two size, aligned, within the pool,
    and each segment listed with its placement in the same micro-batch of exactly its subgroup's GPUs."""
    pool = len(plan.ranks)
    holders: dict = {}
    for r, rank in enumerate(plan.ranks):
        for i, mb in enumerate(rank.micro_batches):
            where = f"{where_step} pool GPU {r} micro-batch {i}"
            if mb.cp is None or len(mb.cp) != len(mb.segments):
                raise PlanError(f"{where}: a per-document CP plan needs one CP placement per segment, got "
                                f"{None if mb.cp is None else len(mb.cp)} for {len(mb.segments)} segments")
            for s, c in zip(mb.segments, mb.cp):
                if c.size < 1 or c.size & (c.size - 1) or c.first % c.size or c.first + c.size > pool \
                        or not c.first <= r < c.first + c.size:
                    raise PlanError(f"{where}: segment {_seg(s)} placed on GPUs {c.first}..{c.first + c.size - 1}; "
                                    f"expected a power-of-two size, first a multiple of it, within the pool of {pool} "
                                    f"GPUs and including GPU {r}")
                holders.setdefault((i, s, c), set()).add(r)
    for (i, s, c), gpus in holders.items():
        if gpus != set(range(c.first, c.first + c.size)):
            raise PlanError(f"{where_step} micro-batch {i}: segment {_seg(s)} placed on GPUs {c.first}.."
                            f"{c.first + c.size - 1} is listed by GPUs {sorted(gpus)}; expected each of its GPUs once")


def verify_plan(
    plans: StepPlan | Iterable[StepPlan],
    pieces=None,
    max_tokens: int | None = None,
    *,
    allow_slicing: bool = True,
    final_state: PlannerState | None = None,
    dp: int | None = None,
    check_coverage: bool = True,
) -> dict[str, int]:
    """Raise PlanError on the first kind of violation; return a summary (steps, tokens, micro-batches, slices).

    `pieces`: everything drawn over the run, as a Window, a list of Windows, or (doc, offset, length) triples
    (None skips the coverage and piece-boundary checks). `final_state`: the planner state after the last
    step, whose queue holds what is still delayed (None: everything must have been planned). `check_coverage`
    False leaves the token coverage to the caller (`planners.contract` checks it vectorized, per step).
    """
    plans = _plans_list(plans)
    exp = _pieces_array(pieces)
    piece_starts = _piece_starts(exp)
    last_step = None
    n_tokens = n_mbs = n_slices = 0
    for p in plans:
        where_step = f"step {p.step}"
        if last_step is not None and p.step <= last_step:
            raise PlanError(f"{where_step} comes after step {last_step}: steps must increase")
        last_step = p.step
        if dp is not None and len(p.ranks) != dp:
            raise PlanError(f"{where_step} has {len(p.ranks)} ranks, expected dp={dp}")
        counts = [len(r.micro_batches) for r in p.ranks]
        if len(set(counts)) > 1:
            raise PlanError(f"{where_step}: ranks hold different numbers of micro-batches {counts}; every rank must run the same count")
        for r, rank in enumerate(p.ranks):
            n_slices += _check_rank(where_step, r, rank, len(p.ranks), piece_starts, max_tokens, allow_slicing)
        if p.cp_mode == "dynamic":
            _check_placements(where_step, p)
        for r, _, mb in _unique_micro_batches(p):
            n_mbs += 1
            n_tokens += sum(s.end - s.start for s in owned_segments(mb, r))
    if check_coverage and (len(exp) or pieces is not None):
        cov = coverage(plans, exp, final_state)
        if not cov.ok:
            detail = "; ".join(cov.first_problems)
            if cov.duplicated_tokens:
                detail += "; " + "; ".join(_duplicate_examples(plans, final_state))
            raise PlanError(f"token coverage broken: {detail}")
    return {"steps": len(plans), "tokens": n_tokens, "micro_batches": n_mbs, "slices": n_slices}
