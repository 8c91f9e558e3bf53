"""`--config FILE` for every command: a JSON, YAML or TOML file of the command's options, under the names of the
Structs the library takes. The layout and model keys are PlanConfig's fields (`parallel` a table of
ParallelConfig's: `{"parallel": {"dp": 8, "pp": 4}, "max_tokens": 65536}`), so a config written for
`PlanConfig(**...)` works as is (`report` compares strategies: it takes `strategies` instead of `strategy`); the
command's other options use their flag names with underscores (`lengths`, `out`, `steps`). Flags on the command line override the file; an unknown key is an error
naming the key and the file. YAML needs pyyaml (the `yaml` extra); TOML is read with the standard library's
tomllib (tomli on Python 3.10)."""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from packloader.cli.config_keys import RepeatedKey, check_spellings, json_pairs, yaml_loader
from packloader.contracts import ParallelConfig


class ConfigFileError(ValueError):
    """A config file that cannot be read or names an option the command does not have."""


def read_config_file(path: str) -> dict[str, Any]:
    """The file's top-level table, by its extension: .json, .yaml/.yml, .toml."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read ({e.strerror})") from None
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(raw, object_pairs_hook=json_pairs(path))
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigFileError(f"--config {path}: YAML needs pyyaml (pip install 'packloader[yaml]'); "
                                      "or write the file as JSON or TOML") from None
            data = yaml.load(raw, Loader=yaml_loader(yaml, path))  # noqa: S506 - a SafeLoader
        elif suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10: the tomli backport (a dependency there)
                import tomli as tomllib

            data = tomllib.loads(raw.decode("utf-8"))
        else:
            raise ConfigFileError(f"--config {path}: expected a .json, .yaml, .yml or .toml file")
    except RepeatedKey as e:
        raise ConfigFileError(str(e)) from None
    except ConfigFileError:
        raise
    except Exception as e:  # noqa: BLE001 - each format's own parse error, named with the file
        raise ConfigFileError(f"--config {path}: not valid {suffix[1:].upper()}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a table of options at the top, got {type(data).__name__}")
    return data


def _flatten(data: dict[str, Any], path: str) -> dict[str, Any]:
    """`parallel` as a table of ParallelConfig fields (checked by msgspec, naming an unknown one) or flat keys."""
    out = {k: v for k, v in data.items() if k != "parallel"}
    if "parallel" in data:
        par = data["parallel"]
        if not isinstance(par, dict):
            raise ConfigFileError(f"--config {path}: key 'parallel' must be a table of {_names(ParallelConfig)}")
        try:
            msgspec.convert(par, ParallelConfig)
        except msgspec.ValidationError as e:
            raise ConfigFileError(f"--config {path}: key 'parallel': {e}") from None
        for k, v in par.items():
            if k in out:
                raise ConfigFileError(f"--config {path}: '{k}' given both at the top and under 'parallel'")
            out[k] = v
    return out


def _names(struct: type) -> str:
    return ", ".join(f.name for f in mi.type_info(struct).fields)


def _value(action: argparse.Action, key: str, value: Any, path: str) -> Any:
    """The file's value as argparse would have stored it: run through the flag's type (bounds named), checked
    against its choices; a switch takes true or false."""
    where = f"--config {path}: key '{key}' ({'/'.join(action.option_strings) or action.dest})"
    if getattr(action, "takes_table", False) and isinstance(value, dict):
        return value  # a table the command reads itself (--mixture)
    if action.nargs == 0:  # a switch: a layout field's value itself, or a flag's on (true) / off (false)
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: expected true or false, got {value!r}")
        if action.dest.startswith("layout_"):
            return value
        return action.const if value else action.default
    if isinstance(action, argparse._AppendAction):  # a repeatable flag (--plugin): one value or a list of them
        return [_one(action, where, v) for v in (value if isinstance(value, list) else [value])]
    if isinstance(value, dict) and action.metavar == "JSON":  # a dict field (planner_options): a table in the file
        value = json.dumps(value)
    if isinstance(value, (dict, list)) and action.nargs not in ("*", "+"):
        raise ConfigFileError(f"{where}: expected a single value, got {value!r}")
    if action.nargs in ("*", "+"):
        value = value if isinstance(value, list) else [value]
        return [_one(action, where, v) for v in value]
    return _one(action, where, value)


def _one(action: argparse.Action, where: str, value: Any) -> Any:
    """A number, a word or a path, as the flag's type reads it. Options without a type (paths, names) take a
    string only: a number or a boolean there is a mistake (`"out": 2` would name file descriptor 2, stderr)."""
    if action.type in (None, str) and not isinstance(value, str):
        raise ConfigFileError(f"{where}: expected a string (a path or name, as the flag takes it), got "
                              f"{type(value).__name__} {json.dumps(value)}")
    if isinstance(value, bool):  # not a number: true would read as 1
        raise ConfigFileError(f"{where}: expected a value as {action.option_strings[0]} takes it, got "
                              f"{json.dumps(value)} (true and false are for switches)")
    if action.type is not None:
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise ConfigFileError(f"{where}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigFileError(f"{where}: expected one of {list(action.choices)}, got {value!r}")
    return value


def _unknown_key(key: str, path: str, by_dest: dict[str, argparse.Action]) -> str:
    """The message for a key the command has no option for: the keys it has (the `parallel` table only where
    the command takes the layout flags) and the closest one, since the usual cause is a misspelling."""
    known = sorted(d.removeprefix("layout_") for d in by_dest if d != "layout_given")
    close = difflib.get_close_matches(key.replace("-", "_"), known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    layout = any(d.startswith("layout_") and d != "layout_given" for d in by_dest)
    table = f" (or 'parallel': a table of {_names(ParallelConfig)})" if layout else ""
    return f"--config {path}: unknown key '{key}' for this command; expected one of: {', '.join(known)}{table}{hint}"


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the file's values the parser's defaults (so flags given on the command line win), and required
    options it gives optional. Layout keys count as given (a command's mode defaults do not replace them)."""
    data = read_config_file(path)
    for table in (data, data.get("parallel") if isinstance(data.get("parallel"), dict) else {}):
        check_spellings(table, path, ConfigFileError)
    data = _flatten(data, path)
    by_dest = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "log_level")}
    defaults: dict[str, Any] = {}
    given: set[str] = set()
    for key, value in data.items():
        dest = key.replace("-", "_")
        action = by_dest.get("layout_" + dest) or by_dest.get(dest)
        if action is None or dest == "layout_given":
            raise ConfigFileError(_unknown_key(key, path, by_dest))
        defaults[action.dest] = _value(action, key, value, path)
        action.required = False
        if action.dest.startswith("layout_"):
            given.add(action.dest)
    parser.set_defaults(**defaults)
    if given:
        parser.set_defaults(layout_given=set(parser.get_default("layout_given") or set()) | given)
