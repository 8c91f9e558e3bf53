"""DP-Merge process groups: the planner may give an outlier document to a group of DP ranks
(``MicroBatch.dp_group``, SlimPack's DP-Merge); those ranks run its attention as context parallelism over that group.

``torch.distributed.new_group`` is a collective of the whole world (every rank calls it, for every group, in the
same order), and creating a group is slow, so groups are created once, up front, and cached by their tuple of
ranks:

    groups = prepare_dp_merge_groups(world_size, plans=first_plans)   # every rank, same arguments
    ...
    out = dp_merge_attention(q, k, v, mb, dp_rank=my_dp_rank, groups=groups)  # members of mb.dp_group only

``prepare_dp_merge_groups`` creates every aligned contiguous power-of-two block of DP ranks (what a planner's
merge of 2, 4, 8 .. neighbours needs) plus every group named in the given plans, in one deterministic order.
Asking later for a group that was not created is an error that says so, rather than a hang: creating it then,
on the members only, would deadlock the ranks that never call.

DP ranks map to global ranks through ``rank_map`` (a sequence: ``rank_map[dp_rank]``); with tensor, pipeline or
context parallelism there is one map per (tp, pp, cp) coordinate, and ``rank_maps`` creates the groups of all of
them (every rank must create every coordinate's groups). Within a group, CP rank i is the i-th smallest global
rank, the same order ``new_group`` gives the group's ranks.

``ProcessGroupCache`` serves any fixed set of sub-groups the same way: ``examples/train_llama.py --cp N --dp M``
creates its M Zeppelin CP groups through it (``ZeppelinContext(..., group=groups.get(my_cp_ranks))``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch.distributed as dist

from packloader.contracts import MicroBatch, StepPlan

__all__ = [
    "ProcessGroupCache",
    "DEFAULT_GROUPS",
    "contiguous_pow2_groups",
    "groups_in_plans",
    "prepare_dp_merge_groups",
    "dp_merge_group",
    "dp_merge_shard",
    "dp_merge_attention",
    "prepare_cp_pool_groups",
    "cp_pool_group",
]


def _canonical(ranks: Iterable[int]) -> tuple[int, ...]:
    r = [int(x) for x in ranks]
    if len(set(r)) != len(r):
        raise ValueError(f"a process group lists a rank twice: {r}")
    if any(x < 0 for x in r):
        raise ValueError(f"negative rank in process group {r}")
    return tuple(sorted(r))


class ProcessGroupCache:
    """Process groups by their sorted tuple of global ranks, created once."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], Any] = {}
        self.created = 0  # new_group calls made (a test hook: groups are created once, not per step)

    def __contains__(self, ranks: Iterable[int]) -> bool:
        return _canonical(ranks) in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def keys(self) -> list[tuple[int, ...]]:
        return list(self._groups)

    def create(self, groups: Iterable[Iterable[int]], *, backend: str | None = None, timeout: Any = None) -> None:
        """Create the groups not created yet. A collective: every rank calls it with the same groups; they are
        created in sorted (size, ranks) order so the order does not depend on how the caller listed them."""
        world = dist.get_world_size()
        todo = sorted({_canonical(g) for g in groups} - set(self._groups), key=lambda g: (len(g), g))
        for g in todo:
            if g and g[-1] >= world:
                raise ValueError(f"process group {list(g)} names rank {g[-1]} but the world has {world} ranks")
            kwargs: dict[str, Any] = {}
            if backend is not None:
                kwargs["backend"] = backend
            if timeout is not None:
                kwargs["timeout"] = timeout
            pg = dist.new_group(list(g), **kwargs)
            self.created += 1
            self._groups[g] = pg if dist.get_rank() in g else None

    def get(self, ranks: Iterable[int]) -> Any:
        """The process group of `ranks` (this rank must be a member)."""
        g = _canonical(ranks)
        if g not in self._groups:
            raise KeyError(
                f"no process group was created for ranks {list(g)}; torch.distributed.new_group must be called by "
                "every rank in the same order, so create DP-Merge groups up front on all ranks: "
                "prepare_dp_merge_groups(world_size, plans=...) with the plans (or pow2=True for aligned blocks)")
        pg = self._groups[g]
        if pg is None:
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process group {list(g)}")
        return pg

    def clear(self) -> None:
        """Forget the groups (after destroy_process_group)."""
        self._groups.clear()


DEFAULT_GROUPS = ProcessGroupCache()


