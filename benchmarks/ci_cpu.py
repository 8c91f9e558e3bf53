"""CPU seconds (user + sys, every process a test starts included) of test files run one at a time, in order.

Wall-clock time on a shared machine says nothing about CI's time on a quiet one; CPU seconds do, as long as every
process is reaped (tests/helpers/distributed.py reaps its forkserver at exit for that reason). Run it from the
repository root with the environment the suite runs in:

    python benchmarks/ci_cpu.py tests/test_cp_attention.py tests/test_dynamic_cp_runtime.py
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time


def cpu_of(argv: list[str]) -> tuple[float, float, int]:
    """(user + sys CPU seconds of argv and all its reaped descendants, wall seconds, exit status)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    rc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall, rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--pytest-args", default="-q -p no:cacheprovider -x", help="passed to every pytest run")
    args = ap.parse_args()
    total = 0.0
    print(f"{'file':55s} {'cpu s':>8s} {'wall s':>8s} rc")
    for f in args.files:
        cpu, wall, rc = cpu_of([sys.executable, "-m", "pytest", *args.pytest_args.split(), f])
        total += cpu
        print(f"{f:55s} {cpu:8.1f} {wall:8.1f} {rc}", flush=True)
    print(f"{'total':55s} {total:8.1f}")


if __name__ == "__main__":
    main()
