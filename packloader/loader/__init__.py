"""The loader: torchdata nodes from shards to this rank's collated micro-batches, resumable exactly."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "PackedLoader": "packloader.loader.loader",
    "PackedDataset": "packloader.loader.dataset",
    "LoaderStats": "packloader.contracts",
    "LoaderOptions": "packloader.loader.state",
    "SavedState": "packloader.loader.state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'packloader.loader' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
