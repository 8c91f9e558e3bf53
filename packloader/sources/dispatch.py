"""`open_any(obj)`: whatever a user hands `PackedLoader` as its source, as a `Source`: a `Source` (it has `shards`
and `read`) as it is, anything else through `open_source` (paths, and objects in place of paths: `objects.py`),
which says what is unsupported and lists what is supported.
"""

from __future__ import annotations

from packloader.sources.open import open_source


def open_any(obj, *, column: str | None = None, empty: str = "error"):
    if hasattr(obj, "shards") and hasattr(obj, "read"):
        return obj
    return open_source(obj, column=column, empty=empty)
