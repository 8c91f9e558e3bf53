"""What `packloader tokenize` reads, opened the same way by the CLI and by each Ray task (`tokenize_ray.py`)."""

from __future__ import annotations

import os
from typing import Any


def open_input(inputs: list[str], open_options: dict[str, Any]):
    """What `tokenize` reads: `open_source(inputs, **open_options)`, or the standard library's .py files for
    ["stdlib"] (where no file of that name exists)."""
    from packloader.sources.directory import stdlib_corpus
    from packloader.sources.open import open_source

    if list(inputs) == ["stdlib"] and not os.path.exists("stdlib"):
        return stdlib_corpus()
    return open_source(list(inputs), **open_options)
