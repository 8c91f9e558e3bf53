"""Ranks: who we are, and a small all-gather that names the ranks that fail to take part.

The loader exchanges two kinds of small messages between ranks:

- once, before the first step, the settings that decide the stream (PlanConfig, seed, shuffle, tokenizer, EOS,
  source, lengths mode): a rank configured differently gives a RuntimeError on every rank naming the field;
- a digest of each step's plan (and of the lengths it was computed from), to check that every rank planned the
  same step; a rank whose digest differs, or that does not answer within `timeout` seconds (dead, stalled, or
  configured differently), gives a RuntimeError on the others naming the step, the ranks and what happened;
- document lengths, when ranks share the tokenization of a chunk of text documents (`lengths="gather"`).

Both go through the key-value store of the default process group (the TCPStore that `init_process_group`
created), not through collectives: the loader plans in a background thread, and a store lets that thread wait
with a timeout, see exactly which ranks' keys are missing, and stop early when the loader is closed, without
ever issuing a collective on a group the trainer uses. Each message is one key per rank; a rank deletes its own
key of exchange n-1 once exchange n completed (by then every rank has read exchange n-1). The store is on rank
0's host: fine for the few bytes per step a digest takes and a few KB per chunk of lengths.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable

import numpy as np

# Loaders built in this process, so two loaders (train and eval) on the same store use different keys; every
# rank builds its loaders in the same order, so the numbers agree across ranks.
_instances = 0
_instances_lock = threading.Lock()


def next_instance() -> int:
    global _instances
    with _instances_lock:
        _instances += 1
        return _instances - 1


def torch_rank_world() -> tuple[int, int] | None:
    """(rank, world size) of the default process group when torch.distributed is initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def resolve_dp_rank(dp_rank: int | None, dp: int) -> int:
    """This rank's data-parallel index: explicit, or torch.distributed's rank when its world size equals dp."""
    if dp_rank is not None:
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} is outside the data-parallel group: parallel.dp={dp}")
        return int(dp_rank)
    rw = torch_rank_world()
    if rw is not None and rw[1] == dp:
        return rw[0]
    if dp == 1:
        return 0
    where = (f"torch.distributed has world size {rw[1]}" if rw is not None else "torch.distributed is not initialised")
    raise ValueError(
        f"dp_rank is needed: parallel.dp={dp} but {where}; pass dp_rank= (this rank's index among the {dp} "
        "data-parallel ranks, e.g. from your device mesh)"
    )


def digest(*parts: bytes | np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.tobytes() if isinstance(p, np.ndarray) else p)
    return h.digest()


class ExchangeTimeout(RuntimeError):
    pass


