"""Hugging Face `datasets` objects as sources: a `Dataset` (in memory or memory-mapped), one split of a
`DatasetDict`, and a `save_to_disk` folder. `IterableDataset` is in `hf_iterable.py`.

A `Dataset` is read through its Arrow table (`arrow_table.ArrowTableSource`: one shard, random access, the column
rule of Parquet), honouring its index mapping, so a shuffled or selected `Dataset` reads the rows it shows. Its
format (`with_format("torch")`, ...) does not matter. A `DatasetDict` with one split is that split; with several it
is an error listing them: pass the split (`dd["train"]`). `datasets` is imported only when such an object or
folder is opened (the `hf` extra).
"""

from __future__ import annotations

import os

import numpy as np

from packloader.sources.arrow_table import ArrowTableSource
from packloader.sources.errors import SourceError


def is_datasets_object(obj) -> bool:
    """True for datasets.Dataset, IterableDataset, DatasetDict, IterableDatasetDict (without importing datasets)."""
    return any(c.__module__.startswith("datasets.") for c in type(obj).__mro__)


def is_disk_folder(path: str) -> bool:
    """A folder `save_to_disk` wrote: `state.json` beside `dataset_info.json` (Dataset), or `dataset_dict.json`."""
    if not os.path.isdir(path):
        return False
    has = set(os.listdir(path))
    return {"state.json", "dataset_info.json"} <= has or "dataset_dict.json" in has


def dataset_name(ds) -> str:
    """A label for errors: the folder of its Arrow files when it has them, else its fingerprint and size."""
    files = getattr(ds, "cache_files", None) or []
    if files:
        return os.path.dirname(files[0]["filename"])
    return f"datasets.Dataset(fingerprint={getattr(ds, '_fingerprint', '?')}, {ds.num_rows} rows)"


def dataset_source(ds, *, column: str | None = None, empty: str = "error", name: str | None = None):
    """A `Source` over a `Dataset`, or over the one split of a `DatasetDict` (an error when it has several)."""
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(ds)
        if len(splits) != 1:
            raise SourceError(f"{name or 'a DatasetDict'} has splits {splits}; which to train is not guessed: pass one "
                              f"split, e.g. dd[{splits[0]!r}]" if splits else f"{name or 'a DatasetDict'} has no splits")
        return dataset_source(ds[splits[0]], column=column, empty=empty,
                              name=f"{name}[{splits[0]!r}]" if name else None)
    if isinstance(ds, datasets.IterableDataset):
        from packloader.sources.hf_iterable import IterableDatasetSource

        return IterableDatasetSource(ds, column=column, empty=empty, name=name)
    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"expected a datasets.Dataset, IterableDataset or DatasetDict, got {type(ds).__name__}")
    return DatasetSource(ds, column=column, empty=empty, name=name)


class DatasetSource(ArrowTableSource):
    """A `Dataset`'s table as one shard. Pickled (spawned workers) through the `Dataset`, which datasets pickles by
    its Arrow files' paths when memory-mapped, rather than through a copy of the table."""

    def __init__(self, ds, *, column: str | None = None, empty: str = "error", name: str | None = None) -> None:
        self._dataset = ds
        indices = ds._indices  # the index mapping of a shuffled/selected Dataset (None: rows as stored)
        mapping = None if indices is None else np.asarray(indices.column(0).to_numpy(), dtype=np.int64)
        super().__init__([(name or dataset_name(ds), ds.data.table, mapping)], column=column, empty=empty)
        self.identities = [f"datasets fingerprint {ds._fingerprint}"]  # how a saved state knows the data again

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_columns"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._columns = [self._dataset.data.table.column(self.column)]


def disk_source(path: str, *, column: str | None = None, empty: str = "error"):
    """A `save_to_disk` folder, loaded (memory-mapped) with `datasets.load_from_disk`."""
    try:
        import datasets
    except ImportError as e:
        raise SourceError(f"{path}: a datasets save_to_disk folder; reading it needs the datasets package "
                          "(pip install 'packloader[hf]')") from e
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message names the folder
        raise SourceError(f"{path}: a save_to_disk folder that datasets cannot load ({type(e).__name__}: {e})") from e
    return dataset_source(ds, column=column, empty=empty, name=path)
