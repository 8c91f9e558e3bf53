"""Resuming a `PackedDataset` under a torchdata `StatefulDataLoader` with another number of workers (and, at
once, another layout: dp, pp, cp, tp, micro-batch count, strategy, max_tokens, tokens_per_step).

StatefulDataLoader saves one iterator state per worker and refuses a state saved with another `num_workers`.
A worker of W plans its own contiguous part of each epoch (`split_range`), so the positions of a save are W
cursors, not one stream position, and W' workers would cut the epoch elsewhere. So the saved workers' parts go
on as they were cut until the pass ends (with `epochs=None` the pass never ends, and the cut stays): `dataloader_state_for` deals the W saved parts
out to the new workers (part v to worker v mod W'), each new worker plans its parts in turn, and the next pass
(a new `iter`) splits the epoch over the new workers. Every part resumes at a step boundary (a worker yields whole
steps), whose stream position does not depend on the layout, so every token is trained once; step numbers stay
unique (part v of W numbers its steps k * W + v), though no longer increasing. With more workers than parts,
the extra workers have nothing to do until the pass ends.

Refused, naming what: a StatefulDataLoader state that is not of a PackedDataset, one taken with
`snapshot_every_n_steps` > 1 between snapshots (its workers' states lag the steps it yielded), and states of
DP ranks that stand at different steps.
"""

from __future__ import annotations

from torchdata.stateful_dataloader.worker import _DATASET_ITER_STATE as _ITER
from torchdata.stateful_dataloader.worker import _DATASET_STATE as _DATASET
from torchdata.stateful_dataloader.worker import _FETCHER_ENDED as _ENDED
from torchdata.stateful_dataloader.worker import _FETCHER_STATE as _FETCHER
from torchdata.stateful_dataloader.worker import _WORKER_ID

from packloader.loader.elastic import _plain

PARTS_FORMAT = "packloader.dataset-parts/1"

# the multi-worker StatefulDataLoader's keys (class attributes in torchdata 0.11, not importable constants)
_SNAPSHOT, _STEPS_SINCE, _FINISHED = "_snapshot", "_steps_since_snapshot", "_iterator_finished"
_MAIN, _WORKERS, _NUM_WORKERS = "_main_snapshot", "_worker_snapshots", "_num_workers"


def parts_of(iterator_state: dict | None) -> list[dict]:
    """The worker parts one PackedDataset iterator state holds: itself (a plain worker state) or its parts."""
    if iterator_state is None:
        raise ValueError("a StatefulDataLoader worker holds no PackedDataset iterator state (the loader's dataset "
                         "is not a PackedDataset, or the state was saved before its workers started)")
    if iterator_state.get("format") == PARTS_FORMAT:
        return list(iterator_state["parts"])
    if "worker" not in iterator_state:
        raise ValueError("this PackedDataset worker state does not say which worker of how many saved it "
                         "(saved by an older packloader); resume it with the same num_workers")
    return [iterator_state]


def iterator_states(dl_state: dict) -> list[dict | None]:
    """The dataset iterator state of each worker of a `StatefulDataLoader.state_dict()` (one with 0 workers)."""
    if not isinstance(dl_state, dict):
        raise TypeError(f"expected a StatefulDataLoader.state_dict(), got {type(dl_state).__name__}")
    if _SNAPSHOT in dl_state:
        if dl_state.get(_STEPS_SINCE, 0):
            raise ValueError(
                f"this StatefulDataLoader state was taken {dl_state[_STEPS_SINCE]} steps after its workers' "
                "snapshot (snapshot_every_n_steps > 1): the workers' states lag the steps yielded, so it resumes "
                "only at its own num_workers; save with snapshot_every_n_steps=1 (the default)")
        workers = dl_state[_SNAPSHOT][_WORKERS]
        return [(workers[f"worker_{i}"].get(_FETCHER) or {}).get(_ITER) for i in range(len(workers))]
    if _FETCHER in dl_state:
        return [(dl_state[_FETCHER] or {}).get(_ITER)]
    raise ValueError("not a StatefulDataLoader state_dict(): it has neither '_snapshot' (workers) nor "
                     f"'{_FETCHER}' (num_workers=0)")


def _agree(ranks: list[list[dict]]) -> None:
    """Every DP rank's parts stand at the same stream positions (the states of one save)."""
    first = ranks[0]
    for r, parts in enumerate(ranks[1:], 1):
        if len(parts) != len(first):
            raise ValueError(f"DP rank {r}'s state holds {len(parts)} worker parts, rank 0's {len(first)}: these "
                             "are not the states of one save")
        for a, b in zip(first, parts):
            if (a["worker"], a["workers"]) != (b["worker"], b["workers"]) or \
                    _plain(a["loader"]["step_state"]) != _plain(b["loader"]["step_state"]):
                raise ValueError(f"DP rank {r}'s worker part {b['worker']} of {b['workers']} stands elsewhere in "
                                 "the stream than rank 0's: these are not the states of one save (every rank "
                                 "must have yielded the same steps)")


def dataloader_state_for(state: dict | list[dict], num_workers: int) -> dict:
    """A `StatefulDataLoader.state_dict()` of a PackedDataset (or one per DP rank of one save, at a step
    boundary), as a state that a StatefulDataLoader with `num_workers` workers (0: none) loads; the dataset may
    also be configured for another layout (`PlanConfig.parallel`, micro-batch count, ...)."""
    if int(num_workers) < 0:
        raise ValueError(f"num_workers={num_workers}: expected 0 or more")
    states = state if isinstance(state, list) else [state]
    if not states:
        raise ValueError("dataloader_state_for needs a StatefulDataLoader state, got an empty list")
    ranks = [[p for s in iterator_states(st) for p in parts_of(s)] for st in states]
    _agree(ranks)
    parts = sorted(ranks[0], key=lambda p: int(p["worker"]))
    new = max(int(num_workers), 1)
    per_worker = [{"format": PARTS_FORMAT, "parts": parts[j::new], "turn": 0} for j in range(new)]
    finished = bool(states[0].get(_FINISHED, False))
    seed, base_seed = _seeds(states[0])
    if int(num_workers) == 0:
        return {"_index_sampler_state": None, "_sampler_iter_state": None, "_sampler_iter_yielded": 0,
                "_num_yielded": 0, "_IterableDataset_len_called": None, "_shared_seed": seed,
                _FETCHER: {_ITER: per_worker[0], _ENDED: False}, _DATASET: None, _FINISHED: finished}
    main = {_NUM_WORKERS: new, "_sampler_iter_state": None, "_index_sampler_state": None,
            "_sampler_iter_yielded": 0, "_IterableDataset_len_called": None, "_shared_seed": seed, "_base_seed": base_seed}
    workers = {f"worker_{j}": {_WORKER_ID: j, _FETCHER: {_ITER: per_worker[j], _ENDED: False}, _DATASET: None}
               for j in range(new)}
    snapshot = {"_snapshot_step": 0, "_last_yielded_worker_id": new - 1, _MAIN: main, _WORKERS: workers}
    return {_SNAPSHOT: snapshot, _STEPS_SINCE: 0, _FINISHED: finished}


def _seeds(dl_state: dict) -> tuple:
    """The DataLoader's shared and base seeds, kept (PackedDataset draws nothing from them: its order comes
    from its own seed); a state of no workers has no base seed, 0 stands in."""
    if _SNAPSHOT in dl_state:
        main = dl_state[_SNAPSHOT][_MAIN]
        return main.get("_shared_seed"), main.get("_base_seed", 0)
    return dl_state.get("_shared_seed"), 0
