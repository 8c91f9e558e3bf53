"""Whether the planners' numba kernels still have to be compiled, so a command can say so before its first
planning instead of leaving a progress bar at seconds per step for a minute (numba compiles every kernel on its
first call and keeps it in its cache: `__pycache__` beside the sources, `~/.cache/numba` where that is not
writable, or NUMBA_CACHE_DIR)."""

from __future__ import annotations

import importlib
import sys

# kernels any plan compiles (the simulator's, the cost model's price of a micro-batch), and those of a report or
# of `auto` (every planner's): a command checks the set it will surely compile, so it does not announce a compile
# every run for kernels it never calls
COMMON = (
    ("packloader.balancers.sim.kernels", "simulate_kernel"),
    ("packloader.balancers.cost.coeffs", "microbatch_time"),
)
KERNELS = (
    ("packloader.balancers.cost.coeffs", "segment_times_kernel"),
    ("packloader.balancers.sim.kernels", "simulate_kernel"),
    ("packloader.balancers.planners.slimpack_kernels", "slim_pack_ranks"),
    ("packloader.balancers.planners.fixed", "bfd_pack"),
)

MESSAGE = ("compiling the planners' numba kernels on this first run (about 35-40 s of CPU time, longer on a busy "
           "machine; the first steps' times include it); they are cached for later runs")


def kernels_cold(kernels=KERNELS) -> bool | None:
    """True when a kernel has no compiled entry in numba's cache for its current source; None when numba's cache
    cannot be read this way (another numba version): then nothing is said."""
    try:
        for module, name in kernels:
            cache = getattr(importlib.import_module(module), name)._cache
            if not cache._cache_file._load_index():  # {} when absent or written for another source
                return True
        return False
    except Exception:  # noqa: BLE001 - numba internals: say nothing rather than fail the command
        return None


def say_if_compiling(command: str, kernels=KERNELS) -> None:
    """One line on stderr before the first planning when the kernels are not cached."""
    if kernels_cold(kernels):
        print(f"packloader {command}: {MESSAGE}", file=sys.stderr, flush=True)
