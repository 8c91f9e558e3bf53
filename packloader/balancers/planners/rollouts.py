"""`balance_rollouts`: sequences that live in memory (RL rollouts), or their lengths, over DP ranks and
micro-batches in one call, priced by the attention-aware cost model as every packloader plan is.

RL trainers hold the step's rollouts in memory and only need index lists back, so this skips the loader's sources,
windows and StepPlans: the DP ranks are balanced on the sequences' cost (verl's Karmarkar-Karp, then refined),
each rank is packed into the fewest micro-batches that hold at most `max_tokens_per_micro_batch` tokens each, with
the heaviest micro-batch made as light as the packers find (`rollout_pack`). The plan also carries the loss-token
and sequence counts the RL loss aggregation modes normalise by (docs/rl.md)."""

from __future__ import annotations

from typing import Any, Sequence

import msgspec
import numpy as np

from packloader.balancers.cost.coeffs import microbatch_times_by_id
from packloader.balancers.cost.lookup import cost_model_for
from packloader.balancers.cost.model import CostModel
from packloader.balancers.planners.rollout_pack import balanced_partitions, rank_micro_batches
from packloader.balancers.planners.verl import verl_order
from packloader.contracts import PlanConfig

LOSS_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class RolloutPlan(msgspec.Struct, kw_only=True, frozen=True):
    """Per DP rank, its micro-batches as lists of sequence indices (ascending within a micro-batch), with each
    micro-batch's tokens, predicted forward + backward seconds, loss tokens and sequences with a loss token; and
    the totals over every rank, which the loss of one optimizer step is normalised by."""

    micro_batches: list[list[list[int]]]
    tokens: list[list[int]]
    costs: list[list[float]]
    loss_tokens: list[list[int]]
    loss_sequences: list[list[int]]
    total_loss_tokens: int
    total_loss_sequences: int
    cost_model: str

    def denominator(self, mode: str) -> int:
        """What a micro-batch's summed loss is divided by so the step's loss is `mode`'s mean over every rank
        (DDP/FSDP then average gradients over ranks: multiply each rank's loss by the DP size, as verl's
        agg_loss does). token-sum: 1."""
        if mode == "token-mean":
            return max(self.total_loss_tokens, 1)
        if mode == "token-sum":
            return 1
        if mode in LOSS_MODES:
            return max(self.total_loss_sequences, 1)
        raise ValueError(f"RolloutPlan.denominator: unknown loss mode {mode!r}; expected one of {', '.join(LOSS_MODES)}")


def rollout_lengths(sequences: Any, what: str = "balance_rollouts") -> np.ndarray:
    """Token counts from lengths (ints, a 1-D integer array or tensor) or from sequences (anything with a len()),
    as int64; a bad entry is an error naming its index and what was expected."""
    if hasattr(sequences, "ndim") and hasattr(sequences, "tolist") and sequences.ndim == 1:
        sequences = sequences.tolist()  # a 1-D numpy array or torch tensor of lengths
    out = np.empty(len(sequences), np.int64)
    for i, s in enumerate(sequences):
        if isinstance(s, (bool, np.bool_)):
            raise TypeError(f"{what}: entry {i} is a bool ({s!r}); expected a length (int >= 0) or a sequence of tokens")
        if isinstance(s, (int, np.integer)):
            v = int(s)
        elif hasattr(s, "__len__"):
            v = len(s)
        else:
            raise TypeError(f"{what}: entry {i} is a {type(s).__name__} ({s!r}); expected a length (int >= 0) or a "
                            "sequence of tokens")
        if v < 0:
            raise ValueError(f"{what}: entry {i} has length {v}; expected a length >= 0")
        out[i] = v
    return out


def resolve_cost(cost: CostModel | PlanConfig | str | None, device: str = "h100") -> CostModel:
    """The cost model: a CostModel as given, a PlanConfig's, or a preset name / profile path (None: PlanConfig's
    default model) on `device`."""
    if isinstance(cost, CostModel):
        return cost
    if isinstance(cost, PlanConfig):
        return cost_model_for(cost)
    return cost_model_for(PlanConfig(device=device) if cost is None else PlanConfig(model=cost, device=device))


def _check(lengths: np.ndarray, cap: int, dp: int, equal_sizes: bool, loss: np.ndarray | None) -> None:
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
        raise ValueError(f"balance_rollouts: max_tokens_per_micro_batch={cap!r}; expected an int >= 1")
    if isinstance(dp, bool) or not isinstance(dp, (int, np.integer)) or dp < 1:
        raise ValueError(f"balance_rollouts: dp={dp!r}; expected an int >= 1")
    over = np.flatnonzero(lengths > cap)
    if len(over):
        i = int(over[0])
        raise ValueError(f"balance_rollouts: sequence {i} has {int(lengths[i])} tokens, over max_tokens_per_micro_batch="
                         f"{cap} ({len(over)} of {len(lengths)} sequences are over it); expected every sequence to fit one micro-batch: raise the "
                         "cap or cut the rollouts")
    if equal_sizes and len(lengths) % dp:
        raise ValueError(f"balance_rollouts: equal_sizes with {len(lengths)} sequences over dp={dp}; expected a number "
                         "of sequences divisible by dp")
    if loss is not None:
        if len(loss) != len(lengths):
            raise ValueError(f"balance_rollouts: loss_tokens has {len(loss)} entries for {len(lengths)} sequences")
        bad = np.flatnonzero(loss > lengths)
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"balance_rollouts: loss_tokens[{i}]={int(loss[i])} exceeds sequence {i}'s "
                             f"{int(lengths[i])} tokens; expected 0 <= loss tokens <= length")


