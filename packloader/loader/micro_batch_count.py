"""`PlanConfig.num_micro_batches` is a promise to the trainer (its gradient accumulation steps): every rank gets
exactly that many micro-batches in every step, or the loader stops with the reason. Planners add micro-batches
when a step's pieces do not fit the pinned count; the trainer would then step its optimizer out of line with
packloader's steps, so the loader refuses such a plan and says what holds the tokens and what to change."""

from __future__ import annotations

from packloader.contracts import PlanConfig, StepPlan


def micro_batches_needed(config: PlanConfig) -> int:
    """The fewest micro-batches per DP rank that hold any step: a step's window holds up to tokens_per_step +
    context - 1 tokens (the piece that crosses the mark belongs to it), over dp ranks of max_tokens each."""
    most = config.tokens_per_step + config.context - 1
    return -(-most // (config.parallel.dp * config.max_tokens))


def check_micro_batch_count(plan: StepPlan, config: PlanConfig, drawn_tokens: int, queued_tokens: int,
                            remainder: bool = False) -> None:
    """Raise a ValueError when a rank of `plan` has other than `config.num_micro_batches` micro-batches.

    `drawn_tokens`: tokens of the step's window; `queued_tokens`: tokens of pieces queued from earlier steps;
    `remainder`: the window is an interrupted step's untrained rest, planned for a new layout (elastic resume)."""
    want = config.num_micro_batches
    if want is None:
        return
    counts = [len(r.micro_batches) for r in plan.ranks]
    bad = [(r, c) for r, c in enumerate(counts) if c != want]
    if not bad:
        return
    r, got = bad[0]
    dp, cap = config.parallel.dp, config.max_tokens
    capacity = want * dp * cap
    most = config.tokens_per_step + config.context - 1  # a step's window holds at most this many tokens
    need = micro_batches_needed(config)
    held = f"step {plan.step} holds {drawn_tokens:,} drawn tokens"
    if remainder:
        held = (f"the rest of step {plan.step}, interrupted at another layout and planned again for this one, holds "
                f"{drawn_tokens:,} tokens")
    if queued_tokens:
        held += f" and {queued_tokens:,} tokens queued by earlier steps"
    if drawn_tokens + queued_tokens > capacity:
        why = (f"{held}, more than num_micro_batches={want} x dp={dp} x max_tokens={cap:,} = {capacity:,} can hold. "
               f"A step draws tokens_per_step={config.tokens_per_step:,} within one piece (up to "
               f"{most:,} tokens with context={config.context:,}): set num_micro_batches >= "
               f"{max(need, -(-(drawn_tokens + queued_tokens) // (dp * cap)))}, or raise max_tokens, or lower "
               "tokens_per_step or context")
    else:
        why = (f"{held}, which fit num_micro_batches={want} x dp={dp} x max_tokens={cap:,} = {capacity:,} in "
               f"tokens, but planner {config.strategy!r} could not pack its pieces into {want} micro-batches of "
               f"{cap:,} tokens: leave room for packing (num_micro_batches >= {max(need + 1, got, want + 1)}, or "
               "a larger max_tokens)")
    raise ValueError(f"packloader: PlanConfig.num_micro_batches={want} cannot be honoured: the plan gives DP rank "
                     f"{r} {got} micro-batches; {why}")
