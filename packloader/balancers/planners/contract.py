"""The planner contract, checked on every step's plan before it reaches a batch or a file.

A planner is code packloader may not own (`register_planner` in any module), and a plan that drops a piece,
lists one twice or overfills a micro-batch would be trained as it stands. So whoever asks a planner for a step
(the loader, `plan_run` behind `packloader plan`, the report) hands the answer to `check_step_plan`, which
checks it with the independent checker `sim.verify` against what the planner was given: every token of the
window and of the incoming queue exactly once (planned, or queued again), no micro-batch over the cap, slices in
order on one rank, every rank the same number of micro-batches, the step asked for. Its cost is measured against
planning time in `benchmarks/plan_check.py` (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np

from packloader.balancers.planners.registry import StepLayout, Window
from packloader.balancers.sim.verify import PlanError, _unique_micro_batches, coverage, owned_segments, verify_plan
from packloader.contracts import PlanConfig, PlannerState, StepPlan


class PlanContractError(PlanError):
    """A planner's plan breaks the planner contract; the message names the planner, the step and what broke."""

    def __init__(self, message: str, *, planner: str) -> None:
        super().__init__(message)
        self.planner = planner


def _given(window: Window, state_in: PlannerState) -> np.ndarray:
    """(N, 3) (doc, offset, length) of every piece the planner was given: the incoming queue, then the window."""
    q = np.asarray([(p.doc, p.offset, p.length) for p in state_in.queued], dtype=np.int64).reshape(-1, 3)
    w = np.stack([np.asarray(window.doc), np.asarray(window.offset), np.asarray(window.length)], axis=1)
    return np.concatenate([q, w.astype(np.int64).reshape(-1, 3)])


def _union(rows: np.ndarray) -> tuple[np.ndarray, bool]:
    """(doc, start, end) rows as their union of maximal intervals (touching ones joined), sorted, and whether the
    rows were disjoint and none empty (each token once)."""
    if not len(rows):
        return rows.reshape(0, 3), True
    r = rows[np.lexsort((rows[:, 1], rows[:, 0]))]
    same = r[1:, 0] == r[:-1, 0]
    once = bool((r[:, 2] > r[:, 1]).all() and not (same & (r[1:, 1] < r[:-1, 2])).any())
    new = np.ones(len(r), bool)
    new[1:] = ~same | (r[1:, 1] != r[:-1, 2])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(r)) - 1
    return np.stack([r[starts, 0], r[starts, 1], r[ends, 2]], axis=1), once


def _covered_once(plan: StepPlan, given: np.ndarray, state_out: PlannerState) -> bool:
    """Whether the plan's segments and the outgoing queue hold every token of `given` exactly once: vectorized, the
    fast path; a plan that fails it is checked again by `sim.verify.coverage` for the message."""
    rows = [(s.doc, s.start, s.end) for r, _, mb in _unique_micro_batches(plan) for s in owned_segments(mb, r)]
    rows += [(q.doc, q.offset, q.offset + q.length) for q in state_out.queued]
    got, once = _union(np.asarray(rows, dtype=np.int64).reshape(-1, 3))
    want, _ = _union(np.stack([given[:, 0], given[:, 1], given[:, 1] + given[:, 2]], axis=1))
    return once and got.shape == want.shape and bool((got == want).all())


def rank_caps(planner) -> list[int] | None:
    """The token cap of each DP rank of a planner given a cost model and cap per rank (`RankCosts`), else None."""
    caps = getattr(getattr(planner, "model", None), "caps", None)
    return [int(c) for c in caps] if caps is not None else None


def _check_rank_caps(plan: StepPlan, caps: list[int]) -> None:
    for r, rank in enumerate(plan.ranks):
        for i, mb in enumerate(rank.micro_batches):
            g = len(mb.dp_group) if mb.dp_group else 1
            if r < len(caps) and -(-mb.num_tokens // g) > caps[r]:
                raise PlanError(f"step {plan.step} rank {r} micro-batch {i} holds {mb.num_tokens} tokens, more than "
                                f"rank {r}'s cap of {caps[r]}")


def _check_pool_shares(plan: StepPlan, cap: int) -> None:
    """Per-document CP: a pool GPU runs 1/size of each segment placed on `size` GPUs. Its share must fit the DP
    rank's cap: a planner may load one GPU of the pool with short whole documents past max_tokens / cp (the memory
    check, not the contract, prices that)."""
    for r, rank in enumerate(plan.ranks):
        for i, mb in enumerate(rank.micro_batches):
            share = sum(-(-(s.end - s.start) // (p.size if p is not None else 1))
                        for s, p in zip(mb.segments, mb.cp or [None] * len(mb.segments)))
            if share > cap:
                raise PlanError(f"step {plan.step} pool GPU {r} micro-batch {i} runs {share} tokens (its share of "
                                f"each CP-sharded segment), more than max_tokens = {cap}")


def check_step_plan(plan: StepPlan, window: Window, state_in: PlannerState, state_out: PlannerState,
                    config: PlanConfig, layout: StepLayout | int, *, planner: str | None = None,
                    caps: list[int] | None = None) -> None:
    """Raise PlanContractError (a ValueError) naming the planner (`planner`, default config.strategy) when the
    plan it returned for `window` and `state_in` at `layout`, with `state_out` after it, breaks the contract.

    `caps`: the token cap of each DP rank for a planner given one per rank (`rank_caps`); default
    config.max_tokens for every rank; under per-document CP, for each pool GPU's share of its segments."""
    layout = StepLayout.of(layout)
    name = planner or config.strategy
    who = f"planner {name!r}" + (f" (its plan names {plan.planner!r})" if plan.planner and plan.planner != name else "")
    cap = max(caps) if caps else config.max_tokens
    ranks = config.parallel.dp * (config.parallel.cp if plan.cp_mode == "dynamic" else 1)
    try:
        if plan.step != layout.step:
            raise PlanError(f"the plan is numbered step {plan.step}, asked for step {layout.step}")
        given = _given(window, state_in)
        verify_plan(plan, given, cap, allow_slicing=config.allow_slicing, final_state=state_out, dp=ranks,
                    check_coverage=False)
        if plan.cp_mode == "dynamic":
            _check_pool_shares(plan, cap)
        if not _covered_once(plan, given, state_out):
            cov = coverage(plan, given, state_out)
            raise PlanError(f"token coverage broken: {'; '.join(cov.first_problems) or 'a token planned twice'}")
        if caps and plan.cp_mode != "dynamic":
            _check_rank_caps(plan, caps)
    except PlanError as e:
        raise PlanContractError(
            f"{who} broke the planner contract at step {layout.step}: {e}; expected every token of the drawn and "
            f"queued pieces exactly once (planned or queued again), at most {cap:,} tokens a micro-batch, slices "
            f"in order on one rank, and the same number of micro-batches on every rank. The plan is refused rather "
            f"than trained", planner=name) from None
