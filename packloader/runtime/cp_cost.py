"""The cost estimate that context-parallel sharding balances (`collate.cp_sequence_shards.CPCost`), built from a cost model.

Sharding lives in collate and knows no cost model; the runtime and the integrations, which know the model, build
its estimate here and pass it in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from packloader.collate.cp_sequence_shards import CPCost, TileEstimate

DEFAULT_MODEL = "llama3-8b"  # the measured H100 profile


class CostModelEstimate:
    """A `CostModel`'s attention time per query run and its linear time (forward + backward) per rank."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def segment_times(self, q, p):
        return self.model.segment_times(np.asarray(q, dtype=np.int64), np.asarray(p, dtype=np.int64))

    def linear(self, n: float) -> float:
        from packloader.balancers.cost.coeffs import lin_time

        c = self.model.coeffs
        return float(lin_time(c, float(n), False) + lin_time(c, float(n), True))


class AttentionOnly:
    """An estimate that gives attention times only: the linear part counts as 0 (as with `remapped=True`)."""

    def __init__(self, estimate: Any) -> None:
        self.estimate = estimate

    def segment_times(self, q, p):
        return self.estimate.segment_times(q, p)

    def linear(self, n: float) -> float:
        return 0.0


_DEFAULT: list[CostModelEstimate] = []


def cp_cost(model: Any = None) -> CPCost:
    """The CP sharding estimate of `model`: None (the llama3-8b preset, loaded once), a `CostModel`, a preset name,
    a profile path or `CostProfile`, or an object that already has `segment_times(q, p)` (with `linear(n)`, else
    attention only). A model that does not load raises its error."""
    from packloader.balancers.cost.resolve import load_cost_model

    if model is None:
        if not _DEFAULT:
            _DEFAULT.append(CostModelEstimate(load_cost_model(DEFAULT_MODEL)))
        return _DEFAULT[0]
    if isinstance(model, (CostModelEstimate, AttentionOnly, TileEstimate)):
        return model
    if hasattr(model, "coeffs") and hasattr(model, "segment_times"):
        return CostModelEstimate(model)
    if callable(getattr(model, "segment_times", None)):
        return model if callable(getattr(model, "linear", None)) else AttentionOnly(model)
    return CostModelEstimate(load_cost_model(model))
