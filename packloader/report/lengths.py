"""Document lengths for the report (and any command that plans from lengths): a lengths file, or a source read
in the loader's epoch order and tokenized as the loader would (EOS appended), stopping as soon as enough
documents are known.

Lengths files are read by `packloader.sources.lengths_file.read_lengths` (shared with `packloader plan`; its
docstring lists the formats); the report drops empty documents (length 0) and counts them, as the loader does.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# one reader and one error type for every lengths file (`packloader plan` too); re-exported here for the report
from packloader.sources.lengths_file import Lengths, LengthsError, read_lengths

__all__ = ["Lengths", "LengthsError", "describe_source", "read_lengths", "source_lengths"]


def source_lengths(
    stream,
    enough: Callable[[np.ndarray], bool] | None = None,
    *,
    batch: int = 256,
    progress: bool = True,
    desc: str = "tokenize",
) -> Lengths:
    """Lengths of a `DocumentStream`'s documents in its epoch order (tokenized, EOS appended as configured),
    reading batches until `enough(the batch's lengths)` (called on each new batch in order) says so or the
    epoch ends. A length column, where the source
    has one, is used without reading tokens."""
    from tqdm.auto import tqdm

    n = stream.num_docs
    got: list[np.ndarray] = []
    pos = 0
    exhausted = True
    column = stream.has_column_lengths
    bar = tqdm(total=n, desc=desc, unit="doc", disable=not progress, leave=False, dynamic_ncols=True)
    tokens = 0
    try:
        while pos < n:
            end = min(n, pos + (batch * 64 if column else batch))
            ids = stream.doc_ids(0, np.arange(pos, end))
            if column:
                lens = stream.column_lengths(ids)
            else:
                lens = np.fromiter((len(t) for t in stream.read(ids)), dtype=np.int64, count=len(ids))
            got.append(lens)
            tokens += int(lens.sum())
            bar.update(end - pos)
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
            pos = end
            if enough is not None and pos < n and enough(lens):
                exhausted = False
                break
    finally:
        bar.close()
    values = np.concatenate(got) if got else np.zeros(0, np.int64)
    empty = int((values == 0).sum())
    values = values[values > 0]
    if len(values) == 0:
        raise LengthsError(f"{stream.source.shards[0].name}: the source holds no non-empty documents")
    return Lengths(values, origin=describe_source(stream.source), empty=empty, exhausted=exhausted)


def describe_source(source) -> str:
    shards = [s.name for s in source.shards]
    kind = type(source).__name__
    if len(shards) == 1:
        return f"{kind} {shards[0]}"
    return f"{kind} ({len(shards)} shards: {shards[0]} ...)"
