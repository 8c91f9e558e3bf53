"""Each loader state PackedTrainer writes is bound to its checkpoint: the file holds the global step it was saved at
and the run that saved it, and the checkpoint's ``trainer_state.json`` holds the same run (an entry of its
``stateful_callbacks``) beside its own ``global_step``. Resuming refuses a loader state of another checkpoint, of
this run or another (a ``packloader_state-rank0.pt`` copied from ``checkpoint-4`` into ``checkpoint-2`` would
train steps 4-5 after step 2 and never steps 2-3), naming both. A state file written before the binding (the plain
loader state) loads as it did."""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any

import torch

BINDING = "packloader_checkpoint"  # in the state file: {"global_step", "run"} of the checkpoint it belongs to
RUN_KEY = "PackloaderRun"  # in trainer_state.json's stateful_callbacks: {"args": {"run": ...}}
TRAINER_STATE = "trainer_state.json"


def new_run(processes: int) -> str:
    """A fresh run's identity, the same on every process (process 0's, broadcast)."""
    run = [uuid.uuid4().hex]
    if processes > 1:
        torch.distributed.broadcast_object_list(run, src=0)
    return run[0]


def bind(state: Any, global_step: int, run: str) -> dict:
    """What the state file holds: the loader state and the checkpoint it belongs to."""
    return {BINDING: {"global_step": int(global_step), "run": run}, "loader": state}


def checkpoint_identity(checkpoint_dir: str) -> tuple[int | None, str | None]:
    """(global step, run) of a checkpoint folder, from its trainer_state.json (the step from a `checkpoint-N` name
    where the file is missing); None for what it does not say."""
    step, run = None, None
    try:
        with open(os.path.join(checkpoint_dir, TRAINER_STATE)) as f:
            ts = json.load(f)
        step = ts.get("global_step")
        run = ((ts.get("stateful_callbacks") or {}).get(RUN_KEY) or {}).get("args", {}).get("run")
    except (OSError, ValueError, AttributeError):
        pass
    if step is None:
        m = re.search(r"checkpoint-(\d+)$", os.path.normpath(checkpoint_dir))
        step = int(m.group(1)) if m else None
    return step, run


def unbind(payload: Any, checkpoint_dir: str, path: str) -> Any:
    """The loader state of a state file, after checking it belongs to `checkpoint_dir` (a ValueError naming both
    otherwise); a plain loader state (written before the binding) as it is."""
    if not (isinstance(payload, dict) and BINDING in payload):
        return payload
    saved = payload[BINDING]
    step, run = checkpoint_identity(checkpoint_dir)
    where = f"{os.path.join(checkpoint_dir, TRAINER_STATE)}"
    if step is not None and saved.get("global_step") != step:
        raise ValueError(
            f"{path} was saved at global step {saved.get('global_step')} (run {saved.get('run')}), but checkpoint "
            f"{checkpoint_dir} is at global step {step} ({where}): the loader state belongs to another checkpoint, "
            f"and resuming with it would skip or repeat data. Put back the packloader_state files this checkpoint "
            f"was saved with, or resume from the checkpoint at step {saved.get('global_step')}")
    if run is not None and saved.get("run") != run:
        raise ValueError(
            f"{path} was saved by run {saved.get('run')} at global step {saved.get('global_step')}, but checkpoint "
            f"{checkpoint_dir} was saved by run {run} ({where}): the loader state belongs to another run's "
            "checkpoint, and resuming with it would train another stream. Put back the packloader_state files this "
            "checkpoint was saved with")
    return payload["loader"]
