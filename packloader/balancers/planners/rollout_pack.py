"""Array functions behind `balance_rollouts` and the verl adapter: sequences already in memory (RL rollouts) over DP
ranks and micro-batches, by the attention-aware cost model, never over a micro-batch's token cap.

The pieces are the existing kernels: verl's largest differencing method (`ldm_kernels.karmarkar_karp`), Hydraulis'
capped longest-workload-first packing (`hydraulis_kernels.hydraulis_pack`), then `refine_kernels.refine_partition`,
which only ever lowers the heaviest partition, so an answer is never worse than the one it started from."""

from __future__ import annotations

import numpy as np

from packloader.balancers.planners.hydraulis_kernels import hydraulis_pack
from packloader.balancers.planners.ldm_kernels import karmarkar_karp
from packloader.balancers.planners.refine_kernels import refine_partition, repair_cap

PARTNERS = 16  # lightest partitions the refinement tries against the heaviest, each round
PAIR_ITEMS_MAX = 64  # items per partition on average up to which the refinement also trades one item for two
INT_SPAN = float(1 << 50)  # float workloads are scaled to integers this large for the LDM kernel (exact in float64)
NO_CAP = np.iinfo(np.int64).max // 4
EXACT = 1 << 53  # integers float64 holds exactly


def as_int_values(work: np.ndarray) -> np.ndarray:
    """Float workloads as int64 for the LDM kernel, the total scaled to at most 2^50 (order and ratios kept)."""
    work = np.asarray(work, np.float64)
    total = float(work.sum())
    return np.rint(work * (INT_SPAN / total)).astype(np.int64) if total > 0 else np.zeros(len(work), np.int64)


def refine(part: np.ndarray, k: int, work: np.ndarray, *, tokens: np.ndarray | None = None, cap: int = NO_CAP,
           guard: np.ndarray | None = None, guard_cap: float = np.inf, moves: bool = True) -> np.ndarray:
    """`refine_partition` with its defaults: no token cap, no guard; work bounded to a few passes over the items."""
    n = len(part)
    work = np.asarray(work, np.float64)
    tokens = np.zeros(n, np.int64) if tokens is None else np.asarray(tokens, np.int64)
    guard = np.zeros(n, np.float64) if guard is None else np.asarray(guard, np.float64)
    rounds = 4 * k + 2 * n + 16
    pairs = cap < NO_CAP and n <= PAIR_ITEMS_MAX * k  # pair swaps matter under a cap; they cost |j|^2 per item
    return refine_partition(np.asarray(part, np.int64), k, work, tokens, int(cap), guard, float(guard_cap), moves,
                            PARTNERS, rounds, pairs)


