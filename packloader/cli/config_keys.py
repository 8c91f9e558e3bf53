"""Repeated keys in a `--config` file are refused, naming both: JSON and YAML parsers keep the last value of a key
given twice, and `max_tokens` beside `max-tokens` is one option under two spellings, so either way the last one
would silently win. (TOML's parser refuses a repeated key itself.)"""

from __future__ import annotations

from typing import Any, Callable


class RepeatedKey(ValueError):
    """A key given twice in one table of a config file, or one option under two spellings."""


def json_pairs(path: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """An `object_pairs_hook` for json.loads that refuses a key given twice in one object."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise RepeatedKey(f"--config {path}: key '{k}' is given twice in one table (values {out[k]!r} and "
                                  f"{v!r}); the last would silently win: keep one")
            out[k] = v
        return out

    return hook


def yaml_loader(yaml: Any, path: str) -> type:
    """A yaml.SafeLoader that refuses a key given twice in one mapping, naming both lines."""

    class NoRepeats(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise RepeatedKey(f"--config {path}: key '{key}' is given twice in one mapping (lines "
                                      f"{seen[key]} and {line}); the last would silently win: keep one")
                if isinstance(key, (str, int, float, bool)):
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return NoRepeats


def check_spellings(data: dict[str, Any], path: str, error: type[Exception] = RepeatedKey) -> None:
    """Raise `error` for two keys that name one option (`max_tokens` and `max-tokens`), naming both."""
    seen: dict[str, str] = {}
    for key in data:
        dest = key.replace("-", "_")
        if dest in seen:
            raise error(f"--config {path}: keys '{seen[dest]}' and '{key}' name the same option ({dest}); the "
                        "last would silently win: keep one")
        seen[dest] = key
