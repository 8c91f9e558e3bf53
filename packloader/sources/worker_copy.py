"""Streams travel to DataLoader workers by pickling; their locks and caches cannot, and are rebuilt there."""

from __future__ import annotations


class RebuildsCachesWhenPickled:
    """Leaves `_caches` out of the pickle and calls `_init_caches` on arrival."""

    _caches: tuple[str, ...] = ()

    def _init_caches(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in self._caches:
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_caches()
