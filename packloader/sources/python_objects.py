"""Python objects as sources: lists and generators of texts, token arrays or dicts, and `pyarrow.Table`s.

Semantics (documented in the README's sources and in `docs/bad-input.md`):
- a list or tuple of `str` is a list of paths when every string names an existing file or directory or a glob
  that matches, or looks like one (no whitespace, or a URL: then the missing path is named, or the URL refused);
  a list where every string holds whitespace (as documents do and paths rarely do) and none names a file is a
  list of texts, one document each; anything between is an error quoting one string of each kind (a text cut to
  60 characters), never a text read as a path or a mistyped path trained as text. One-word texts: pass them as
  `[{"text": ...}]` dicts;
- a list of dicts is a table: the column rule of Parquet picks the text or token key (both: an error asking for
  `column=`), a row without it is an error naming the row;
- a list of integer arrays or lists is pre-tokenized documents (`IterableSource`);
- a generator or other iterator is read to its end once, when the source opens, and kept in memory (the loader
  needs the epoch's length and random access for exact resume): for corpora larger than memory write shards
  (`packloader tokenize`) or pass a `datasets.IterableDataset`. A resumed run must get the same documents from it.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from packloader.sources.arrow_table import ArrowTableSource
from packloader.sources.base import IterableSource
from packloader.sources.errors import SourceError
from packloader.sources.paths import has_magic, walk_glob
from packloader.sources.unsupported import excerpt, url_scheme


def looks_like_path(s: str) -> bool:
    """A string without whitespace (as paths are, and documents rarely), or a URL."""
    return not any(c.isspace() for c in s) or url_scheme(s) is not None


def _exists(s: str) -> bool:
    return os.path.exists(s) or (has_magic(s) and bool(walk_glob(s)))  # walk_glob never loops through symlinks


def strings_are_paths(items: list[str], label: str = "the list") -> bool:
    """True for paths, False for texts, by the rule in the module docstring; an error for a mix."""
    exist = [_exists(s) for s in items]
    if all(exist):
        return True
    pathlike = [e or looks_like_path(s) for s, e in zip(items, exist)]
    if all(pathlike):
        return True  # open_source names the missing path (or says a URL is unsupported)
    if not any(pathlike):
        return False
    path = next(s for s, p in zip(items, pathlike) if p)
    text = next(s for s, p in zip(items, pathlike) if not p)
    raise SourceError(
        f"{label} of {len(items)} strings mixes paths ({sum(pathlike)}, e.g. {excerpt(path, 200)}) and texts "
        f"({len(items) - sum(pathlike)}, e.g. {excerpt(text)}); a list of strings is read as paths when every one "
        "names an existing file, and as texts when every one holds whitespace and none names a file: pass only "
        "paths, or the texts as [{'text': ...}] dicts"
    )


def python_source(items: list, *, column: str | None = None, empty: str = "error", label: str | None = None):
    """A source over Python values, by the rules in the module docstring (strings already known to be texts)."""
    if not items:
        raise SourceError(f"{label or 'an empty list'}: no documents")
    first = items[0]
    if isinstance(first, str):
        kind, ok = "texts", all(isinstance(x, str) for x in items)
    elif isinstance(first, dict):
        kind, ok = "dicts", all(isinstance(x, dict) for x in items)
    else:
        kind, ok = "token arrays", all(not isinstance(x, (str, dict)) for x in items)
    label = label or f"<list of {len(items)} {kind}>"
    if not ok:
        odd = next(i for i, x in enumerate(items) if type(x) is not type(first) and not (
            kind == "token arrays" and not isinstance(x, (str, dict))))
        raise SourceError(f"{label}, row {odd}: {type(items[odd]).__name__} {excerpt(items[odd])}, expected {kind} "
                          f"like row 0 (one kind per list)")
    if kind == "token arrays":
        return _token_arrays(items, label)
    try:
        table = pa.table({"text": pa.array(items, type=pa.large_string())}) if kind == "texts" else \
            pa.Table.from_pylist(items)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise SourceError(f"{label}: the dicts' values do not form columns of one type each ({e})") from e
    return ArrowTableSource([(label, table, None)], column="text" if kind == "texts" else column, empty=empty)


def _token_arrays(items: list, label: str) -> IterableSource:
    for i, x in enumerate(items):
        a = np.asarray(x)
        if a.ndim == 1 and a.dtype == object and any(v is None for v in a):
            raise SourceError(f"{label}, row {i}: a null token id at position "
                              f"{next(k for k, v in enumerate(a) if v is None)}, expected an id in [0, 2^31)")
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise SourceError(f"{label}, row {i}: {a.dtype} values of shape {a.shape}, expected texts, dicts or "
                              "1-D integer token arrays")
        if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
            raise SourceError(f"{label}, row {i}: token id outside [0, 2^31)")
    return IterableSource(items, name=label)
