"""What PackedTrainer settles before its first step, from the loader's config and the model it trains: the cost
model (derived from ``model.config`` when the config left ``PlanConfig.model`` at its default, which prices an
8B model on an H100) and a gradient accumulation that matches the micro-batches of every packloader step, with a
hint that leads to settings that run."""

from __future__ import annotations

import logging
from typing import Any

from packloader.balancers.cost.from_config import model_spec
from packloader.loader.default_model import DEFAULT_MODEL
from packloader.loader.micro_batch_count import micro_batches_needed

log = logging.getLogger("packloader")


def price_for_model(loader: Any, model: Any) -> str | None:
    """Reprice `loader` for `model.config` when its PlanConfig.model is the default; the new model string, or None
    when nothing changed (a model named in the config, a loader without `reprice`, a config not readable)."""
    config = getattr(loader, "config", None)
    reprice = getattr(loader, "reprice", None)
    model_config = getattr(model, "config", None)
    if config is None or reprice is None or model_config is None or config.model != DEFAULT_MODEL:
        return None
    try:
        spec = model_spec(model_config)
    except (TypeError, ValueError, AttributeError) as e:
        log.warning("PackedTrainer: plans stay priced as %s, PlanConfig.model's default: cannot read the model's "
                    "shape from model.config (%s); pass PlanConfig(model=packloader.model_spec(...))", DEFAULT_MODEL, e)
        return None
    reprice(spec)
    log.info("PackedTrainer: plans priced for the model trained, %s (from model.config)", spec)
    return spec


def accumulation_fix(loader: Any, gradient_accumulation_steps: int, got: int = 0) -> str | None:
    """What to set when a step's micro-batches (`got`, where a step was planned) and the accumulation differ: the
    same number on both sides, and at least the micro-batches a step can need (tokens_per_step + context - 1
    tokens over dp x max_tokens) and the step got, so that following it runs (was: num_micro_batches=ga, which
    the loader then refused as too few). None without a PlanConfig to read."""
    config = getattr(loader, "config", None)
    if config is None:
        return None
    need = micro_batches_needed(config)
    n = max(need, gradient_accumulation_steps, config.num_micro_batches or 0, got)
    floor = ""
    if gradient_accumulation_steps < need:
        floor = (f" ({gradient_accumulation_steps} cannot hold every step: a step holds up to tokens_per_step + "
                 f"context - 1 = {config.tokens_per_step + config.context - 1:,} tokens, {need} micro-batches of "
                 f"max_tokens={config.max_tokens:,} on each of dp={config.parallel.dp} ranks; or raise max_tokens, "
                 "or lower tokens_per_step or context)")
    return (f"set TrainingArguments(gradient_accumulation_steps={n}) and PlanConfig(num_micro_batches={n}), the same "
            f"number on both sides{floor}")


def check_accumulation(loader: Any, gradient_accumulation_steps: int) -> None:
    """Refuse at once a PlanConfig.num_micro_batches other than the accumulation: one optimizer step is one
    packloader step, so the first step would be refused anyway."""
    config = getattr(loader, "config", None)
    pinned = None if config is None else config.num_micro_batches
    if pinned is not None and pinned != gradient_accumulation_steps:
        raise ValueError(f"PackedTrainer: gradient_accumulation_steps={gradient_accumulation_steps} but "
                         f"PlanConfig(num_micro_batches={pinned}): they must be equal: "
                         f"{accumulation_fix(loader, gradient_accumulation_steps)}")
