"""The layout and model flags of every CLI, generated from PlanConfig and ParallelConfig.

One flag per Struct field (ParallelConfig's fields flattened: --dp, --pp, --cp, --tp, --vpp), named after the
field (`max_tokens` -> --max-tokens; a few keep their historical names, FLAG_NAMES), with the Struct's default,
type and Literal choices, and numbers checked against the field's msgspec constraints (Meta ge/gt/le/lt) at
parse time, so `--dp 0` is an argparse error naming the flag and the field. A field added to the Structs later
becomes a flag without touching the CLIs. `config_from_args` builds the PlanConfig back; msgspec validates it
again, so the library and the CLIs accept exactly the same values.

Two documented derived defaults: --context defaults to --max-tokens (a document is cut only where a micro-batch
could not hold it anyway; the Struct's defaults agree, 8192 both), and a command may override defaults for its
own mode (`packloader report --demo`) for flags the user did not give (`given`).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import msgspec
import msgspec.inspect as mi

from packloader.balancers.cost.schedules import schedule_names
from packloader.balancers.planners.config_rules import validate_config
from packloader.contracts import ConfigError, ParallelConfig, PlanConfig

# Historical flag names kept where they differ from the field's; a bool field whose default is True gets a
# negative flag (store_false).
FLAG_NAMES = {"num_micro_batches": "--micro-batches", "allow_slicing": "--no-slicing"}
# Fields that are not layout or model options (the command sets them itself).
SKIP = {"strategy"}
# What a None default means, for the help.
NONE_MEANS = {"num_micro_batches": "the planner's choice", "memory_gib": "the device's"}
# Defaults derived from another field when the flag is not given (field -> the field it follows).
DERIVED = {"context": "max_tokens"}
HELP = {
    "dp": "data-parallel ranks",
    "pp": "pipeline stages",
    "cp": "context-parallel ranks",
    "tp": "tensor-parallel ranks",
    "vpp": "model chunks per pipeline rank (with --schedule interleaved or zb-h1; 2 with zb-v)",
    "max_tokens": "most tokens one micro-batch may hold per DP rank (before CP sharding)",
    "context": "documents longer than this are cut into independent pieces",
    "tokens_per_step": "global tokens drawn per optimizer step, all DP ranks together",
    "num_micro_batches": "micro-batches per DP rank",
    "allow_slicing": "never slice a document across micro-batches",
    "schedule": "pipeline schedule (zb-h1 at --vpp > 1: interleaved zero bubble; auto: 1F1B or ZB-H1, at --vpp > 1 "
                "interleaved or its zero-bubble form, and ZB-V at --vpp 2; per step, by simulated time)",
    "model": "cost model: a preset name (llama3-8b, llama2-7b, llama3-70b, ...) or a calibration profile JSON",
    "seed": "seed of the loader's order and of the planners' random trials",
    "device": "device profile of the cost and memory model: h100, h200 or a <name>.json on PACKLOADER_DEVICE_PATH",
    "cost": "cost model kind: measured (a profile timed on the device) or analytic",
    "memory_gib": "GPU memory in GiB for the memory check",
    "planner_options": "options per planner as a JSON object, e.g. '{\"wlb\": {\"fill\": 0.8}}'",
    "cp_mode": "context parallelism: fixed (each micro-batch over the whole CP group), dynamic (each document on "
               "its own power-of-two GPU subgroup of the DP x CP pool), auto (per step, the faster when cp > 1)",
}


class _Field(msgspec.Struct, frozen=True):
    """One generated flag: the Struct field it sets (`path` like "parallel.dp"), its flag and argparse dest."""

    path: str
    name: str
    flag: str
    dest: str
    default: Any
    info: Any  # msgspec.inspect type of the field


def _fields() -> list[_Field]:
    out: list[_Field] = []

    def walk(struct: type, prefix: str) -> None:
        for f in mi.type_info(struct).fields:
            if f.name in SKIP and not prefix:
                continue
            if isinstance(f.type, mi.StructType):
                walk(f.type.cls, f"{prefix}{f.name}.")
                continue
            flag = FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            out.append(_Field(prefix + f.name, f.name, flag, "layout_" + f.name, default, f.type))

    walk(PlanConfig, "")
    return out


def layout_fields() -> list[_Field]:
    return _fields()


def _bounds(t: Any) -> str:
    parts = []
    for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        v = getattr(t, attr, None)
        if v is not None:
            parts.append(f"{op} {v:,}")
    return " and ".join(parts)


def _number(t: Any, path: str) -> Callable[[str], Any]:
    """argparse type of a number field: parses and checks the msgspec constraints, naming the field."""
    kind = int if isinstance(t, mi.IntType) else float
    word = "an integer" if kind is int else "a number"
    bounds = _bounds(t)

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {word}{' ' + bounds if bounds else ''} (field {path}), got {text!r}") from None
        ok = all((
            t.ge is None or v >= t.ge, t.gt is None or v > t.gt, t.le is None or v <= t.le, t.lt is None or v < t.lt,
        ))
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {bounds} (field {path}), got {text}")
        return v

    parse.__name__ = kind.__name__
    return parse


def _json_object(text: str) -> dict:
    """argparse type of a dict field: a JSON object."""
    try:
        v = msgspec.json.decode(text)
    except msgspec.DecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return v


class _Given(argparse.Action):
    """Stores the value and records that the user gave the flag (for mode-specific defaults)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values if self.const is None else self.const)
        given = set(getattr(namespace, "layout_given", set()))
        given.add(self.dest)
        namespace.layout_given = given


