"""Document lengths for the report (and any command that plans from lengths): a lengths file, or a source read
in the loader's epoch order and tokenized as the loader would (EOS appended), stopping as soon as enough
documents are known.

A lengths file is one of:

* ``.npy``: a 1-D array of non-negative integers;
* ``.parquet`` / ``.pq``: an integer column (``--lengths-column``, default ``length``), or a ``tokens`` list
  column whose list sizes are taken;
* anything else: text, one integer per line (blank lines and ``#`` comments ignored).

Empty documents (length 0) are left out and counted, as the loader does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np


from packloader.balancers.offline import LengthsError  # one error type for every lengths reader (`packloader plan` too)


@dataclass
class Lengths:
    """Document lengths in draw order, and what was left out on the way."""

    lengths: np.ndarray  # int64, every entry >= 1
    origin: str  # the file or source they came from, for the report
    empty: int = 0  # documents of length 0 left out
    exhausted: bool = True  # True when every document of the input was read


def _check_values(values: np.ndarray, path: str) -> np.ndarray:
    if values.ndim != 1:
        raise LengthsError(f"{path}: expected a 1-D array of lengths, got shape {values.shape}")
    if values.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
        if len(bad):
            raise LengthsError(f"{path}: entry {int(bad[0])} is {float(values[bad[0]])!r}, expected a whole number of tokens")
    elif values.dtype.kind not in "iu":
        raise LengthsError(f"{path}: expected integer lengths, got dtype {values.dtype}")
    out = values.astype(np.int64)
    neg = np.flatnonzero(out < 0)
    if len(neg):
        raise LengthsError(f"{path}: entry {int(neg[0])} is {int(out[neg[0]])}, expected a length >= 0")
    return out


def _read_text(path: str) -> np.ndarray:
    vals: list[int] = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").split("#", 1)[0].strip()
            except UnicodeDecodeError:
                raise LengthsError(f"{path}, line {no}: not UTF-8 text; expected one integer length per line") from None
            if not line:
                continue
            try:
                v = int(line)
            except ValueError:
                raise LengthsError(f"{path}, line {no}: {line[:40]!r} is not an integer; expected one length per line") from None
            if v < 0:
                raise LengthsError(f"{path}, line {no}: {v} is negative; expected a length >= 0")
            vals.append(v)
    return np.asarray(vals, dtype=np.int64)


def _read_parquet(path: str, column: str | None) -> np.ndarray:
    import pyarrow.parquet as pq
    import pyarrow.compute as pc
    import pyarrow as pa

    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises several types for a non-Parquet file
        raise LengthsError(f"{path}: not a readable Parquet file ({e})") from None
    names = schema.names
    col = column or ("length" if "length" in names else "tokens" if "tokens" in names else None)
    if col is None or col not in names:
        raise LengthsError(f"{path}: no column {column or 'length'!r}; columns are {names}; pass --lengths-column")
    arr = pq.read_table(path, columns=[col]).column(col).combine_chunks()
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = pc.list_value_length(arr)
    if arr.null_count:
        first = int(np.flatnonzero(np.asarray(arr.is_null()))[0])
        raise LengthsError(f"{path}: column {col!r} row {first} is null, expected a length")
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        raise LengthsError(f"{path}: column {col!r} has type {arr.type}, expected integer lengths or token lists")
    return _check_values(np.asarray(arr.to_numpy(zero_copy_only=False)), f"{path} column {col!r}")


def read_lengths(path: str | os.PathLike, column: str | None = None, *, empty: str = "drop") -> Lengths:
    """Lengths from a .npy, Parquet or text file (see the module docstring). `empty="drop"` leaves zero lengths
    out and counts them (the loader's behaviour); `empty="error"` rejects them, naming the first (for callers
    whose document ids are positions in the file)."""
    if empty not in ("drop", "error"):
        raise ValueError(f"empty must be 'drop' or 'error', got {empty!r}")
    text = os.fspath(path)
    if not os.path.exists(text):
        raise FileNotFoundError(f"lengths file {text!r} does not exist")
    if os.path.isdir(text):
        raise LengthsError(f"{text}: is a directory; a lengths file is .npy, .parquet or text with one length per line")
    suffix = Path(text).suffix.lower()
    if suffix == ".npy":
        try:
            values = np.load(text, allow_pickle=False)
        except Exception as e:
            raise LengthsError(f"{text}: not a readable .npy array ({e})") from None
        values = _check_values(np.asarray(values), text)
    elif suffix in (".parquet", ".pq"):
        values = _read_parquet(text, column)
    else:
        values = _read_text(text)
    zeros = np.flatnonzero(values == 0)
    if len(zeros) and empty == "error":
        raise LengthsError(f"{text}: entry {int(zeros[0])} is 0, expected a positive length")
    values = values[values > 0]
    if len(values) == 0:
        raise LengthsError(f"{text}: holds no non-empty document lengths")
    return Lengths(np.ascontiguousarray(values, dtype=np.int64), text, empty=len(zeros))


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
