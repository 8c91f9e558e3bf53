"""What `train_deepspeed.py` and `train_megatron.py` share: the corpus, the relaunch on gloo ranks, rank-0 logging
and the per-step record a resumed run is compared with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from packloader.sources.directory import DirectorySource

CORPUS_PACKAGE = "json"  # the stdlib's json package: 5 files, about 48K bytes, no download


def corpus() -> DirectorySource:
    """The stdlib's `json/*.py`, one document per file (read with the `bytes` tokenizer: 257 ids, EOS 256)."""
    return DirectorySource(Path(sysconfig.get_paths()["stdlib"]) / CORPUS_PACKAGE, "*.py", errors="skip",
                           empty="skip")


def relaunch(script: str, argv: list[str], nproc: int) -> int:
    """Run `script` again on `nproc` gloo processes through torchrun (`torch.distributed.run`); its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(script).resolve()), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env).returncode


def say(*parts) -> None:
    """Per-step lines once, from global rank 0 (every rank computes the same global numbers)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(*parts, flush=True)


def segments_of(segment_lists) -> list[list[int]]:
    """This rank's trained pieces of a step (each micro-batch's segments) as `[doc, start, end]`, for the
    exactly-once ledger."""
    return [[int(s.doc), int(s.start), int(s.end)] for segments in segment_lists for s in segments]


def global_loss(local_loss: float) -> float:
    """The step's per-token loss over every DP rank: the sum of each rank's (summed loss / the step's loss tokens)."""
    t = torch.tensor([local_loss], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t)


def gather(obj):
    """Every rank's `obj`, in rank order."""
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def write_result(out: Path, result: dict) -> None:
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
