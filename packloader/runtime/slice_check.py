"""Whether a plan holds slices, and the clear refusal for consumers that cannot run them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from packloader.collate.batch import SlicesNotSupported  # defined with the batch, whose to_hf() refuses slices
from packloader.contracts import Segment, StepPlan


@dataclass(frozen=True)
class SliceRef:
    step: int | None
    rank: int | None
    micro_batch: int
    segment: Segment

    def describe(self) -> str:
        s = self.segment
        where = []
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        where.append(f"micro-batch {self.micro_batch}")
        return (f"{', '.join(where)}: document {s.doc} is sliced (tokens {s.start}..{s.end - 1} attend to its "
                f"tokens from {s.attend_from})")


def segments_of(mb: Any) -> list[Segment]:
    segs = getattr(mb, "segments", mb)
    return list(segs)


def find_slices(plan: StepPlan | Iterable[StepPlan] | Sequence[Any], *, step: int | None = None,
                rank: int | None = None) -> list[SliceRef]:
    """Every slice segment (attend_from < start) of a StepPlan, a list of StepPlans, or a sequence of
    micro-batches (MicroBatch, PackedBatch or anything with `.segments`; `step`/`rank` label those)."""
    if isinstance(plan, StepPlan):
        plans: list[Any] = [plan]
    else:
        plans = list(plan)
    out: list[SliceRef] = []
    if plans and all(isinstance(p, StepPlan) for p in plans):
        for sp in plans:
            for r, rp in enumerate(sp.ranks):
                for m, mb in enumerate(rp.micro_batches):
                    out += [SliceRef(sp.step, r, m, s) for s in mb.segments if s.attend_from < s.start]
        return out
    for m, mb in enumerate(plans):
        st = step if step is not None else getattr(mb, "step", None)
        idx = getattr(mb, "index_in_step", m)
        out += [SliceRef(st, rank, idx, s) for s in segments_of(mb) if s.attend_from < s.start]
    return out


def require_no_slices(plan: StepPlan | Iterable[StepPlan] | Sequence[Any], *, consumer: str = "this trainer",
                      step: int | None = None, rank: int | None = None) -> None:
    """Raise SlicesNotSupported naming the first slice's step, rank, micro-batch and document if `plan` has
    slices. For consumers that run each micro-batch on its own (a pipeline engine without a KV cache, CP
    attention, a plain training loop)."""
    found = find_slices(plan, step=step, rank=rank)
    if not found:
        return
    more = f" (and {len(found) - 1} more slice(s))" if len(found) > 1 else ""
    raise SlicesNotSupported(
        f"{consumer} cannot run sliced documents, but the plan has some: {found[0].describe()}{more}. Plan with "
        f"PlanConfig(allow_slicing=False), or run the micro-batches through packloader.runtime.slices.SliceExecutor"
    )


