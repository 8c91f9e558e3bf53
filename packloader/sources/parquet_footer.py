"""What a Parquet footer tells without reading row groups: a remote shard's footer parsed from the bytes its
identity check fetched (so no handle fetches it again), and the lengths that row-group statistics state, so a
rank plans from the footer alone and reads only the row groups it trains."""

from __future__ import annotations

import struct

import pyarrow as pa
import pyarrow.parquet as pq


def parsed_footer(watch) -> pq.FileMetaData | None:
    """The footer a remote shard's watch fetched, parsed, so that opening the shard fetches nothing more."""
    raw = getattr(watch, "footer", b"")
    if not raw:
        return None
    try:
        return pq.read_metadata(pa.BufferReader(b"PAR1" + raw + struct.pack("<i", len(raw)) + b"PAR1"))
    except (pa.ArrowException, OSError):
        return None  # opening the object names the problem


def constant_lengths(meta: pq.FileMetaData, column: str, group: int | None = None) -> list[int | None]:
    """Per row group (or for `group` alone), the one length its rows have where the statistics of the length
    column say so (min == max, no nulls), else None: that row group's column must be read."""
    leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
    index = leaves.index(column) if column in leaves else -1
    groups = range(meta.num_row_groups) if group is None else [group]
    return [_constant_length(meta.row_group(g), index) for g in groups]


def _constant_length(group: pq.RowGroupMetaData, index: int) -> int | None:
    """The one length every row of a row group has, where its statistics say so (else None: read the column)."""
    if index < 0 or index >= group.num_columns:
        return None
    stats = group.column(index).statistics
    if stats is None or not stats.has_min_max or not stats.has_null_count or stats.null_count:
        return None
    lo, hi = stats.min, stats.max
    return int(lo) if isinstance(lo, int) and lo == hi and lo >= 0 else None
