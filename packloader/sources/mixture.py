"""A weighted mixture of sources: its config Structs, their checks, and the deficit-greedy blend (pure, no I/O).

Relative entries (`weight`) share the trained *tokens*: the next document comes from the entry whose tokens lag
their share the most, `argmax_e(w_e * max(T, 1) - t_e)` over T tokens drawn, t_e of them from entry e (ties to
the first entry). For documents of one length this is megatron-core's `build_blending_indices` in tokens.
Absolute entries (`repeat` passes, or `choose` documents, per mixture epoch, as mosaicml-streaming's `Stream`)
draw exactly their quota each epoch, in the same greedy order with each entry's quota tokens as its share.
Relative and absolute entries do not mix in one mixture (streaming refuses it too). docs/mixtures.md has the rest.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec
import numpy as np
from numba import njit

from packloader.sources.upsample import LengthBand

EntryName = Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")]


class MixtureError(ValueError):
    """A mixture refused: the message names the entry (or entries) and what is expected."""


class MixtureEntry(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One source of a mixture. `source` is anything `PackedLoader` reads (a path, glob, list of paths, URL,
    `datasets` object, Megatron prefix, MDS directory). Exactly one of `weight`, `repeat`, `choose` may be
    given; none means `repeat=1` (one pass per mixture epoch)."""

    name: EntryName
    source: Any
    weight: float | None = None  # relative share of trained tokens
    repeat: float | None = None  # passes over the entry per mixture epoch (absolute; fractions take a prefix)
    choose: int | None = None  # documents per mixture epoch (absolute)
    column: str | None = None  # Parquet column / JSONL field / MDS column (None: detected)
    format: str | None = None  # open_source's format= (None: detected)
    tokenizer: str | None = None  # None: the loader's tokenizer
    # length bands: documents of at least min_tokens taken `times` times per pass of the entry (`upsample.py`)
    upsample: list[LengthBand] = []


