"""The `StepMetrics` record of a planned step: the plan's scores (`balancers.sim.metrics.score_plan`) with the
loader's own counts (loss tokens, padding, the queue), so a trainer logs what the loader knows in one record."""

from __future__ import annotations

from typing import Mapping

import msgspec
import numpy as np

from packloader.balancers.cost.coeffs import microbatch_times_csr
from packloader.balancers.sim.metrics import score_plan
from packloader.contracts import PlanConfig, PlannerState, StepMetrics, StepPlan


def padding_of(plan: StepPlan, pad_to_multiple: int | None, pad_to_tokens: int | None) -> int:
    """Padding tokens the collated micro-batches of every rank carry (collate's padded variant: each segment up to
    a multiple of `pad_to_multiple`, the micro-batch up to `pad_to_tokens`); 0 without padding."""
    if pad_to_multiple is None and pad_to_tokens is None:
        return 0
    m = pad_to_multiple or 1
    total = 0
    for rank in plan.ranks:
        for mb in rank.micro_batches:
            real = mb.num_tokens
            padded = sum(-(-(s.end - s.start) // m) * m for s in mb.segments)
            if pad_to_tokens:
                padded = max(padded, pad_to_tokens)
            total += padded - real
    return total


def draw_steps(state_in: PlannerState, first_drawn: Mapping[int, int]) -> dict[int, int]:
    """doc -> the step it was first drawn in, for the documents of a step drawn before it: queued pieces (their
    draw step) and documents drawn over several steps (`StepState.first_drawn`: a continued document's pieces count
    from its first step, as `balancers.sim.metrics.drawn_steps` counts them for `packloader plan`)."""
    table = {q.doc: q.drawn_step for q in state_in.queued}
    for d, s in first_drawn.items():
        table[d] = min(table.get(d, s), s)
    return table


def step_metrics(plan: StepPlan, model, config: PlanConfig, *, epoch: int, state_in: PlannerState,
                 state_out: PlannerState, padding: int = 0, drawn: Mapping[int, int] | None = None) -> StepMetrics:
    """The step's record. `state_in`: the planner state the step was planned from (its queue says when each held
    piece was drawn); `state_out`: the state after it (what is queued now); `drawn` (`draw_steps`), where given,
    replaces the queue's draw steps (a document missing from it counts as drawn in this step)."""
    # scored with micro-batch costs in the plan: most planners price them as they plan; the others' are priced here
    # in one numba call, cheaper than score_plan pricing each micro-batch in Python (docs/benchmarks.md, "First
    # run")
    priced = all(mb.fwd_cost > 0 or not mb.segments for r in plan.ranks for mb in r.micro_batches)
    scored = plan if priced else _priced(plan, model)
    s = score_plan(scored or plan, model, config.parallel, max_tokens=config.max_tokens, schedule=config.schedule,
                   drawn=state_in if drawn is None else drawn, use_plan_costs=scored is not None)
    return StepMetrics(
        step=plan.step, epoch=epoch, planner=plan.planner or config.strategy, micro_batches=s.micro_batches,
        step_time=s.step_time, bound_time=s.bound_time, imbalance=s.imbalance, dp_spread=s.dp_spread,
        bubble_share=s.bubble_share, tokens=s.tokens, loss_tokens=plan.loss_tokens, padding_tokens=padding,
        queued_tokens=sum(q.length for q in state_out.queued), delayed_tokens=s.tokens_delayed,
        delay_mean=s.delay_mean, delay_max=s.delay_max, memory_over=plan.memory_over,
        cost_model=getattr(model, "name", ""),
    )


def _priced(plan: StepPlan, model) -> StepPlan | None:
    """A copy of the plan with every micro-batch's cost from `model` (CostModel.microbatch_times, batched); None
    where that needs more than one model's coefficients (per-rank models, DP-Merge shares)."""
    mbs = [mb for r in plan.ranks for mb in r.micro_batches]
    if not hasattr(model, "coeffs") or any(mb.dp_group for mb in mbs):
        return None
    segs = [s for mb in mbs for s in mb.segments]
    q = np.fromiter((s.end - s.start for s in segs), np.int64, len(segs))
    p = np.fromiter((s.start - s.attend_from for s in segs), np.int64, len(segs))
    offsets = np.zeros(len(mbs) + 1, np.int64)
    np.cumsum([len(mb.segments) for mb in mbs], out=offsets[1:])
    f, b = microbatch_times_csr(model.coeffs, q, p, offsets)
    it = iter(zip(f.tolist(), b.tolist()))
    ranks = []
    for r in plan.ranks:
        out = [msgspec.structs.replace(mb, fwd_cost=fc, bwd_cost=bc) for mb, (fc, bc) in zip(r.micro_batches, it)]
        ranks.append(msgspec.structs.replace(r, micro_batches=out))
    return msgspec.structs.replace(plan, ranks=ranks)


def format_step_metrics(m: StepMetrics) -> str:
    """One log line of a step's record."""
    text = (f"step {m.step} (epoch {m.epoch}, {m.planner}, {m.micro_batches} micro-batches per DP rank): predicted "
            f"{m.step_time:.4g} s (perfect balance {m.bound_time:.4g} s), imbalance {m.imbalance:.3f}, DP spread "
            f"{m.dp_spread:.3f}, bubbles {m.bubble_share:.1%}; {m.tokens:,} tokens, {m.loss_tokens:,} with loss, "
            f"{m.padding_tokens:,} padding; {m.queued_tokens:,} queued, {m.delayed_tokens:,} delayed (mean "
            f"{m.delay_mean:.3f}, max {m.delay_max} steps)")
    if m.memory_over > 0:
        text += f"; simulated peak memory {m.memory_over:.2f}x the device's usable memory"
    if m.entry_tokens:  # a mixture: each entry's tokens this step
        text += "; entries " + ", ".join(f"{n} {t:,}" for n, t in m.entry_tokens.items())
    return text
