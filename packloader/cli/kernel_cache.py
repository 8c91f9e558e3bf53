"""Whether the planners' numba kernels still have to be compiled, so a command can say so before its first
planning instead of leaving a progress bar at seconds per step for a minute (numba compiles every kernel on its
first call and keeps it in its cache: `__pycache__` beside the sources, `~/.cache/numba` where that is not
writable, or NUMBA_CACHE_DIR)."""

from __future__ import annotations

import importlib
import sys

# kernels every report and plan calls: the cost model's, the simulator's and the planners' of `auto`
KERNELS = (
    ("packloader.balancers.cost.coeffs", "segment_times_kernel"),
    ("packloader.balancers.sim.kernels", "simulate_kernel"),
    ("packloader.balancers.planners.slimpack_kernels", "slim_pack_ranks"),
    ("packloader.balancers.planners.fixed", "bfd_pack"),
)

MESSAGE = ("compiling the planners' numba kernels on this first run (about 35-40 s of CPU time, longer on a busy "
           "machine; the first steps' times include it); they are cached for later runs")


def kernels_cold() -> bool | None:
    """True when a kernel has no compiled entry in numba's cache for its current source; None when numba's cache
    cannot be read this way (another numba version): then nothing is said."""
    try:
        for module, name in KERNELS:
            cache = getattr(importlib.import_module(module), name)._cache
            if not cache._cache_file._load_index():  # {} when absent or written for another source
                return True
        return False
    except Exception:  # noqa: BLE001 - numba internals: say nothing rather than fail the command
        return None


def say_if_compiling(command: str) -> None:
    """One line on stderr before the first planning when the kernels are not cached."""
    if kernels_cold():
        print(f"packloader {command}: {MESSAGE}", file=sys.stderr, flush=True)