class Mixture(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Named entries and, for relative weights, the documents per mixture epoch (None: every entry's documents
    added up, streaming's default epoch size)."""

    entries: list[MixtureEntry]
    epoch_docs: Annotated[int, msgspec.Meta(ge=1)] | None = None

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def relative(self) -> bool:
        return any(e.weight is not None for e in self.entries)


def as_mixture(obj) -> Mixture:
    """A Mixture from a Mixture or its dict (a config file's `mixture` table), bad fields named."""
    if isinstance(obj, Mixture):
        m = obj
    else:
        try:
            m = msgspec.convert(obj, Mixture, strict=False)
        except msgspec.ValidationError as e:
            raise MixtureError(f"mixture: {e}") from None
    check_mixture(m)
    return m


def _entry(e: MixtureEntry) -> str:
    return f"mixture entry {e.name!r}"


def check_mixture(m: Mixture) -> None:
    """The rules no single field states: one kind of weight per entry and per mixture, finite non-negative
    numbers, at least one positive, unique names."""
    if not m.entries:
        raise MixtureError("mixture: no entries; expected at least one")
    seen: set[str] = set()
    for e in m.entries:
        if e.name in seen:
            raise MixtureError(f"{_entry(e)} is named twice; expected unique entry names")
        seen.add(e.name)
        given = [k for k in ("weight", "repeat", "choose") if getattr(e, k) is not None]
        if len(given) > 1:
            raise MixtureError(f"{_entry(e)} gives {' and '.join(given)}; expected at most one of weight, repeat, "
                               "choose")
        for k in ("weight", "repeat"):
            v = getattr(e, k)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise MixtureError(f"{_entry(e)}: {k} {v!r}, expected a finite number >= 0")
        if e.choose is not None and e.choose < 0:
            raise MixtureError(f"{_entry(e)}: choose {e.choose}, expected a document count >= 0")
    rel = [e.name for e in m.entries if e.weight is not None]
    absolute = [e.name for e in m.entries if e.weight is None]
    if rel and absolute:
        raise MixtureError(f"mixture entries {absolute} give no weight while {rel} do: expected a weight on every "
                           "entry (relative) or none (repeat/choose, absolute)")
    if rel and not any(e.weight > 0 for e in m.entries):
        raise MixtureError(f"mixture: every weight is 0 (entries {rel}); expected at least one weight > 0")
    if not rel and m.epoch_docs is not None:
        raise MixtureError("mixture: epoch_docs applies to weights; with repeat/choose the epoch is their quotas")
    if not rel and not any((e.repeat is None and e.choose is None) or (e.repeat or 0) > 0 or (e.choose or 0) > 0
                           for e in m.entries):
        raise MixtureError(f"mixture: every entry's quota is 0 ({absolute}); expected at least one document")


def quotas(m: Mixture, entry_docs: list[int]) -> np.ndarray:
    """Absolute mixtures: documents each entry gives per mixture epoch (streaming's `int(repeat * samples)`)."""
    out = np.zeros(len(m.entries), np.int64)
    for i, (e, n) in enumerate(zip(m.entries, entry_docs)):
        if e.choose is not None:
            out[i] = e.choose
        elif e.repeat is not None:
            out[i] = int(e.repeat * n)
        else:
            out[i] = n
    return out


def shares(m: Mixture) -> np.ndarray:
    """Relative mixtures: each entry's share of tokens (weights normalised to sum 1)."""
    w = np.array([e.weight for e in m.entries], np.float64)
    return w / w.sum()


@njit(cache=True)
def blend_kernel(weights, quota, lengths, offsets, used, tokens, total, out_entry, out_index, first_index,
                 start, stop, unit):  # pragma: no cover - numba
    """Draws `start..stop-1` of the blend; returns where it stopped (an entry ran out of the lengths given).

    weights: share per entry (0: never drawn); quota: documents an entry may still give (-1: no limit);
    lengths[offsets[e]:offsets[e+1]]: entry e's next documents' lengths; used[e]: how many of those it gave;
    tokens[e], total[0]: tokens drawn (in/out); out_entry/out_index: the entry and its document index
    (first_index[e] + used[e]) of each draw. Deficits are in `unit`s of tokens (the mean document length): for
    documents of one length L = unit they are megatron-core's, bit for bit (T / L and t_e / L are exact)."""
    n = len(weights)
    for pos in range(start, stop):
        t = max(total[0], 1.0) / unit
        best = -1
        best_err = 0.0
        for e in range(n):
            if weights[e] <= 0.0 or quota[e] == 0:
                continue
            err = weights[e] * t - tokens[e] / unit
            if best < 0 or err > best_err:
                best, best_err = e, err
        if best < 0:
            return pos
        k = used[best]
        if offsets[best] + k >= offsets[best + 1]:
            return pos  # the caller gives this entry more lengths
        ln = lengths[offsets[best] + k]
        out_entry[pos] = best
        out_index[pos] = first_index[best] + k
        used[best] = k + 1
        tokens[best] += ln
        total[0] += ln
        if quota[best] > 0:
            quota[best] -= 1
    return stop


class BlendState(msgspec.Struct, kw_only=True):
    """Where the blend stands: each entry's next document index (its stream's id: pass * docs + position) and the
    tokens drawn since the shares were last set (a mixture change at resume starts them again)."""

    cursors: list[int]
    tokens: list[float]
    total: float = 0.0


def blend(weights: np.ndarray, quota: np.ndarray | None, state: BlendState, count: int, entry_lengths,
          unit: float = 1.0, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray, BlendState]:
    """The next `count` draws from `state`: (entry per draw int32, entry document index per draw int64, the state
    after). `entry_lengths(e, first, n)` gives the lengths of entry e's documents first..first+n-1; `unit`: the
    token count deficits are measured in (`blend_kernel`)."""
    n = len(weights)
    out_e = np.full(count, -1, np.int32)
    out_i = np.zeros(count, np.int64)
    q = np.full(n, -1, np.int64) if quota is None else np.asarray(quota, np.int64).copy()
    cursors = np.asarray(state.cursors, np.int64).copy()
    tok = np.asarray(state.tokens, np.float64).copy()
    total = np.array([state.total], np.float64)
    w = np.asarray(weights, np.float64)
    share = w / w.sum() if w.sum() > 0 else w
    # lengths given per entry: enough for its share of the draws, more on demand
    want = np.maximum(1, np.minimum(count, np.ceil(share * count * 1.25).astype(np.int64) + 16))
    if quota is not None:
        want = np.minimum(want, np.maximum(q, 1))
    pos = 0
    while pos < count:
        parts = [np.asarray(entry_lengths(e, int(cursors[e]), int(want[e])), np.float64) for e in range(n)]
        offsets = np.zeros(n + 1, np.int64)
        offsets[1:] = np.cumsum([len(p) for p in parts])
        used = np.zeros(n, np.int64)
        stop = min(count, pos + chunk * n)
        got = blend_kernel(w, q, np.concatenate(parts), offsets, used, tok, total, out_e, out_i, cursors, pos, stop,
                           float(unit))
        cursors += used
        if got < stop:
            if (q == 0).all() or not (w > 0).any():
                raise MixtureError(f"mixture: every entry's quota is used after {got} of {count} documents")
            ran_out = used >= offsets[1:] - offsets[:-1]
            want = np.where(ran_out, want * 2, want)
        pos = got
    return out_e, out_i, BlendState(cursors=cursors.tolist(), tokens=tok.tolist(), total=float(total[0]))