def contiguous_pow2_groups(world_size: int, *, min_size: int = 2, max_size: int | None = None,
                           aligned: bool = True) -> list[tuple[int, ...]]:
    """Contiguous blocks of 2, 4, 8 .. ranks: aligned (start a multiple of the size; world/size blocks per size)
    or, with aligned=False, every window (world-size+1 per size)."""
    out = []
    size = max(2, int(min_size))
    top = world_size if max_size is None else min(world_size, int(max_size))
    while size <= top:
        step = size if aligned else 1
        out.extend(tuple(range(s, s + size)) for s in range(0, world_size - size + 1, step))
        size *= 2
    return out


def _maps(rank_map: Sequence[int] | None, rank_maps: Sequence[Sequence[int]] | None) -> list[Sequence[int] | None]:
    if rank_maps is not None:
        return list(rank_maps)
    return [rank_map]


def _to_global(dp_ranks: Iterable[int], rank_map: Sequence[int] | None) -> tuple[int, ...]:
    dp_ranks = list(dp_ranks)
    if rank_map is None:
        return _canonical(dp_ranks)
    try:
        return _canonical(rank_map[r] for r in dp_ranks)
    except IndexError:
        raise ValueError(f"dp_group {dp_ranks} names a DP rank outside the rank map of {len(rank_map)} ranks") from None


def groups_in_plans(plans: Iterable[StepPlan], *, rank_map: Sequence[int] | None = None,
                    rank_maps: Sequence[Sequence[int]] | None = None) -> list[tuple[int, ...]]:
    """Every DP-Merge group (as sorted global ranks) named by a micro-batch of `plans`, sorted."""
    found = set()
    maps = _maps(rank_map, rank_maps)
    for plan in plans:
        for rp in plan.ranks:
            for mb in rp.micro_batches:
                if mb.dp_group and len(mb.dp_group) > 1:
                    for m in maps:
                        found.add(_to_global(mb.dp_group, m))
    return sorted(found, key=lambda g: (len(g), g))


def prepare_dp_merge_groups(
    world_size: int | None = None,
    plans: Iterable[StepPlan] = (),
    *,
    pow2: bool = True,
    extra: Iterable[Iterable[int]] = (),
    rank_map: Sequence[int] | None = None,
    rank_maps: Sequence[Sequence[int]] | None = None,
    groups: ProcessGroupCache | None = None,
    backend: str | None = None,
) -> ProcessGroupCache:
    """Create, on every rank (a collective), all the DP-Merge groups a plan family may need; returns the cache.

    `world_size`: the number of DP ranks (default: the world's size, pure data parallelism). `pow2`: the aligned
    contiguous power-of-two blocks of DP ranks. `plans`: every group their micro-batches name. `extra`: more groups
    of DP ranks. Each group of DP ranks is mapped to global ranks through every map of `rank_maps` (or `rank_map`;
    default: DP rank = global rank). Calling it again only creates what is missing (same rule: all ranks, same
    arguments).
    """
    cache = DEFAULT_GROUPS if groups is None else groups
    dp = dist.get_world_size() if world_size is None else int(world_size)
    maps = _maps(rank_map, rank_maps)
    wanted: list[tuple[int, ...]] = []
    dp_groups = list(contiguous_pow2_groups(dp)) if pow2 else []
    dp_groups += [tuple(g) for g in extra]
    for m in maps:
        wanted.extend(_to_global(g, m) for g in dp_groups)
    wanted.extend(groups_in_plans(plans, rank_maps=maps))
    cache.create(wanted, backend=backend)
    return cache


def dp_merge_group(mb: MicroBatch, *, dp_rank: int, rank_map: Sequence[int] | None = None,
                   groups: ProcessGroupCache | None = None) -> tuple[Any, int, int]:
    """(process group, CP rank within it, CP size) for this DP rank's part in DP-Merge micro-batch `mb`."""
    if not mb.dp_group:
        raise ValueError("micro-batch has no dp_group: it is not a DP-Merge micro-batch")
    if dp_rank not in mb.dp_group:
        raise ValueError(f"DP rank {dp_rank} is not in this micro-batch's dp_group {list(mb.dp_group)}")
    cache = DEFAULT_GROUPS if groups is None else groups
    members = _to_global(mb.dp_group, rank_map)
    me = rank_map[dp_rank] if rank_map is not None else dp_rank
    if len(members) == 1:
        return None, 0, 1
    return cache.get(members), members.index(me), len(members)


