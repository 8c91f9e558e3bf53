"""`open_any(obj)`: whatever a user hands `PackedLoader` as its source, as a `Source`, or an error that says what
is unsupported and lists what is supported (`unsupported.py`).

In order: a `Source` (it has `shards` and `read`) as it is; a path, glob or directory (`open_source`); a
`datasets` object (`hf_datasets.py`, `hf_iterable.py`); a `pyarrow.Table`; a list, tuple, generator or iterator
(`python_objects.py`: paths or texts by its rule, dicts, token arrays). Anything else is unsupported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from packloader.sources.unsupported import unsupported_object


def open_any(obj, *, column: str | None = None, empty: str = "error"):
    if hasattr(obj, "shards") and hasattr(obj, "read"):
        return obj
    from packloader.sources.open import open_source

    if isinstance(obj, (str, os.PathLike)):
        return open_source(obj, column=column, empty=empty)
    from packloader.sources.hf_datasets import dataset_source, is_datasets_object

    if is_datasets_object(obj):
        return dataset_source(obj, column=column, empty=empty)
    if type(obj).__module__.startswith("pyarrow") and hasattr(obj, "schema") and hasattr(obj, "column"):
        from packloader.sources.arrow_table import ArrowTableSource

        return ArrowTableSource([(f"<pyarrow.Table of {obj.num_rows} rows>", obj, None)], column=column, empty=empty)
    if isinstance(obj, (list, tuple, Iterator)):
        from packloader.sources.python_objects import python_source, strings_are_paths

        items = list(obj)
        if items and all(isinstance(x, os.PathLike) for x in items):
            return open_source(items, column=column, empty=empty)
        if items and all(isinstance(x, str) for x in items) and strings_are_paths(items):
            return open_source(items, column=column, empty=empty)
        label = f"<{'generator' if isinstance(obj, Iterator) else type(obj).__name__} of {len(items)} items>"
        return python_source(items, column=column, empty=empty, label=label)
    raise unsupported_object(obj)
