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


def test_the_default_cost_model_is_named_once(monkeypatch, caplog):
    """Plans priced with PlanConfig.model's default (llama3-8b on an H100) say so once per process on the
    `packloader` logger, with the way to price one's own model; a named model says nothing."""
    import logging

    import packloader.loader.default_model as dm
    from packloader import PackedLoader, PlanConfig

    monkeypatch.setattr(dm, "_noted", False)
    docs = [list(range(1, 101))] * 8

    def first_batch(**fields):
        config = PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=256, **fields)
        with PackedLoader(docs, config=config, num_threads=0) as loader:
            return next(iter(loader))

    with caplog.at_level(logging.WARNING, logger="packloader"):
        first_batch(model="tiny")
        assert not [r for r in caplog.records if "model_spec" in r.getMessage()]
        first_batch()
        first_batch()
    notes = [r.getMessage() for r in caplog.records if "model_spec" in r.getMessage()]
    assert len(notes) == 1, notes
    assert "priced as llama3-8b on h100, PlanConfig.model's default" in notes[0]
    assert "PlanConfig(model=packloader.model_spec(config))" in notes[0]