def balance_rollouts(sequences: Sequence[Any] | np.ndarray, max_tokens_per_micro_batch: int, dp: int = 1, *,
                     equal_counts: bool = True, equal_sizes: bool = False, min_micro_batches: int = 1,
                     multiple_of: int = 1, loss_tokens: Sequence[int] | np.ndarray | None = None,
                     cost: CostModel | PlanConfig | str | None = None, device: str = "h100",
                     light_ends: bool = True) -> RolloutPlan:
    """Balance in-memory sequences (or their lengths) over `dp` ranks and micro-batches of at most
    `max_tokens_per_micro_batch` tokens, by the cost model `cost` (see `resolve_cost`).

    equal_counts: every rank the same number of micro-batches (ranks step their collectives together); a rank with
    fewer sequences than that count gets empty micro-batches. equal_sizes: every rank the same number of sequences
    (verl's DataProto dispatch chunks equally). min_micro_batches / multiple_of: at least that many micro-batches
    per rank, a multiple of `multiple_of` (virtual pipeline stages). loss_tokens: each sequence's tokens that train
    (RL: its response tokens; default all of them), for the loss counts. light_ends: each rank's micro-batches in
    verl's order, the lightest at both ends of the pipeline's warm-up and cool-down; else heaviest first."""
    lengths = rollout_lengths(sequences)
    loss = None if loss_tokens is None else rollout_lengths(loss_tokens, "balance_rollouts loss_tokens")
    _check(lengths, max_tokens_per_micro_batch, dp, equal_sizes, loss)
    if min_micro_batches < 1 or multiple_of < 1:
        raise ValueError(f"balance_rollouts: min_micro_batches={min_micro_batches}, multiple_of={multiple_of}; "
                         "expected both >= 1")
    loss = lengths if loss is None else loss
    model = resolve_cost(cost, device)
    work = model.doc_time(lengths)
    rank_of = balanced_partitions(work, dp, equal_sizes) if len(lengths) else np.zeros(0, np.int64)
    ranks = rank_micro_batches(lengths, work, rank_of, dp, int(max_tokens_per_micro_batch), min_micro_batches,
                               multiple_of, equal_counts, model.coeffs)
    ranks = [[mbs[j] for j in _order(mbs, lengths, model, light_ends)] for mbs in ranks]
    return _plan(ranks, lengths, loss, model)


def _order(mbs: list[np.ndarray], lengths: np.ndarray, model: CostModel, light_ends: bool) -> list[int]:
    """A rank's micro-batches by their predicted time: verl's order (light ones at both ends), or heaviest first."""
    f, b = _times(mbs, lengths, model)
    if not light_ends:
        return list(np.argsort(-(f + b), kind="stable"))
    singles = [np.array([j]) for j in range(len(mbs))]  # verl_order sums integer keys: the times in nanoseconds
    return verl_order(singles, np.rint((f + b) * 1e9).astype(np.int64)) if mbs else []


def _times(mbs: list[np.ndarray], lengths: np.ndarray, model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of each micro-batch (index arrays into `lengths`)."""
    mb_of = np.repeat(np.arange(len(mbs)), [len(mb) for mb in mbs]).astype(np.int64)
    q = lengths[np.concatenate(mbs).astype(np.int64)] if mbs else np.zeros(0, np.int64)
    return microbatch_times_by_id(model.coeffs, q, np.zeros_like(q), mb_of, len(mbs))


def _plan(ranks: list[list[np.ndarray]], lengths: np.ndarray, loss: np.ndarray, model: CostModel) -> RolloutPlan:
    flat = [mb for mbs in ranks for mb in mbs]
    mb_of = np.repeat(np.arange(len(flat)), [len(mb) for mb in flat]).astype(np.int64)
    items = np.concatenate(flat).astype(np.int64) if flat else np.zeros(0, np.int64)
    q = lengths[items]
    f, b = _times(flat, lengths, model)
    tok = np.bincount(mb_of, weights=q, minlength=len(flat)).astype(np.int64)
    lt = np.bincount(mb_of, weights=loss[items], minlength=len(flat)).astype(np.int64)
    ls = np.bincount(mb_of, weights=(loss[items] > 0), minlength=len(flat)).astype(np.int64)
    bounds = np.cumsum([0] + [len(mbs) for mbs in ranks])

    def per_rank(values: np.ndarray) -> list[list]:
        return [values[bounds[r]:bounds[r + 1]].tolist() for r in range(len(ranks))]

    return RolloutPlan(
        micro_batches=[[np.sort(mb).tolist() for mb in mbs] for mbs in ranks],
        tokens=per_rank(tok), costs=per_rank(f + b), loss_tokens=per_rank(lt), loss_sequences=per_rank(ls),
        total_loss_tokens=int(loss.sum()), total_loss_sequences=int((loss > 0).sum()), cost_model=model.name,
    )
