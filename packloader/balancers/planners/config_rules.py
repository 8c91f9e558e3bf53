"""The one validation of a PlanConfig, used by the loader, `plan_run`, the report and every CLI, so that no entry
point accepts what another refuses (each CLI maps the fields of a refusal to its flags)."""

from __future__ import annotations

import msgspec

from packloader.balancers.cost.schedules import schedule_spec
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
    if cfg.schedule != "auto":
        schedule_spec(cfg.schedule)  # a ValueError naming it and the registered schedules
    try:
        planner_spec(cfg.strategy)
    except ValueError as e:
        raise ConfigError(str(e), fields=_STRATEGY_FIELDS) from None
    try:
        check_planner_options(cfg)
    except ValueError as e:
        raise ConfigError(str(e), fields=("planner_options",)) from None
    check_cp_mode(cfg)
    if strategy_rules and not _plans_dynamic(cfg):
        try:
            check_strategy(cfg)
        except ValueError as e:
            raise ConfigError(str(e), fields=_SLICING_FIELDS) from None
    check_device(cfg)
    check_model(cfg)
    return cfg


def _plans_dynamic(config: PlanConfig) -> bool:
    return config.cp_mode == "dynamic" or config.strategy == "dynamic-cp"


def check_cp_mode(config: PlanConfig) -> None:
    """cp_mode and strategy agree: the dynamic-cp strategy is per-document CP (cp_mode "dynamic"), cp_mode
    "dynamic" plans with it alone (strategy "auto" or "dynamic-cp"), "auto" compares it with a fixed-CP strategy.
    Per-document CP holds a piece on up to dp x cp GPUs of max_tokens / cp tokens each; longer ones need slicing."""
    if config.strategy == "dynamic-cp" and config.cp_mode == "fixed":
        raise ConfigError("PlanConfig.strategy='dynamic-cp' plans per-document context parallelism, but cp_mode is "
                          "'fixed'; expected cp_mode='dynamic' (or 'auto' with a fixed-CP strategy)",
                          fields=("strategy", "cp_mode"))
    if config.cp_mode == "dynamic" and config.strategy not in ("auto", "dynamic-cp"):
        raise ConfigError(f"PlanConfig.cp_mode='dynamic' plans every step with the dynamic-cp planner, so "
                          f"strategy={config.strategy!r} would never run; expected strategy 'auto' or 'dynamic-cp', "
                          "or cp_mode='auto' to compare it with per-document CP", fields=("strategy", "cp_mode"))
    if config.cp_mode == "auto" and config.strategy == "dynamic-cp":
        raise ConfigError("PlanConfig.cp_mode='auto' compares the strategy's fixed-CP plan with per-document CP; "
                          "strategy 'dynamic-cp' is the latter; expected a fixed-CP strategy (e.g. 'auto')",
                          fields=("strategy", "cp_mode"))
    par = config.parallel
    pool = par.dp * par.cp * -(-config.max_tokens // par.cp)
    if _plans_dynamic(config) and config.context > pool and not config.allow_slicing:
        raise ConfigError(f"PlanConfig.context={config.context} exceeds what per-document CP holds in one micro-batch "
                          f"slot, dp x cp GPUs of max_tokens / cp tokens ({pool}), with allow_slicing=False; expected "
                          "context <= dp x max_tokens or allow_slicing=True",
                          fields=("context", "max_tokens", "allow_slicing", "cp_mode"))


def check_device(config: PlanConfig) -> None:
    """A device name that no profile file answers is the device's error, not the model's."""
    from packloader.balancers.cost.devices import load_device

    try:
        load_device(config.device)
    except (ValueError, OSError) as e:
        raise ConfigError(f"PlanConfig.device={config.device!r}: {e}", fields=("device",)) from e


def check_model(config: PlanConfig) -> None:
    from packloader.balancers.cost.lookup import cost_model_for
    from packloader.balancers.cost.presets import preset_names

    try:
        cost_model_for(config)
    except (KeyError, ValueError, OSError, msgspec.DecodeError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise ConfigError(
            f"PlanConfig.model={config.model!r} is not usable ({why}); expected a model preset "
            f"({', '.join(preset_names())}) or the path of a cost profile JSON (`packloader calibrate` writes one)",
            fields=("model",),
        ) from e
