"""Axolotl's multipack packers, behind the Planner contract so their plans are scored like every other.

* ``multipack`` (Axolotl's ``MultipackBatchSampler`` since its PR 2631, May 2025, ``pack_parallel`` /
  ``pack_group`` in src/axolotl/utils/samplers/multipack.py; per-bin item limit from the config since PR 3307):
  the step's pieces, in draw order and in groups of ``AXOLOTL_GROUP_SIZE`` pieces, are packed first-fit (no
  sorting, despite the function's "first-fit decreasing" docstring): each piece goes to the first open bin of
  ``max_tokens`` with room and fewer than ``AXOLOTL_BIN_SIZE`` pieces (``sample_packing_bin_size``), else opens a
  bin. Bins are dealt round-robin to DP ranks (bin b to rank ``b % dp`` as its micro-batch ``b // dp``), as
  accelerate's batch-sampler sharding hands consecutive batches (of one bin each, micro-batch size 1) to
  consecutive ranks. Axolotl drops the last incomplete batch (``drop_last``); here ranks without a bin get an
  empty micro-batch, so no token is lost.
* ``multipack_openchat2023`` (OpenChat's 2023 allocator, which Axolotl ran until PR 2631; ``allocate`` as in
  Axolotl commit 03508c68): rounds over the pieces in draw order; each round takes the longest prefix of the
  remaining pieces that first-fit-decreasing packs into ``dp`` bins of ``max_tokens`` (binary search on the prefix
  length, bounded by ``dp x max_tokens`` tokens; ``ffd_check``), packs it with FFD (``ffd_with_result``) and gives
  bin r to rank r. The original drops the last round when it fills fewer than ``dp`` bins; here ranks without a
  bin get an empty micro-batch instead.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from packloader.balancers.planners.base import Model, PackingPlanner, StepLayout
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, whole_pieces_packing
from packloader.balancers.planners.registry import Planner, register_planner
from packloader.contracts import PlanConfig

AXOLOTL_GROUP_SIZE = 100_000  # pieces packed together by one pack_group call (Axolotl's group_size default)
AXOLOTL_BIN_SIZE = 200  # most pieces in one bin (Axolotl's sample_packing_bin_size default)


# ------------------------------------------------------------------------------------------------ multipack


@njit(cache=True)
def ffd_check(lengths, cap, nbins):
    """Whether first-fit-decreasing packs `lengths` into `nbins` bins of `cap` tokens."""
    a = np.sort(lengths)[::-1]
    free = np.full(nbins, cap, np.int64)
    for size in a:
        found = False
        for b in range(nbins):
            if free[b] >= size:
                free[b] -= size
                found = True
                break
        if not found:
            return False
    return True


@njit(cache=True)
def ffd_pack(lengths, cap):
    """First-fit-decreasing with as many bins as needed: (bin of each item, number of bins). Items in
    decreasing length order (ties by index); bins numbered in the order they are opened."""
    n = lengths.shape[0]
    order = np.argsort(-lengths, kind="mergesort")
    free = np.empty(n, np.int64)
    assign = np.empty(n, np.int64)
    nb = 0
    for i in order:
        size = lengths[i]
        b = 0
        while b < nb and free[b] < size:
            b += 1
        if b == nb:
            free[nb] = cap
            nb += 1
        free[b] -= size
        assign[i] = b
    return assign, nb


@njit(cache=True)
def first_fit_pack(lengths, cap, max_items):
    """Axolotl's pack_group: items in the given order, each into the first open bin with `cap - used >= size`
    and fewer than `max_items` items, else into a new bin. Returns (bin of each item, number of bins)."""
    n = lengths.shape[0]
    free = np.empty(n, np.int64)
    count = np.empty(n, np.int64)
    assign = np.empty(n, np.int64)
    nb = 0
    for i in range(n):
        size = lengths[i]
        b = 0
        while b < nb and (free[b] < size or count[b] >= max_items):
            b += 1
        if b == nb:
            free[nb] = cap
            count[nb] = 0
            nb += 1
        free[b] -= size
        count[b] += 1
        assign[i] = b
    return assign, nb


def axolotl_bins(lengths: np.ndarray, cap: int, group_size: int = AXOLOTL_GROUP_SIZE,
                 bin_size: int = AXOLOTL_BIN_SIZE) -> tuple[np.ndarray, int]:
    """Axolotl's pack_parallel: first-fit over consecutive groups of `group_size` items, bins numbered group
    after group. Returns (bin of each item, number of bins)."""
    lengths = np.ascontiguousarray(lengths, np.int64)
    assign = np.empty(len(lengths), np.int64)
    nb = 0
    for g in range(0, len(lengths), group_size):
        a, k = first_fit_pack(lengths[g:g + group_size], cap, bin_size)
        assign[g:g + group_size] = a + nb
        nb += k
    return assign, nb


@njit(cache=True)
def multipack_allocate(lengths, cap, nbins):
    """Axolotl's allocate over the whole sequence: rounds of at most `nbins` bins. Returns (round of each
    item, bin within its round, number of rounds). Each round takes the longest prefix of the remaining items
    that FFD packs into `nbins` bins (binary search, upper-bounded by the prefix holding at most nbins x cap
    tokens) and packs it with FFD."""
    n = lengths.shape[0]
    rnd = np.empty(n, np.int64)
    binof = np.empty(n, np.int64)
    if n == 0:
        return rnd, binof, 0
    cum = np.cumsum(lengths)
    start = 0
    rounds = 0
    used = 0
    while start < n:
        left = 1
        right = 1 + np.searchsorted(cum[start:], used + cap * nbins, side="right")
        if right > n - start + 1:
            right = n - start + 1
        while right - left > 1:
            mid = (left + right) // 2
            if ffd_check(lengths[start:start + mid], cap, nbins):
                left = mid
            else:
                right = mid
        assign, _ = ffd_pack(lengths[start:start + left], cap)
        for i in range(left):
            rnd[start + i] = rounds
            binof[start + i] = assign[i]
        start += left
        used = cum[start - 1]
        rounds += 1
    return rnd, binof, rounds


class MultipackPlanner(PackingPlanner):
    """Axolotl's multipack sampler since its PR 2631 (May 2025): first-fit bins dealt round-robin to DP ranks
    (see the module docstring)."""

    name = "multipack"

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing:
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        check_cap(pieces, cap, self.name)
        binof, nbins = axolotl_bins(pieces.length, cap)
        m = max(-(-nbins // dp), 1, layout.micro_batches or cfg.num_micro_batches or 1)
        rank_mbs = (np.arange(m)[None, :] * dp + np.arange(dp)[:, None]).astype(np.int64)  # bin b: rank b % dp
        return whole_pieces_packing(pieces, binof, rank_mbs, strategy=self.name)


class MultipackOpenChat2023Planner(PackingPlanner):
    """Historical: OpenChat's 2023 multipack allocator, FFD rounds of DP bins (see the module docstring)."""

    name = "multipack_openchat2023"

    def solve(self, pieces: Pieces, layout: StepLayout, model: Model) -> Packing:
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        check_cap(pieces, cap, self.name)
        rnd, binof, rounds = multipack_allocate(pieces.length, cap, dp)
        m = max(rounds, 1, layout.micro_batches or cfg.num_micro_batches or 1)
        piece_mb = rnd * dp + binof  # round j's bin b is micro-batch j of rank b
        rank_mbs = (np.arange(m)[None, :] * dp + np.arange(dp)[:, None]).astype(np.int64)
        return whole_pieces_packing(pieces, piece_mb, rank_mbs, strategy=self.name)


@register_planner("multipack", role="baseline", summary="multipack across ranks (Axolotl)", report_order=30)
def _make_multipack(config: PlanConfig, options: object, model: Model) -> Planner:
    return MultipackPlanner(config, model)


@register_planner("multipack_openchat2023", role="baseline", summary="multipack, 2023 allocator (OpenChat)",
                  report_order=None)
def _make_multipack_2023(config: PlanConfig, options: object, model: Model) -> Planner:
    return MultipackOpenChat2023Planner(config, model)
