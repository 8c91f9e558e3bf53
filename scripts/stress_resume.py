"""Run one test many times while other processes keep every core busy; print how many runs failed.

    python scripts/stress_resume.py                       # the StatefulDataLoader resume test, 20 runs, 2 burners
    python scripts/stress_resume.py --runs 5 --burners 3 --test tests/test_loader_resume.py

A test that passes only on a quiet machine is a bug: this is how resume tests are checked under load.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TEST = "tests/test_loader_workers.py::test_stateful_dataloader_resumes_each_worker"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test", default=DEFAULT_TEST, help="pytest node id (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 2,
                    help="CPU-burning processes beside the test (default: one per core)")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below when stopped
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.burners)]
    failed, t0 = 0, time.monotonic()
    proc = None
    try:
        for i in range(args.runs):
            # its own process group, so that stopping this script also stops the test's DataLoader workers
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", args.test],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            out, _ = proc.communicate()
            ok = proc.returncode == 0
            failed += not ok
            print(f"run {i + 1}/{args.runs}: {'passed' if ok else 'FAILED'}", flush=True)
            if not ok:
                print(out[-4000:], flush=True)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in burners:
            p.kill()
            p.wait()
    print(f"{args.test}: {failed} failed of {args.runs} runs beside {args.burners} CPU-burning processes "
          f"({time.monotonic() - t0:.0f} s, {os.cpu_count()} cores)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