class RankExchange:
    """All-gather of small byte strings over a store, with a timeout that names the missing ranks."""

    def __init__(self, store, rank: int, world: int, prefix: str, timeout: float = 300.0,
                 poll: float = 0.05) -> None:
        self.store = store
        self.rank, self.world = int(rank), int(world)
        self.prefix = prefix.rstrip("/")
        self.timeout = float(timeout)
        self.poll = float(poll)
        self._own_last: str | None = None
        self.stop = threading.Event()

    @classmethod
    def from_torch(cls, name: str, timeout: float = 300.0) -> "RankExchange | None":
        """An exchange over the default process group's store, or None when torch.distributed is not initialised
        or has a single rank."""
        rw = torch_rank_world()
        if rw is None or rw[1] == 1:
            return None
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        return cls(store, rw[0], rw[1], f"packloader/{name}", timeout)

    def _key(self, tag: str, rank: int) -> str:
        return f"{self.prefix}/{tag}/{rank}"

    def all_gather(self, tag: str, payload: bytes, what: Callable[[], str] | str = "") -> list[bytes]:
        """Every rank's payload for `tag` (the same tag on every rank), in rank order."""
        own = self._key(tag, self.rank)
        try:
            self.store.set(own, payload)
        except Exception as e:  # noqa: BLE001 - the store's own errors are terse
            raise RuntimeError(f"packloader: {self._what(what)}: cannot reach the rank store ({e}); rank 0 may be gone") from e
        keys = [self._key(tag, r) for r in range(self.world)]
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while True:  # poll with check(): store.wait() logs a warning each time it times out
            try:
                if self.store.check(keys):
                    break
            except Exception as e:  # noqa: BLE001 - the store is gone
                raise RuntimeError(
                    f"packloader: {self._what(what)}: the rank store stopped answering ({e}); rank 0 may be gone"
                ) from e
            if self.stop.is_set():
                raise RuntimeError("packloader: the loader was closed while waiting for other ranks")
            if time.monotonic() > deadline:
                missing = self._missing(keys)
                if missing is None:
                    raise RuntimeError(f"packloader: {self._what(what)}: the rank store stopped answering; rank 0 may be gone")
                if not missing:
                    break
                raise ExchangeTimeout(
                    f"packloader: {self._what(what)}: ranks {missing} did not report within {self.timeout:g}s "
                    f"(rank {self.rank} of {self.world} waited); they may have died, stalled, or run a loader with "
                    "a different configuration or data"
                )
            time.sleep(pause)
            pause = min(self.poll, pause * 2)
        try:
            values = self.store.multi_get(keys) if hasattr(self.store, "multi_get") else [self.store.get(k) for k in keys]
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"packloader: {self._what(what)}: cannot read from the rank store ({e})") from e
        if self._own_last is not None:
            try:
                self.store.delete_key(self._own_last)
            except Exception:  # noqa: BLE001 - cleanup only
                pass
        self._own_last = own
        return [bytes(v) for v in values]

    def _missing(self, keys: list[str]) -> list[int] | None:
        try:
            return [r for r, k in enumerate(keys) if not self.store.check([k])]
        except Exception:  # noqa: BLE001
            return None

    @staticmethod
    def _what(what) -> str:
        return what() if callable(what) else (what or "exchange")

    def check_plan(self, step: int, lengths_digest: bytes, plan_digest: bytes) -> None:
        """Raise a RuntimeError naming the ranks, and whether the lengths or the plan differ, when not every rank
        drew the same documents and planned them alike for `step`."""
        got = self.all_gather(f"agree/{step}", lengths_digest + plan_digest,
                              f"step {step}: checking that all ranks computed the same plan")
        if all(g == got[0] for g in got):
            return
        n = len(lengths_digest)
        lengths_differ = any(g[:n] != got[0][:n] for g in got)
        groups: dict[bytes, list[int]] = {}
        for r, g in enumerate(got):
            groups.setdefault(g[:n] if lengths_differ else g[n:], []).append(r)
        desc = "; ".join(f"ranks {rs} have {g.hex()[:12]}" for g, rs in groups.items())
        if lengths_differ:
            what = ("the lengths of the documents drawn for the step differ; the loader settings were checked equal "
                    "at the start, so the ranks read different data under the same shard names and row counts")
        else:
            what = ("the same document lengths gave different plans: a planner object or cost profile that differs "
                    "between ranks, or a planner that is not deterministic")
        raise RuntimeError(f"packloader: step {step}: ranks disagree on the plan ({desc}): {what}")


def check_settings(exchange: RankExchange, settings: dict) -> None:
    """Before the first step: every rank's loader settings (PlanConfig, seed, shuffle, tokenizer, EOS, source,
    lengths mode, chunk size) equal, or a RuntimeError naming each field that differs and the ranks' values."""
    import msgspec

    from packloader.loader.state import flatten

    got = exchange.all_gather("settings", msgspec.msgpack.encode(settings),
                              "before the first step: checking that all ranks use the same loader settings")
    per_rank = [flatten(msgspec.msgpack.decode(g)) for g in got]
    diffs = []
    for key in sorted(set().union(*per_rank)):
        values = [p.get(key) for p in per_rank]
        if any(v != values[0] for v in values):
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(repr(v), []).append(r)
            diffs.append(f"{key}: " + ", ".join(f"ranks {rs} have {v}" for v, rs in groups.items()))
    if diffs:
        raise RuntimeError(
            "packloader: before the first step: ranks disagree on the loader settings (" + "; ".join(diffs)
            + "); every rank must read the same source with the same seed, tokenizer, options and PlanConfig"
        )
