"""Objects a user hands `open_source` or `PackedLoader` in place of paths: `datasets` objects (`hf_datasets.py`,
`hf_iterable.py`), a `pyarrow.Table`, and lists, tuples, generators or iterators (`python_objects.py`: paths or
texts by its rule, dicts, token arrays). Anything else is unsupported, with the list of what is supported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from packloader.sources.unsupported import unsupported_object


def open_object(obj, *, column: str | None = None, empty: str = "error"):
    """(source, None) for an object read as documents; (None, paths) for a list of paths (open_source reads them)."""
    from packloader.sources.hf_datasets import dataset_source, is_datasets_object
    from packloader.sources.remote_open import open_remote
    from packloader.sources.storage import StoragePaths

    if isinstance(obj, StoragePaths):
        return open_remote(obj.paths, storage=obj.storage, column=column, format=None, empty=empty), None
    if is_datasets_object(obj):
        return dataset_source(obj, column=column, empty=empty), None
    if type(obj).__module__.startswith("pyarrow") and hasattr(obj, "schema") and hasattr(obj, "column"):
        from packloader.sources.arrow_table import ArrowTableSource

        label = f"<pyarrow.Table of {obj.num_rows} rows>"
        return ArrowTableSource([(label, obj, None)], column=column, empty=empty), None
    if not isinstance(obj, (list, tuple, Iterator)):
        raise unsupported_object(obj)
    from packloader.sources.python_objects import python_source, strings_are_paths

    items = list(obj)
    if not items:
        return None, []  # open_source says it needs a path
    if items and all(isinstance(x, (str, os.PathLike)) for x in items):
        paths = [os.fspath(x) for x in items]
        if any(isinstance(x, os.PathLike) for x in items) or strings_are_paths(paths):
            return None, paths  # a Path object is never a text
    label = f"<{'generator' if isinstance(obj, Iterator) else type(obj).__name__} of {len(items)} items>"
    return python_source(items, column=column, empty=empty, label=label), None
