"""Argparse types for the numbers the commands take: whole numbers in a stated range, refused at parsing.

A number out of range is an argparse error naming the option and the range (exit status 2), never a traceback
or an allocation that grows without bound. The upper bounds are far beyond any real run and low enough that a
plan over them fits in memory: parallel degrees that would make a plan of millions of ranks or stages, and token
counts past 2^40, are refused rather than attempted.
"""

from __future__ import annotations

import argparse
from typing import Callable

TOKENS_MAX = 1 << 40  # token counts: --max-tokens, --context, --tokens-per-step, --shard-tokens, ...
DP_MAX = 1 << 17  # data-parallel ranks
RANKS_MAX = 1 << 10  # pipeline, context and tensor parallel degrees
VPP_MAX = 64  # virtual pipeline stages per rank
MICRO_BATCHES_MAX = 1 << 16
STEPS_MAX = 1 << 40
THREADS_MAX = 1024
SEED_MAX = 2**63 - 1


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse `type=`: a whole number in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number from {lo:,} to {hi:,}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected a whole number from {lo:,} to {hi:,}, got {value:,}")
        return value

    parse.__name__ = f"int in [{lo}, {hi}]"  # argparse names the type in some messages
    return parse


tokens = int_in(1, TOKENS_MAX)
dp = int_in(1, DP_MAX)
ranks = int_in(1, RANKS_MAX)
vpp = int_in(1, VPP_MAX)
micro_batches = int_in(1, MICRO_BATCHES_MAX)
steps = int_in(1, STEPS_MAX)
threads = int_in(1, THREADS_MAX)
seed = int_in(0, SEED_MAX)
