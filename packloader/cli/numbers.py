"""Argparse types for a command's own numbers (not the layout flags, which take their bounds from the config
Structs): whole numbers in a stated range, refused at parsing with the option and the range (exit status 2),
never a traceback or an allocation that grows without bound."""

from __future__ import annotations

import argparse
from typing import Callable

from packloader.contracts import TOKENS_MAX

STEPS_MAX = 1 << 40
THREADS_MAX = 1024


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
steps = int_in(1, STEPS_MAX)
threads = int_in(1, THREADS_MAX)
