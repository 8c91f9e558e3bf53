"""Import paths that issue 34 renamed, kept for one release: importing an old path gives a module whose every
attribute is the new module's, with a DeprecationWarning naming the new path. A finder on sys.meta_path serves
them, so no file stays at an old path (git follows each rename, and the old names cannot be edited by mistake)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

_P = "packloader.balancers.planners"
# old dotted path -> new dotted path
RENAMED: dict[str, str] = {
    "packloader.collate.cp_shard": "packloader.collate.cp_sequence_shards",
    "packloader.collate.cp_dynamic": "packloader.collate.cp_document_shards",
    "packloader.balancers.cost.cp_shard": "packloader.balancers.cost.cp_shard_attention",
    "packloader.runtime.cp_dynamic": "packloader.runtime.cp_document_attention",
    "packloader.report.dynamic_cp": "packloader.report.doc_cp_row",
    "packloader_integrations.megatron.dynamic_cp": "packloader_integrations.megatron.hybrid_cp_batches",
    f"{_P}.dynamic_cp": f"{_P}.doc_cp.planner",
    **{f"{_P}.dynamic_cp_{s}": f"{_P}.doc_cp.{s}" for s in ("chains", "choice", "kernels", "mix", "price", "units")},
}


def _alias(old: str, new: str) -> types.ModuleType:
    module = types.ModuleType(old, f"Deprecated: renamed to {new}.")

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{old} is renamed {new}; import {name} from there ({old} goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


class _Renamed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in RENAMED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _alias(spec.name, RENAMED[spec.name])

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Put the finder on sys.meta_path once (packloader's __init__ calls it)."""
    if not any(isinstance(f, _Renamed) for f in sys.meta_path):
        sys.meta_path.append(_Renamed())
