"""The built-in formats' openers, named by `format_registry`: each takes the paths `open_source` resolved and the
options it was given, and returns the format's reader. Imports are lazy so the registry stays cheap to import."""

from __future__ import annotations

import os


def open_parquet(paths, *, column, empty, storage=None, **_):
    from packloader.sources.parquet import ParquetSource

    if storage is not None:
        return ParquetSource(paths, column=column, empty=empty, storage=storage)
    return ParquetSource(paths, column=column, empty=empty)


def open_jsonl(paths, *, column, empty, storage=None, **_):
    from packloader.sources.jsonl import JsonlSource

    if storage is not None:
        return JsonlSource(paths, field=column, empty=empty, storage=storage)
    return JsonlSource(paths, field=column, empty=empty)


def open_mds(paths, *, column, empty, storage=None, **_):
    from packloader.sources.mds import MdsSource

    if len(paths) != 1:
        raise ValueError(f"MDS takes one directory (the one holding index.json), got {paths}")
    if storage is not None:
        return MdsSource(paths[0], column=column, empty=empty, storage=storage)
    return MdsSource(paths[0], column=column, empty=empty)


def open_directory(paths, *, empty, pattern="**/*", files_per_shard=256, errors="error", **_):
    from packloader.sources.directory import DirectorySource

    if len(paths) != 1 or not os.path.isdir(paths[0]):
        raise ValueError(f"format='directory' takes one directory, got {paths}")
    return DirectorySource(paths[0], pattern, files_per_shard=files_per_shard, errors=errors, empty=empty)


def open_arrow(paths, *, column, empty, **_):
    from packloader.sources.arrow_table import arrow_files_source

    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such file: {p}")
    return arrow_files_source(paths, column=column, empty=empty)


def open_megatron(paths, *, empty, **_):
    from packloader.sources.megatron_indexed import MegatronIndexedSource

    return MegatronIndexedSource(paths, empty=empty)


def open_hf_disk(paths, *, column, empty, **_):
    from packloader.sources.hf_datasets import disk_source

    if len(paths) != 1:
        raise ValueError(f"format='hf-disk' takes one save_to_disk folder, got {paths}")
    return disk_source(paths[0], column=column, empty=empty)
