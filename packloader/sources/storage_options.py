"""The checks on `Storage`'s numbers and on the environment variables it reads, apart from `storage.py` so each
refusal says what was given and what works: a block of a few bytes costs a request per few bytes (a 275 KB
JSONL at `block_size=1` was still being read after 10 minutes), a cache directory without a bound caches
nothing, and `PACKLOADER_CACHE_BYTES=1G` is how people write sizes."""

from __future__ import annotations

import operator
import os
import re

# The smallest block a ranged read fetches (0: exact ranges). Below it each request carries so few bytes that
# reading a shard takes a request per few bytes; the tests' smallest blocks (4 KiB) still read a shard in a few.
MIN_BLOCK_SIZE = 512  # a 275 KB shard is then at most 540 requests; tests read small files in several blocks

CACHE_DIR_ENV = "PACKLOADER_CACHE_DIR"
CACHE_BYTES_ENV = "PACKLOADER_CACHE_BYTES"

# Kubernetes' quantity suffixes: k, M, G, T powers of 1000, Ki, Mi, Gi, Ti powers of 1024; a trailing B allowed.
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
SIZE_FORMS = "a whole number of bytes, or a number with a unit: 1G (10^9), 512Mi (2^29), 64KiB, 2.5GB"


def parse_bytes(text: str, name: str) -> int:
    """A size as people write it (`SIZE_FORMS`); a ValueError naming `name` and the forms otherwise."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"{name}={text!r}: expected {SIZE_FORMS}")
    number, unit = m.group(1), (m.group(2) or "").lower()
    scale = _UNITS[unit]
    if "." in number:
        value = float(number) * scale
        if value != int(value):
            raise ValueError(f"{name}={text!r} is {value:g} bytes, not a whole number; expected {SIZE_FORMS}")
        return int(value)
    return int(number) * scale


def cache_from_env() -> tuple[str | None, int]:
    """The disk cache the environment asks for: (`PACKLOADER_CACHE_DIR`, `PACKLOADER_CACHE_BYTES`), both or neither
    (one alone caches nothing, so it is an error naming the other)."""
    directory = os.environ.get(CACHE_DIR_ENV) or None
    text = os.environ.get(CACHE_BYTES_ENV, "").strip()
    size = parse_bytes(text, CACHE_BYTES_ENV) if text else 0
    if directory and size < 1:
        raise ValueError(f"{CACHE_DIR_ENV}={directory!r} without {CACHE_BYTES_ENV} (or with 0): the cache would "
                         f"hold nothing; set {CACHE_BYTES_ENV} to its bound ({SIZE_FORMS}), or unset {CACHE_DIR_ENV}")
    if size and not directory:
        raise ValueError(f"{CACHE_BYTES_ENV}={text!r} without {CACHE_DIR_ENV}: the cache has nowhere to live; set "
                         f"{CACHE_DIR_ENV} to a directory, or unset {CACHE_BYTES_ENV}")
    return directory, size


def _whole(value) -> int | None:
    """`value` as an int when it is a whole number (numpy's included, bool not), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_storage_options(*, block_size: int, cache_dir: str | None, cache_bytes: int,
                          index_dir: str | None = None) -> None:
    """Refuse a block size that cannot work, a disk cache that would hold nothing, and directories that are not
    paths."""
    for name, value in (("cache_dir", cache_dir), ("index_dir", index_dir)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"Storage({name}={value!r}): expected a directory path (str or os.PathLike), got "
                             f"{type(value).__name__}")
    block, cache = _whole(block_size), _whole(cache_bytes)
    if block is None or block < 0 or 0 < block < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size={block_size!r}: expected 0 (exact ranges) or a whole number of bytes >= "
                         f"{MIN_BLOCK_SIZE:,} (each block is a request; the default is 4 MiB)")
    if cache is None or cache < 0:
        raise ValueError(f"cache_bytes={cache_bytes!r}: expected a whole number of bytes >= 0")
    block_size, cache_bytes = block, cache
    if cache_dir and cache_bytes == 0:
        raise ValueError(f"Storage(cache_dir={os.fspath(cache_dir)!r}) without cache_bytes: the disk cache would "
                         "hold nothing; pass cache_bytes=N, its bound in bytes (e.g. 64 << 30)")
    if cache_bytes and not cache_dir:
        raise ValueError(f"Storage(cache_bytes={cache_bytes}) without cache_dir: the disk cache has nowhere to live; "
                         "pass cache_dir=DIR as well")
    if cache_dir and 0 < cache_bytes < block_size:
        raise ValueError(f"Storage(cache_bytes={cache_bytes:,}) is below block_size={block_size:,}: no block would "
                         "fit in the disk cache; expected cache_bytes >= block_size")