def dp_merge_shard(mb: MicroBatch, *, dp_rank: int, rank_map: Sequence[int] | None = None, **shard_kwargs: Any):
    """This DP rank's CPRankShard of DP-Merge micro-batch `mb` (mode: `mode=`, else adaptive;
    `cost_model=`: the estimate's model, default the llama3-8b preset)."""
    from packloader.collate.cp_sequence_shards import shard_micro_batch
    from packloader.runtime.cp_cost import cp_cost

    if not mb.dp_group or dp_rank not in mb.dp_group:
        raise ValueError(f"DP rank {dp_rank} is not in this micro-batch's dp_group {mb.dp_group}")
    members = _to_global(mb.dp_group, rank_map)
    me = rank_map[dp_rank] if rank_map is not None else dp_rank
    if "cost" not in shard_kwargs:
        shard_kwargs["cost"] = cp_cost(shard_kwargs.pop("cost_model", None))
    return shard_micro_batch(mb, len(members), **shard_kwargs).ranks[members.index(me)]


def dp_merge_attention(q, k, v, mb: MicroBatch, *, dp_rank: int, shard: Any = None,
                       rank_map: Sequence[int] | None = None, groups: ProcessGroupCache | None = None,
                       **attention_kwargs: Any):
    """cp_attention of this DP rank's shard of `mb` over the micro-batch's DP-Merge group (created beforehand by
    prepare_dp_merge_groups). `q/k/v` hold the rows of `shard` (default: dp_merge_shard(mb, dp_rank=...))."""
    from packloader.runtime.cp_attention import cp_attention

    pg, cp_rank, cp_size = dp_merge_group(mb, dp_rank=dp_rank, rank_map=rank_map, groups=groups)
    if shard is None:
        shard = dp_merge_shard(mb, dp_rank=dp_rank, rank_map=rank_map)
    if shard.rank != cp_rank or shard.cp_size != cp_size:
        raise ValueError(f"shard is CP rank {shard.rank} of {shard.cp_size}; this DP rank is {cp_rank} of {cp_size}")
    if cp_size == 1:
        return cp_attention(q, k, v, shard, None, **attention_kwargs)
    return cp_attention(q, k, v, shard, pg, **attention_kwargs)


def _pool_ranks(size: int, first: int, rank_map: Sequence[int] | None) -> tuple[int, ...]:
    return _to_global(range(int(first), int(first) + int(size)), rank_map)


def prepare_cp_pool_groups(pool: int, *, rank_map: Sequence[int] | None = None,
                           rank_maps: Sequence[Sequence[int]] | None = None, groups: ProcessGroupCache | None = None,
                           backend: str | None = None) -> ProcessGroupCache:
    """Per-document CP (StepPlan.cp_mode "dynamic"): create, on every rank (a collective), every aligned
    power-of-two group of the DP x CP pool of `pool` GPUs, sizes 2 .. pool, as megatron-core's hybrid context
    parallelism forms them; returns the cache `cp_pool_group` looks them up in. Pool GPU g (dp_rank * cp + cp_rank)
    is global rank `rank_map[g]` (default g); with tensor or pipeline parallelism there is one pool per (tp, pp)
    coordinate, and `rank_maps` creates the groups of all of them (every rank creates every pool's groups)."""
    cache = DEFAULT_GROUPS if groups is None else groups
    blocks = contiguous_pow2_groups(int(pool))
    cache.create([_pool_ranks(len(b), b[0], m) for m in _maps(rank_map, rank_maps) for b in blocks], backend=backend)
    return cache


def cp_pool_group(size: int, first: int, *, gpu: int, rank_map: Sequence[int] | None = None,
                  groups: ProcessGroupCache | None = None) -> Any:
    """The process group of pool GPUs first .. first + size - 1 (None at size 1), created by prepare_cp_pool_groups;
    checks that pool GPU `gpu` is its CP rank gpu - first."""
    if int(size) == 1:
        return None
    pg = (DEFAULT_GROUPS if groups is None else groups).get(_pool_ranks(size, first, rank_map))
    if dist.get_rank(pg) != int(gpu) - int(first):
        raise ValueError(f"pool GPU {gpu} is rank {dist.get_rank(pg)} of the process group of pool GPUs {first}.."
                         f"{int(first) + int(size) - 1}, not {int(gpu) - int(first)}: the rank map must increase "
                         "with the pool index")
    return pg
