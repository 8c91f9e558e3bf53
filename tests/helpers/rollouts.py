"""Rollout lengths the RL tests share: uniform, log-normal, a long Pareto tail, and RL responses of which a tenth
hit the generation limit; seeded."""

from __future__ import annotations

import numpy as np


def lengths_of(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(64, 4096, n)
    if kind == "lognormal":
        return np.minimum(rng.lognormal(7.5, 1.0, n).astype(np.int64) + 1, 16384)
    if kind == "longtail":
        return np.minimum((rng.pareto(1.2, n) * 600).astype(np.int64) + 64, 16384)
    r = rng.integers(200, 1500, n)  # RL: a tenth of the responses hit the generation limit
    r[rng.random(n) < 0.1] = 16000
    return r


KINDS = ["uniform", "lognormal", "longtail", "rl-truncated"]
