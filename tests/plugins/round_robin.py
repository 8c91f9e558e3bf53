"""A planner added from outside packloader, in this one file: importing it registers it (options, role, summary,
how `auto` may use it), and nothing in the package names it. `packloader plan --plugin plugins.round_robin`,
`packloader report --plugin plugins.round_robin` and `auto` then use it (tests/test_planner_plugin.py)."""

from __future__ import annotations

import msgspec
import numpy as np

from packloader import AutoUse, PackingPlanner, StepLayout, register_planner
from packloader.balancers.planners.packing import Packing, Pieces, check_cap, whole_pieces_packing

NAME = "round_robin_test"


class RoundRobinOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    per_micro_batch: int = 1  # most pieces in one micro-batch


class RoundRobinPlanner(PackingPlanner):
    """Pieces in draw order, up to `per_micro_batch` to a micro-batch while they fit the cap; micro-batch k goes
    to DP rank k % dp, position k // dp."""

    name = NAME

    def __init__(self, config, options: RoundRobinOptions, model) -> None:
        super().__init__(config, model)
        self.per = options.per_micro_batch

    def solve(self, pieces: Pieces, layout: StepLayout, model) -> Packing:
        cfg = self.config
        dp, cap = cfg.parallel.dp, cfg.max_tokens
        check_cap(pieces, cap, self.name)
        mb = np.zeros(len(pieces), np.int64)
        k, count, tokens = 0, 0, 0
        for i, n in enumerate(pieces.length.tolist()):
            if count and (count == self.per or tokens + n > cap):
                k, count, tokens = k + 1, 0, 0
            mb[i], count, tokens = k, count + 1, tokens + n
        needed = -(-(k + 1 if len(pieces) else 0) // dp)
        pinned = layout.micro_batches or cfg.num_micro_batches
        if pinned and pinned < needed:
            raise ValueError(f"{self.name}: {needed} micro-batches per rank needed, {pinned} pinned")
        m = max(1, needed, pinned or 0)
        b = np.arange(m * dp, dtype=np.int64)
        rank_mbs = np.empty((dp, m), np.int64)
        rank_mbs[b % dp, b // dp] = b
        return whole_pieces_packing(pieces, mb, rank_mbs, strategy=self.name)


@register_planner(NAME, options=RoundRobinOptions, summary="round robin in draw order (a test plugin)",
                  report_order=60, auto=AutoUse(order=5))  # first in auto's order: it wins ties
def _make(config, options: RoundRobinOptions, model) -> RoundRobinPlanner:
    return RoundRobinPlanner(config, options, model)
