"""The cost model a PlanConfig names, loaded once per process: every planner, the loader and the report price
plans with the same object, and a profile file is read and checked once."""

from __future__ import annotations

import logging

from packloader.balancers.cost.model import CostModel
from packloader.balancers.cost.resolve import load_cost_model
from packloader.contracts import PlanConfig

_MODELS: dict[tuple, CostModel] = {}
log = logging.getLogger("packloader.cost")
DEFAULT_MODEL = PlanConfig().model


def cost_model_for(config: PlanConfig) -> CostModel:
    """The config's cost model (preset name or profile path, on `config.device`, `config.cost`), loaded once per
    process; the first load logs (info) which model and device price the plans."""
    key = (config.model, config.parallel, config.device, config.cost)
    model = _MODELS.get(key)
    if model is None:
        model = _MODELS[key] = load_cost_model(config.model, config.parallel, device=config.device, cost=config.cost)
        note = ""
        if config.model == DEFAULT_MODEL:
            note = (" (PlanConfig.model's default: to price your own model, pass model=packloader.model_spec(its "
                    "Hugging Face or Megatron config), or a profile from `packloader calibrate`)")
        log.info("plans are priced as %s on %s by cost model %s%s; %s", config.model, config.device.upper(),
                 model.name, note, model.profile.source or model.profile.device)
    return model
