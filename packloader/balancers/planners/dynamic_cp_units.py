"""What the dynamic-cp planner places: a step's pieces as units (whole, SlimPack slices of a piece longer than the
pool holds, or a chain of slices at a smaller CP size than the piece needs whole: `chained`; their memory check:
`dynamic_cp_chains`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packloader.balancers.planners.packing import Pieces

NAME = "dynamic-cp"


@dataclass
class Units:
    """What the pool runs: unit k is tokens start[k]..end[k]-1 of doc[k] attending from af[k]; `after`/`rest`
    chain a piece's slices (`dynamic_cp_kernels.place_pieces`); `min_size`: the smallest CP size that fits."""

    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    af: np.ndarray
    after: np.ndarray
    rest: np.ndarray
    min_size: np.ndarray
    link: np.ndarray  # 1 for a chain's slices: one subgroup, consecutive slots (`chained`)

    @property
    def q(self) -> np.ndarray:
        return self.end - self.start

    @property
    def p(self) -> np.ndarray:
        return self.start - self.af


def pow2_at_least(x: np.ndarray) -> np.ndarray:
    x = np.maximum(np.asarray(x, dtype=np.int64), 1)
    return (1 << np.ceil(np.log2(x)).astype(np.int64)).astype(np.int64)


def units_of(pieces: Pieces, cap: int, pool: int, allow_slicing: bool) -> Units:
    """Pieces as units, each longer than the pool's G x cap tokens cut into equal slices (an error naming the
    piece where slicing is not allowed)."""
    rows: list[tuple[int, int, int, int, int, int]] = []
    for d, o, n in zip(pieces.doc.tolist(), pieces.offset.tolist(), pieces.length.tolist()):
        k = -(-n // (pool * cap))
        if k > 1 and not allow_slicing:
            raise ValueError(f"{NAME}: piece (doc {d}, offset {o}) of {n} tokens exceeds the pool's {pool} GPUs x "
                             f"{cap} tokens (max_tokens / cp) with allow_slicing=False; expected pieces of at most "
                             f"{pool * cap} tokens (PlanConfig.context) or allow_slicing=True")
        cuts = [o + (n * j) // k for j in range(k + 1)]
        for j in range(k):
            rows.append((d, cuts[j], cuts[j + 1], o, len(rows) - 1 if j else -1, k - 1 - j))
    a = np.array(rows, dtype=np.int64).reshape(-1, 6)
    units = Units(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5], np.zeros(len(a), np.int64),
                  np.zeros(len(a), np.int64))
    units.min_size = np.where(units.after >= 0, pool, np.minimum(pow2_at_least(-(-units.q // cap)), pool))
    units.min_size[units.rest > 0] = pool
    return units


def chained(units: Units, size: np.ndarray, split: int) -> tuple[Units, np.ndarray] | None:
    """`units` at CP sizes `size` with every whole unit on at least `split` GPUs cut into `split` equal slices at
    size / split GPUs (a chain, `Units.link`: the same tokens per GPU and slot, on one subgroup in consecutive
    slots), and the new units' sizes; None when no unit is that large."""
    rows: list[tuple[int, ...]] = []
    sizes: list[int] = []
    new_of = np.zeros(len(units.q), np.int64)  # each old unit's last row
    cut_any = False
    for k in range(len(units.q)):
        d, a, b, af = int(units.doc[k]), int(units.start[k]), int(units.end[k]), int(units.af[k])
        whole = units.after[k] < 0 and units.rest[k] == 0
        if not whole or size[k] < split or b - a < split:
            after = int(new_of[units.after[k]]) if units.after[k] >= 0 else -1
            rows.append((d, a, b, af, after, int(units.rest[k]), 0, int(units.min_size[k])))
            sizes.append(int(size[k]))
        else:
            n, cut_any, at = b - a, True, int(size[k]) // split
            cuts = [a + (n * j) // split for j in range(split + 1)]
            for j in range(split):
                rows.append((d, cuts[j], cuts[j + 1], af, len(rows) - 1 if j else -1, split - 1 - j, 1, at))
                sizes.append(at)
        new_of[k] = len(rows) - 1
    if not cut_any:
        return None
    t = np.array(rows, dtype=np.int64).reshape(-1, 8)
    return Units(t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 4], t[:, 5], t[:, 7], t[:, 6]), np.array(sizes, np.int64)