def partition_sums(part: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(part, weights=np.asarray(values, np.float64), minlength=k)


def balanced_partitions(values: np.ndarray, k: int, equal_size: bool) -> np.ndarray:
    """Partition of each value over k parts with a small largest sum: verl's LDM (the same answer as its
    `get_seqlen_balanced_partitions`), then moves (swaps only with `equal_size`, so sizes stay n / k). Integer
    values are used as they are; floats are scaled (`as_int_values`)."""
    values = np.asarray(values)
    ints = values.astype(np.int64) if values.dtype.kind in "iub" else as_int_values(values)
    part = karmarkar_karp(ints, k, equal_size)
    if int(ints.sum()) > EXACT:  # the refinement sums in float64: beyond 2^53 a step could be a rounding artefact
        return part
    return refine(part, k, ints.astype(np.float64), moves=not equal_size)


def _fits(part: np.ndarray, lengths: np.ndarray, m: int, cap: int) -> bool:
    return bool((np.bincount(part, weights=lengths, minlength=m) <= cap).all())


def pack_micro_batches(lengths: np.ndarray, work: np.ndarray, cap: int, m: int, coeffs: np.ndarray | None,
                       known: np.ndarray | None = None, polish: bool = True) -> np.ndarray | None:
    """Micro-batch (0..m-1) of each item with the smallest heaviest micro-batch found, every micro-batch within
    `cap` tokens; None when no candidate fits. Candidates: Hydraulis' capped packing (`coeffs` given: the items
    are single sequences priced from their lengths), LDM on `work` (brought within the cap by `repair_cap` where it is
    not), and `known` (a fitting packing into fewer
    micro-batches, the rest left empty); each is refined under the cap (`polish`; without it the first that fits
    is returned as it is: whether a count fits does not depend on the refinement)."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    if n == 0:
        return np.zeros(0, np.int64)
    starts = []
    if coeffs is not None:
        assign, _ = hydraulis_pack(coeffs[None, :], np.zeros(1, np.int64), np.array([cap], np.int64), lengths,
                                   np.zeros(n, np.int64), m)
        if assign[0] >= 0:
            if not polish:
                return assign
            starts.append(assign)
    kk = karmarkar_karp(as_int_values(work), m, False)
    if _fits(kk, lengths, m, cap):
        starts.append(kk)
    else:  # LDM ignores the cap; a few moves out of the micro-batches over it keep most of its balance
        fixed, ok = repair_cap(kk, m, np.asarray(work, np.float64), lengths, cap)
        if ok:
            starts.append(fixed)
    if known is not None:
        starts.append(np.asarray(known, np.int64))
    if not polish:
        return starts[0] if starts else None
    best, best_max = None, np.inf
    for s in starts:
        r = refine(s, m, work, tokens=lengths, cap=cap)
        top = partition_sums(r, work, m).max()
        if top < best_max:
            best, best_max = r, top
    return best


def fit_micro_batches(lengths: np.ndarray, work: np.ndarray, cap: int, m0: int, coeffs: np.ndarray | None,
                      multiple_of: int = 1) -> tuple[int, np.ndarray]:
    """The fewest micro-batches, at least m0 and a multiple of `multiple_of`, that `pack_micro_batches` fits under
    `cap`, and that packing. One item per micro-batch always fits (no item is over the cap), so this ends."""
    lengths = np.asarray(lengths, np.int64)
    n = len(lengths)
    step = max(multiple_of, 1)
    up = lambda v: -(-max(v, 1) // step) * step  # noqa: E731
    if n == 0:
        return (up(m0) if m0 > 0 else 0), np.zeros(0, np.int64)
    m = up(max(m0, int((lengths > cap // 2).sum())))  # two items over half the cap never share one
    hi = up(n)
    got = pack_micro_batches(lengths, work, cap, m, coeffs, polish=False)
    if got is not None:
        return m, pack_micro_batches(lengths, work, cap, m, coeffs, known=got)
    if m >= hi:
        return m, np.arange(n, dtype=np.int64)
    lo = m  # m fails: double the gap towards n, then bisect between the last failure and the first fit
    span = step
    while True:
        m = min(up(lo + span), hi)
        got = pack_micro_batches(lengths, work, cap, m, coeffs, polish=False)
        if got is not None or m >= hi:
            break
        lo, span = m, span * 2
    if got is None:  # one item per micro-batch: always fits
        return hi, np.arange(n, dtype=np.int64)
    while m - lo > step:
        mid = up((lo + m) // 2)
        if mid >= m:
            break
        g = pack_micro_batches(lengths, work, cap, mid, coeffs, polish=False)
        if g is None:
            lo = mid
        else:
            m, got = mid, g
    return m, pack_micro_batches(lengths, work, cap, m, coeffs, known=got)


def rank_micro_batches(lengths: np.ndarray, work: np.ndarray, rank_of: np.ndarray, dp: int, cap: int,
                       min_count: int, multiple_of: int, equal_counts: bool,
                       coeffs: np.ndarray | None) -> list[list[np.ndarray]]:
    """Each rank's micro-batches (arrays of item indices, ascending): every rank the fewest that fit, then with
    `equal_counts` every rank repacked at the largest of those counts (from its own fitting packing, so it fits)."""
    members = [np.flatnonzero(rank_of == r) for r in range(dp)]
    fitted = []
    for ix in members:
        m0 = max(min_count, -(-int(lengths[ix].sum()) // cap))
        fitted.append(fit_micro_batches(lengths[ix], work[ix], cap, m0, coeffs, multiple_of))
    if equal_counts:
        m = max(f[0] for f in fitted) if fitted else 0
        fitted = [(m, f[1] if f[0] == m else pack_micro_batches(lengths[ix], work[ix], cap, m, coeffs, known=f[1]))
                  for ix, f in zip(members, fitted)]
    return [[ix[part == j] for j in range(m)] for ix, (m, part) in zip(members, fitted)]
