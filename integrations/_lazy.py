"""Optional-dependency imports for the adapters: import a framework only when an adapter function needs it, and
say which extra installs it when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

# module root -> (pip distribution, packloader extra)
_EXTRAS = {
    "megatron": ("megatron-core", "megatron"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "transformers": ("transformers", "hf"),
}


class MissingExtraError(ImportError):
    """A framework an adapter needs is not installed; the message names the extra that installs it."""


def require(module: str) -> ModuleType:
    """Import `module` (e.g. "megatron.core.packed_seq_params") or raise MissingExtraError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        root = module.split(".")[0]
        dist, extra = _EXTRAS.get(root, (root, None))
        hint = f"pip install 'packloader[{extra}]'" if extra else f"pip install {dist}"
        raise MissingExtraError(
            f"{module} could not be imported ({e.__class__.__name__}: {e}); this adapter needs {dist}: {hint}"
        ) from e
