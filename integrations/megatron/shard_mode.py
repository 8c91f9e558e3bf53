"""The adapter's `cp_shard_mode`: how a micro-batch is cut over its CP group (`collate.cp_sequence_shards`'
modes). It was called `cp_mode`, the name PlanConfig uses for another choice (fixed or per-document CP); the old
keyword keeps working for one release."""

from __future__ import annotations

import warnings


def shard_mode_of(cp_shard_mode: str, cp_mode: str | None, where: str) -> str:
    """`cp_shard_mode`, or the deprecated `cp_mode=` keyword when one is passed (with a DeprecationWarning)."""
    if cp_mode is None:
        return cp_shard_mode
    warnings.warn(f"{where}(cp_mode=...) is renamed cp_shard_mode (how a micro-batch is sharded over the CP group; "
                  "PlanConfig.cp_mode chooses fixed or per-document CP); cp_mode= goes in the next release",
                  DeprecationWarning, stacklevel=3)
    return cp_mode
