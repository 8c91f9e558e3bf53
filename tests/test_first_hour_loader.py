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


def test_dp_shared_micro_batches_count_once_with_the_helper():
    """slimpack at dp 4 runs a 4,000-token document as DP-Merge micro-batches shared by several ranks: summing
    every rank's tokens counts them once per rank (the issue's user: 8,192 positions twice), while
    `tokens_to_count(rank)` sums to the corpus's 60 x 100 + 4,000 = 10,000 tokens exactly."""
    import numpy as np

    from packloader import PackedLoader, ParallelConfig, PlanConfig
    from packloader.sources.base import IterableSource

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=100).astype(np.int32) for _ in range(60)]
    docs.insert(10, rng.integers(1, 200, size=4000).astype(np.int32))
    config = PlanConfig(strategy="slimpack", parallel=ParallelConfig(dp=4), max_tokens=1024, context=4096,
                        tokens_per_step=8192, model="llama3-8b")
    seen = counted = shared = 0
    for rank in range(4):
        with PackedLoader(IterableSource(docs), config=config, dp_rank=rank, num_threads=0, append_eos=False) as ld:
            for b in ld:
                seen += b.num_tokens
                counted += b.tokens_to_count(rank)
                shared += b.dp_shared
                if b.dp_shared:
                    assert rank in b.dp_group and b.tokens_to_count(rank) == (b.num_tokens if rank == min(b.dp_group) else 0)
    assert shared > 0 and seen > 10_000  # the case of the issue occurs
    assert counted == 10_000


@pytest.mark.multiprocess
def test_the_readme_names_the_error_of_a_script_beside_a_clone(tmp_path):
    """A script in the folder holding a clone named `packloader` imports the clone folder: the error Python gives
    is the one README.md quotes, so a user who meets it finds the cause there."""
    import re

    quoted = re.search(r"\(`(cannot import name 'PackedLoader' from 'packloader' \(unknown location\))`\)",
                       open(os.path.join(ROOT, "README.md"), encoding="utf-8").read())
    assert quoted, "README.md does not quote the error"
    (tmp_path / "packloader").symlink_to(ROOT, target_is_directory=True)
    (tmp_path / "train.py").write_text("from packloader import PackedLoader\n")
    # -S and no PYTHONPATH: the package is found nowhere else (not installed, or installed by an editable finder
    # that a namespace portion on sys.path comes before), as for the user
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-S", str(tmp_path / "train.py")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 1 and quoted.group(1) in proc.stderr, proc.stderr
