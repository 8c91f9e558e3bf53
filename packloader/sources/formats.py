"""Shard formats by file name: `format_registry` holds them; this module keeps the names older modules import."""

from __future__ import annotations

from packloader.sources.format_registry import format_names, format_of  # noqa: F401 - imported from here


def __getattr__(name: str):
    if name == "FORMATS":  # read each time: a plugin may register a format after import
        return format_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
