"""What the dynamic-cp planner places: a step's pieces as units (whole, SlimPack slices of a piece longer than the
pool holds, or a chain of slices at a smaller CP size than the piece needs whole: `chained`; their memory check:
`doc_cp.chains`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packloader.balancers.planners.packing import Pieces

NAME = "dynamic-cp"


@dataclass
class Units:
    """What the pool runs: unit k is tokens start[k]..end[k]-1 of doc[k] attending from af[k]; `after`/`rest`
    chain a piece's slices (`doc_cp.kernels.place_pieces`); `min_size`: the smallest CP size that fits."""

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
    whole = (units.after < 0) & (units.rest == 0) & (size >= split) & (units.q >= split)
    return cut(units, size, np.where(whole, split, 1), np.where(whole, size // split, size))


def chained_at(units: Units, size: np.ndarray, at: np.ndarray, cap: int) -> tuple[Units, np.ndarray] | None:
    """`units` at CP sizes `size`, every whole unit with at[k] < size[k] run at CP size at[k] instead: as a chain of
    the fewest equal slices whose shards fit `cap` tokens (SlimPack's slices of a piece, beside which short units
    fill the rest of each slot), or whole where one slice holds it; None when no unit changes."""
    at = np.minimum(np.asarray(at, np.int64), size)
    whole = (units.after < 0) & (units.rest == 0)
    change = whole & (at < size)
    if not change.any():
        return None
    k = np.where(change, np.maximum(1, -(-units.q // (at * cap))), 1)
    return cut(units, size, k, np.where(change, at, size))


def cut(units: Units, size: np.ndarray, k: np.ndarray, at: np.ndarray) -> tuple[Units, np.ndarray] | None:
    """Unit i cut into k[i] equal slices (a chain where k[i] > 1) at CP size at[i]; None when nothing changes."""
    rows: list[tuple[int, ...]] = []
    sizes: list[int] = []
    new_of = np.zeros(len(units.q), np.int64)  # each old unit's last row
    changed = False
    for i in range(len(units.q)):
        d, a, b, af = int(units.doc[i]), int(units.start[i]), int(units.end[i]), int(units.af[i])
        n, parts = b - a, int(k[i])
        changed |= bool(parts > 1 or at[i] != size[i])
        if parts <= 1:
            after = int(new_of[units.after[i]]) if units.after[i] >= 0 else -1
            rows.append((d, a, b, af, after, int(units.rest[i]), 0, int(units.min_size[i])))
            sizes.append(int(at[i]))
        else:
            cuts = [a + (n * j) // parts for j in range(parts + 1)]
            for j in range(parts):
                rows.append((d, cuts[j], cuts[j + 1], af, len(rows) - 1 if j else -1, parts - 1 - j, 1, int(at[i])))
                sizes.append(int(at[i]))
        new_of[i] = len(rows) - 1
    if not changed:
        return None
    t = np.array(rows, dtype=np.int64).reshape(-1, 8)
    return Units(t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 4], t[:, 5], t[:, 7], t[:, 6]), np.array(sizes, np.int64)
