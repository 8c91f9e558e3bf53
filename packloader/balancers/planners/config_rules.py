"""The one validation of a PlanConfig, used by the loader, `plan_run`, the report and every CLI, so that no entry
point accepts what another refuses (each CLI maps the fields of a refusal to its flags)."""

from __future__ import annotations

import msgspec

from packloader.balancers.planners.registry import check_planner_options, check_strategy, planner_spec
from packloader.contracts import ConfigError, PlanConfig, check_plan_config

# The fields the planner's rules are about, for a refusal to name them.
_STRATEGY_FIELDS = ("strategy",)
_SLICING_FIELDS = ("context", "max_tokens", "allow_slicing", "strategy")


def validate_config(config, *, strategy_rules: bool = True) -> PlanConfig:
    """A PlanConfig, validated: each field (msgspec checks constraints when converting, not in the constructor),
    the rules between fields (`check_plan_config`), the planner's rules (a registered strategy that slices when
    context > max_tokens), and that `model` names a preset or a cost profile (the `fixed` strategy never loads
    it, so a typo would otherwise pass unnoticed). A field's own constraint is refused as msgspec's ValidationError
    (naming it as `$.field`), a rule as a `ConfigError` (a ValueError) naming its fields.

    `strategy_rules=False` where `config.strategy` is a placeholder and each strategy is run on its own (the
    report: a strategy that cannot plan is reported as such, not the whole run refused)."""
    raw = msgspec.to_builtins(config) if isinstance(config, PlanConfig) else config
    if not isinstance(raw, dict):
        raise TypeError(f"config must be a PlanConfig or a dict, got {type(config).__name__}")
    cfg = msgspec.convert(raw, PlanConfig)  # a msgspec.ValidationError naming the field (`$.parallel.dp`)
    check_plan_config(cfg)
    try:
        planner_spec(cfg.strategy)
    except ValueError as e:
        raise ConfigError(str(e), fields=_STRATEGY_FIELDS) from None
    try:
        check_planner_options(cfg)
    except ValueError as e:
        raise ConfigError(str(e), fields=("planner_options",)) from None
    if strategy_rules:
        try:
            check_strategy(cfg)
        except ValueError as e:
            raise ConfigError(str(e), fields=_SLICING_FIELDS) from None
    check_device(cfg)
    check_model(cfg)
    return cfg


def check_device(config: PlanConfig) -> None:
    """A device name that no profile file answers is the device's error, not the model's."""
    from packloader.balancers.cost.devices import load_device

    try:
        load_device(config.device)
    except (ValueError, OSError) as e:
        raise ConfigError(f"PlanConfig.device={config.device!r}: {e}", fields=("device",)) from e


def check_model(config: PlanConfig) -> None:
    from packloader.balancers.cost.presets import preset_names
    from packloader.balancers.planners.packing import cost_model_for

    try:
        cost_model_for(config)
    except (KeyError, ValueError, OSError, msgspec.DecodeError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(
            f"PlanConfig.model={config.model!r} is not usable ({why}); expected a model preset "
            f"({', '.join(preset_names())}) or the path of a cost profile JSON (`packloader calibrate` writes one)",
            fields=("model",),
        ) from e