def add_layout_arguments(p: argparse.ArgumentParser | Any, *, skip: tuple[str, ...] = (),
                         defaults: dict[str, Any] | None = None, mode: str = "",
                         default_texts: dict[str, str] | None = None) -> None:
    """Add one flag per PlanConfig/ParallelConfig field (except `skip`). `defaults` are a command mode's own
    defaults (named `mode` in the help); the argparse default stays the Struct's. `default_texts`: what the help
    says is the default of a field the command derives itself (the report's tokens per step), instead of the
    Struct's value, which that command never uses."""
    defaults = defaults or {}
    default_texts = default_texts or {}
    p.set_defaults(layout_given=set())
    for f in _fields():
        if f.name in skip:
            continue
        t = f.info
        optional = isinstance(t, mi.UnionType) and any(isinstance(x, mi.NoneType) for x in t.types)
        if optional:
            t = next(x for x in t.types if not isinstance(x, mi.NoneType))
        help_text = HELP.get(f.name, f.path.replace("_", " "))
        default_text = NONE_MEANS.get(f.name, "none") if f.default is None else f.default
        if f.name in DERIVED:
            default_text = "--" + DERIVED[f.name].replace("_", "-")
        default_text = default_texts.get(f.name, default_text)
        extra = f"; {mode} {defaults[f.name]}" if f.name in defaults else ""
        kw: dict[str, Any] = dict(dest=f.dest, default=f.default, action=_Given)
        if isinstance(t, mi.BoolType):
            kw.update(nargs=0, const=not f.default)
            p.add_argument(f.flag, help=f"{help_text}{extra}", **kw)
            continue
        if f.path == "schedule":  # the registry's schedules, read when the parser is built
            kw.update(choices=[*schedule_names(), "auto"])
        elif isinstance(t, mi.LiteralType):
            kw.update(choices=list(t.values))
        elif isinstance(t, (mi.IntType, mi.FloatType)):
            kw.update(type=_number(t, f.path), metavar="N" if isinstance(t, mi.IntType) else "X")
        elif isinstance(t, mi.DictType):
            kw.update(type=_json_object, metavar="JSON")
        else:
            kw.update(metavar=f.name.upper())
        p.add_argument(f.flag, help=f"{help_text} (default {default_text}{extra})", **kw)


def layout_values(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Field name -> value: what the user gave, else the mode's default, else the Struct's (derived defaults
    applied)."""
    defaults = defaults or {}
    given = getattr(args, "layout_given", set())
    out: dict[str, Any] = {}
    for f in _fields():
        if not hasattr(args, f.dest):
            continue
        out[f.name] = getattr(args, f.dest) if f.dest in given or f.name not in defaults else defaults[f.name]
    for name, source in DERIVED.items():
        if name in out and f"layout_{name}" not in given and name not in defaults and source in out:
            out[name] = out[source]
    return out


def config_from_args(args: argparse.Namespace, strategy: str = "auto", defaults: dict[str, Any] | None = None,
                     check: bool = True, strategy_rules: bool = True, **overrides: Any) -> PlanConfig:
    """The PlanConfig of the parsed flags, validated as the library validates it (`validate_config`); a
    ValueError naming the flags of the fields it refuses. `check=False` for a draft whose fields the command
    derives further (only each field's own constraints are checked); `strategy_rules=False` where the strategy is
    a placeholder (the report runs each strategy on its own)."""
    values = {**layout_values(args, defaults), **overrides}
    parallel_names = {f.name for f in mi.type_info(ParallelConfig).fields}
    raw: dict[str, Any] = {"strategy": strategy, "parallel": {}}
    for name, v in values.items():
        (raw["parallel"] if name in parallel_names else raw)[name] = v
    try:
        if not check:
            return msgspec.convert(raw, PlanConfig)
        return validate_config(raw, strategy_rules=strategy_rules)
    except (msgspec.ValidationError, ConfigError) as e:
        fields = getattr(e, "fields", ())
        if isinstance(e, msgspec.ValidationError):
            text = str(e)
            fields = (text.rsplit("`$.", 1)[-1].rstrip("`"),) if "`$." in text else ()
        flags = ", ".join(flag_of(f) for f in fields)
        raise ValueError(f"invalid configuration{f' ({flags})' if flags else ''}: {e}") from None


def flag_of(path: str) -> str:
    """The flag that sets the PlanConfig field at `path` ("parallel.dp" -> --dp, "strategy" -> --strategy)."""
    return next((f.flag for f in _fields() if f.path == path), "--" + path.rsplit(".", 1)[-1].replace("_", "-"))
