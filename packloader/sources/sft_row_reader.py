"""The interface every SFT row reader gives (`sft_rows.py`, `sft_stored_rows.py`): shards of whole rows."""

from __future__ import annotations

from typing import Any, Sequence

from packloader.sources.base import ShardInfo


class RowReader:
    """Shards of rows; `rows(shard, rows)` returns dicts in the order asked; `location` names a row in errors."""

    shards: list[ShardInfo]

    def rows(self, shard: int, rows: Sequence[int]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def location(self, shard: int, row: int) -> str:
        return f"{self.shards[shard].name}, row {row}"
