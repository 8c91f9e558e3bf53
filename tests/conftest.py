import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))  # `helpers` importable here and in the processes tests start


def pytest_unconfigure(config):
    """Reap the multi-rank harness's forkserver before this process (an xdist worker too) exits, so that its CPU
    counts in CI's `times` and no server outlives the run."""
    harness = sys.modules.get("helpers.distributed")
    if harness is not None:
        harness._stop_forkserver()
