"""Drop-in equivalents of verl's sequence balancing (`verl/utils/seqlen_balancing.py`): the same arguments and
results, so a verl user switches with one import:

    from packloader_integrations.verl import get_seqlen_balanced_partitions, rearrange_micro_batches

* `get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size)`: verl's Karmarkar-Karp answer (the same
  kernel, in numba), then moves and swaps that only ever lower the largest partition sum; `equal_size` keeps n / k
  items in every partition.
* `rearrange_micro_batches(batch, max_token_len, ...)`: the micro-batches of one DP rank's TensorDict. verl chooses
  their number from the token budget and their contents by workload, so a micro-batch may hold more than
  `max_token_len` tokens; here none does: the count is verl's, or the fewest above it that fit, agreed over
  `dp_group` (all-reduce MAX) as verl does. The contents balance packloader's cost model (`cost=`, keyword only:
  a preset name, profile path, CostModel or PlanConfig), and where verl's own answer fits the cap the result is
  never worse than it on verl's `calculate_workload` either.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.ldm_kernels import karmarkar_karp
from packloader.balancers.planners.rollout_pack import (
    as_int_values,
    balanced_partitions,
    fit_micro_batches,
    pack_micro_batches,
    partition_sums,
    refine,
)
from packloader.balancers.planners.rollouts import resolve_cost
from packloader.balancers.planners.verl import VERL_WORKLOAD_LINEAR, verl_order
from packloader.contracts import PlanConfig

__all__ = ["calculate_workload", "get_seqlen_balanced_partitions", "plan_micro_batches", "rearrange_micro_batches"]


def calculate_workload(seqlen_list: Any) -> Any:
    """verl's estimate of a sequence's work (a 7B model's FLOPs over 2h): 24576 l + l^2, for a tensor or array."""
    return VERL_WORKLOAD_LINEAR * seqlen_list + seqlen_list**2


def _int_list(values: Any, what: str) -> np.ndarray:
    """int64 values >= 0 from a list, array or tensor; a bad entry is an error naming its index."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    arr = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if arr.ndim == 1 and arr.dtype.kind in "iu" and (len(arr) == 0 or arr.min() >= 0):
        return arr.astype(np.int64)
    out = np.empty(len(values), np.int64)
    for i, v in enumerate(values):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{what}: entry {i} is {v!r}; expected an int >= 0")
        out[i] = int(v)
    return out


def _fill_empty(part: np.ndarray, k: int, values: np.ndarray) -> np.ndarray:
    """Give every empty partition the lightest item of the partition with the most items (only zero values can
    leave one empty): the largest sum never grows, and verl's callers index every partition."""
    part = part.copy()
    for p in np.flatnonzero(np.bincount(part, minlength=k) == 0):
        donor = int(np.argmax(np.bincount(part, minlength=k)))
        ix = np.flatnonzero(part == donor)
        part[ix[np.argmin(values[ix])]] = p
    return part


def get_seqlen_balanced_partitions(seqlen_list: Any, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """k_partitions lists of indices into seqlen_list (each ascending, none empty; equal_size: len / k each), by
    decreasing sum, balancing the sums of the values (verl passes lengths or `calculate_workload` values)."""
    values = _int_list(seqlen_list, "get_seqlen_balanced_partitions")
    n, k = len(values), int(k_partitions)
    if k < 1 or n < k:
        raise ValueError(f"get_seqlen_balanced_partitions: {n} items into k_partitions={k}; expected 1 <= k <= items")
    if equal_size and n % k:
        raise ValueError(f"get_seqlen_balanced_partitions: equal_size with {n} items into {k} partitions; expected the "
                         "number of items divisible by k_partitions")
    part = _fill_empty(balanced_partitions(values, k, bool(equal_size)), k, values)
    sums = partition_sums(part, values, k)
    return [np.flatnonzero(part == p).tolist() for p in np.argsort(-sums, kind="stable")]


def _effective_lengths(batch: Any) -> np.ndarray:
    """Each row's tokens: a nested input_ids' row lengths, else the attention mask's row sums (as verl reads them)."""
    ids = batch["input_ids"]
    if ids.is_nested:
        return ids.offsets().diff().cpu().numpy().astype(np.int64)
    return batch["attention_mask"].sum(dim=1).cpu().numpy().astype(np.int64)


def _select_all(batch: Any, index: list[list[int]]) -> list[Any]:
    """The rows of each index list from every field: plain tensors indexed, jagged (nested) tensors rebuilt from
    their rows (unbound once for all micro-batches), per-row non-tensor stacks indexed, scalar metadata kept. A
    TensorDict in, TensorDicts out (a dict in, dicts out)."""
    rows = {key: value.unbind() for key, value in batch.items() if isinstance(value, torch.Tensor) and value.is_nested}
    out = []
    for idx in index:
        ix = torch.as_tensor(idx, dtype=torch.long)
        mb = {}
        for key, value in batch.items():
            if key in rows:
                picked = [rows[key][i] for i in idx]
                mb[key] = torch.nested.as_nested_tensor(picked, layout=torch.jagged) if picked else value[:0]
            elif isinstance(value, torch.Tensor):
                mb[key] = value[ix]
            else:
                mb[key] = value[ix] if getattr(value, "shape", ()) else value
        out.append(mb)
    if isinstance(batch, dict):
        return out
    from tensordict import TensorDict

    return [TensorDict(mb, batch_size=[len(idx)]) for mb, idx in zip(out, index)]


def _all_reduce_max(value: int, group: Any) -> int:
    device = "cpu"
    if "nccl" in str(dist.get_backend(group)).lower():
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _verl_start(tokens: np.ndarray, guard: np.ndarray, work: np.ndarray, m: int, cap: int) -> np.ndarray | None:
    """verl's own partition (LDM on calculate_workload) when it fits the cap, refined on packloader's cost without
    letting any micro-batch's verl workload pass verl's largest: no worse than verl on either measure."""
    vk = karmarkar_karp(guard, m, False)
    if (np.bincount(vk, weights=tokens, minlength=m) > cap).any():
        return None
    bound = float(partition_sums(vk, guard, m).max())
    return refine(vk, m, work, tokens=tokens, cap=cap, guard=guard, guard_cap=bound)


def rearrange_micro_batches(batch: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: int | None = None,
                            same_micro_num_in_dp: bool = True, min_num_micro_batch: int | None = None,
                            use_dynamic_bsz_balance: bool = True, force_group_size: int = 1, *,
                            cost: CostModel | PlanConfig | str | None = None) -> tuple[list[Any], list[list[int]]]:
    """One rank's batch as (micro-batches, each micro-batch's row indices), as verl's function returns them; every
    micro-batch within `max_token_len` tokens (`plan_micro_batches` says how they are chosen)."""
    index = plan_micro_batches(_effective_lengths(batch), max_token_len, dp_group, num_batches_divided_by,
                               same_micro_num_in_dp, min_num_micro_batch, use_dynamic_bsz_balance, force_group_size,
                               cost=cost)
    return _select_all(batch, index), index


def plan_micro_batches(lengths: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: int | None = None,
                       same_micro_num_in_dp: bool = True, min_num_micro_batch: int | None = None,
                       use_dynamic_bsz_balance: bool = True, force_group_size: int = 1, *,
                       cost: CostModel | PlanConfig | str | None = None) -> list[list[int]]:
    """The row indices of each micro-batch of one rank's sequences (`lengths`: their token counts), the planning
    half of `rearrange_micro_batches`. The count is verl's (min(groups, ceil(tokens / max_token_len)), at least
    min_num_micro_batch), or the fewest above it that fit the cap; all-reduced to the DP group's largest with
    `same_micro_num_in_dp` and a `dp_group`, then rounded up to a multiple of num_batches_divided_by. Rows of a
    force_group_size group stay together. With use_dynamic_bsz_balance the micro-batches come in verl's order (by
    cost, the lightest at both ends), else heaviest first."""
    lengths = _int_list(lengths, "rearrange_micro_batches")
    n, g, cap = len(lengths), int(force_group_size), int(max_token_len)
    if n == 0:
        raise ValueError("rearrange_micro_batches: an empty batch; expected at least one row")
    if g < 1 or n % g:
        raise ValueError(f"rearrange_micro_batches: batch of {n} rows with force_group_size={g}; expected a batch "
                         "size divisible by force_group_size")
    over = np.flatnonzero(lengths > cap)
    if len(over):
        raise ValueError(f"rearrange_micro_batches: row {int(over[0])} holds {int(lengths[over[0]])} tokens, over "
                         f"max_token_len={cap}; expected every sequence to fit one micro-batch")
    model = resolve_cost(cost)
    groups = n // g
    tokens = lengths.reshape(groups, g).sum(1)
    work = model.doc_time(lengths).reshape(groups, g).sum(1)
    guard = calculate_workload(lengths).reshape(groups, g).sum(1)
    if g > 1 and (tokens > cap).any():
        i = int(np.flatnonzero(tokens > cap)[0])
        raise ValueError(f"rearrange_micro_batches: rows {i * g}..{i * g + g - 1} (one group) hold {int(tokens[i])} "
                         f"tokens, over max_token_len={cap}; expected each group to fit one micro-batch")
    m0 = min(groups, -(-int(tokens.sum()) // cap))
    if min_num_micro_batch is not None:
        m0 = max(m0, int(min_num_micro_batch))
    coeffs = model.coeffs if g == 1 else None
    theirs = first = _verl_start(tokens, guard, work, m0, cap)
    if theirs is not None:  # verl's own answer fits at its count: so does the count (packed from it, at least)
        m, part = m0, pack_micro_batches(tokens, work, cap, m0, coeffs, known=theirs)
    else:
        m, part = fit_micro_batches(tokens, work, cap, m0, coeffs)
    fitted = m
    if dist.is_initialized() and same_micro_num_in_dp and dp_group is not None:
        m = _all_reduce_max(m, dp_group)
    if num_batches_divided_by is not None:
        m = -(-m // num_batches_divided_by) * num_batches_divided_by
    if m > groups:
        raise ValueError(f"rearrange_micro_batches: {m} micro-batches (the DP group's count, rounded to "
                         f"num_batches_divided_by) for {groups} sequences (groups) on this rank; expected at most one "
                         "micro-batch per sequence: raise max_token_len or balance the ranks' batches")
    if m != fitted:
        part = pack_micro_batches(tokens, work, cap, m, coeffs, known=part)
    theirs = first if m == m0 else _verl_start(tokens, guard, work, m, cap)
    if theirs is not None:
        ours_cost, theirs_cost = partition_sums(part, work, m).max(), partition_sums(theirs, work, m).max()
        ours_verl, theirs_verl = partition_sums(part, guard, m).max(), partition_sums(theirs, guard, m).max()
        if not (ours_cost <= theirs_cost and ours_verl <= theirs_verl):
            part = theirs
    part = _fill_empty(part, m, work)
    parts = [np.flatnonzero(part == j) for j in range(m)]
    if use_dynamic_bsz_balance:
        order = verl_order(parts, as_int_values(work))
    else:
        order = list(np.argsort(-np.array([work[p].sum() for p in parts]), kind="stable"))
    return [(parts[j][:, None] * g + np.arange(g)).ravel().tolist() for j in order]
