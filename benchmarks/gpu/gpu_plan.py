"""What the balance and loader parts plan with, chosen as a user would: the device file of the GPU present
(`PlanConfig.device`), and the cost profile calibrated in this run (part 2's, as after `packloader calibrate`)
handed over as a profile JSON path in `PlanConfig.model`, or the shipped H100 one where none was calibrated.
Planner warnings are caught so a part can report them with its figures instead of only printing them."""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from gpu_common import Ctx

from packloader.balancers.cost import presets
from packloader.balancers.cost.devices import DEFAULT_DEVICE, known_devices
from packloader.balancers.cost.measured import measured_profile
from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.profile_io import save_profile
from packloader.contracts import ParallelConfig


def device_for_gpu(gpu: str) -> str:
    """The device file named in a GPU's name (h200 for "NVIDIA H200"), else PlanConfig's default (h100)."""
    for name in sorted(known_devices(), key=len, reverse=True):
        if re.search(rf"\b{re.escape(name.lower())}\b", gpu.lower()):
            return name
    return DEFAULT_DEVICE


def device_name(ctx: Ctx) -> str:
    """The device file of the GPU the run is on (PlanConfig's default on CPU)."""
    return device_for_gpu(torch.cuda.get_device_properties(ctx.device).name) if ctx.cuda else DEFAULT_DEVICE


@dataclass
class PlanProfile:
    """PlanConfig's `model` and `device`, the model that predicts the timed layers (the same profile without the
    LM head, which the timed layers leave out) and a line for the report saying which profile it is."""

    model: str
    device: str
    predict: CostModel
    label: str
    calibrated: bool


def plan_profile(ctx: Ctx, preset: str, parallel: ParallelConfig, out_dir) -> PlanProfile:
    """The calibrated one-layer profile of the main shape (part 2, `ctx.results`) scaled to one pipeline stage
    of `preset` as the shipped one is scaled (`measured_profile` with it as the base; the LM head's share on
    every stage, as `packloader calibrate --pp` writes it), saved beside the results and planned with by
    path; without a calibration, the preset itself, priced by the shipped H100 measurements (device h100)."""
    shape = presets.get_shape(preset)
    cal = ctx.results.get("calibration_profiles", {}).get(ctx.main_shape().name)
    if cal is None:
        return PlanProfile(model=preset, device=DEFAULT_DEVICE, calibrated=False,
                           predict=CostModel(measured_profile(shape, parallel, include_head=False)),
                           label=f"the shipped H100 profile ({DEFAULT_DEVICE}; no calibration in this run)")
    par = f"pp{parallel.pp}-tp{parallel.tp}-cp{parallel.cp}"
    path = Path(out_dir) / f"profile-{preset}-stage-{par}.json"
    stage = measured_profile(shape, parallel, base=cal)
    save_profile(msgspec.structs.replace(stage, name=f"{cal.name}/{preset}-stage-{par}"), path)
    predict = CostModel(measured_profile(shape, parallel, base=cal, include_head=False))
    return PlanProfile(model=str(path), device=device_name(ctx), predict=predict, calibrated=True,
                       label=f"the profile calibrated in part 2 ({cal.name}), one {par} stage: {path.name}")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def planner_warnings():
    """The warnings packloader logs inside the block (e.g. no plan fits in memory), as a list of lines."""
    handler, log = _Collect(), logging.getLogger("packloader")
    log.addHandler(handler)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
