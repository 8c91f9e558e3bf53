"""What a new user meets in the first hour with PackedLoader itself: a refused step that ends the process cleanly,
a word when plans are priced for a model nobody named, and micro-batches shared by DP ranks that say so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_a_refused_step_ends_the_process_without_torchdata_noise(tmp_path):
    """num_micro_batches=2 where a step needs 5: the loader refuses the step, and the process ends with that error
    alone (was: torchdata's `_ParallelMapperIter.__del__` ran at interpreter shutdown and printed "Exception
    ignored in ... 'NoneType' object has no attribute 'maxsize'")."""
    script = tmp_path / "refused.py"
    script.write_text(textwrap.dedent("""
        from packloader import PackedLoader, PlanConfig
        docs = [list(range(1, 301))] * 40
        config = PlanConfig(strategy="fixed", max_tokens=512, context=512, tokens_per_step=2048, num_micro_batches=2)
        loader = PackedLoader(docs, config=config)
        for batch in loader:
            pass
    """))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "PlanConfig.num_micro_batches=2 cannot be honoured" in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr and "maxsize" not in proc.stderr, proc.stderr
