"""Plans priced for a model nobody named: `PlanConfig.model` defaults to llama3-8b on an H100, which prices a
small model's micro-batches far too dear (a 2-layer, hidden-64 model got memory_over 1.9 and twice the
micro-batches it needed). `PackedTrainer` derives the model from `model.config`; everywhere else the first loader
that plans with the default says once, on the `packloader` logger, how to price one's own model."""

from __future__ import annotations

import logging

from packloader.contracts import PlanConfig

DEFAULT_MODEL = PlanConfig().model
log = logging.getLogger("packloader")
_noted = False  # once per process


def note_default_model(config: PlanConfig) -> bool:
    """Log once that plans are priced with the default model; True when this call logged."""
    global _noted
    if _noted or config.model != DEFAULT_MODEL:
        return False
    _noted = True
    log.warning(
        "plans are priced as %s on %s, PlanConfig.model's default: if that is not your model, pass "
        "PlanConfig(model=packloader.model_spec(config)) with its Hugging Face PretrainedConfig (or Megatron "
        "TransformerConfig and vocab=), a preset name, or a `packloader calibrate` profile; PackedTrainer derives "
        "it from model.config itself", DEFAULT_MODEL, config.device)
    return True
