"""Elastic resume: a state saved at one layout (dp, pp, cp, tp, micro-batch count, planner, cp_mode, max_tokens,
tokens_per_step) resumes at another.

Every rank of a run plans the same steps from the same stream, so a rank's state is the global stream position
(identical on every rank: the draw cursor, the planner's queue) plus how many of the current step's micro-batches
this rank has yielded (`skip`). At a step boundary (skip 0) any one rank's state says everything. Mid-step, the
new layout needs every old rank's skip: `merge_states` gathers the states of one save into one, which every rank
of the new layout loads. Loading it plans the interrupted step again with the saving layout's config (the same
plan the old ranks ran), takes what no old rank trained (its remainder), and plans that remainder for the new
layout as the same step number with the step's loss normaliser; the steps after it are drawn, planned and
balanced for the new layout. A SlimPack slice chain cut by the interruption resumes its untrained slices as a
piece of their own (they cannot attend to keys computed before the interruption).

Only what cannot be honoured is refused, naming it: another source, seed, shuffle, tokenizer, EOS setting or
context (the draw would differ), a mid-step state without the other ranks' states, or states of different saves.
"""

from __future__ import annotations

import msgspec

from packloader.contracts import PlanConfig, StepPlan
from packloader.loader.state import check_fingerprint, check_state_shape, flatten, upgraded

# fingerprint fields a resume may change: the layout and how steps are planned, not what is drawn
# (cp_mode too: fixed and per-document CP draw the same steps; an interrupted step of either leaves pieces that the
# other plans, and `remainder` reads both kinds of plan)
ELASTIC_FIELDS = ("config.parallel.", "config.num_micro_batches", "config.max_tokens", "config.strategy",
                  "config.allow_slicing", "config.schedule", "config.model", "config.device", "config.cost",
                  "config.memory_gib", "config.tokens_per_step", "config.planner_options", "config.cp_mode",
                  "dp_rank")
ALL = 1 << 40  # a rank that finished the step: every micro-batch yielded


def drawn_fields(fingerprint: dict) -> dict:
    """The fingerprint without the fields a layout change may change."""
    return {k: v for k, v in flatten(fingerprint).items() if not k.startswith(ELASTIC_FIELDS)}


def same_layout(saved: dict, current: dict) -> bool:
    return flatten(saved) == flatten(current)


def _key(step_state: dict | None) -> tuple[int, int]:
    """The order of stream positions: steps counted by `k`; a remainder step comes before the step after it."""
    if step_state is None:
        return (0, 1)
    return (int(step_state["k"]), 0 if step_state.get("remainder") else 1)


def _plain(step_state: dict | None) -> dict | None:
    """A position without the rank's own counts (stats differ between ranks at the same position)."""
    return None if step_state is None else {k: v for k, v in step_state.items() if k != "stats"}


def merge_states(states: list[dict]) -> dict:
    """The `state_dict()` of every rank of one save (any order) as one state that every rank of another layout
    loads with `load_state_dict`. Refuses states of different runs or different saves, naming what differs."""
    if not states:
        raise ValueError("merge_states needs the state_dict() of every rank of one save, got none")
    states = [upgraded(st) for st in states]
    for i, st in enumerate(states):
        check_state_shape(st)
        if st["fingerprint"].get("dp_rank") is None or "ranks" in st:
            raise ValueError(
                f"merge_states: states[{i}] is a merged state already (merge_states' result: no dp_rank, every "
                "rank's position in 'ranks'); expected the state_dict() of each DP rank of one save. A merged state "
                "is loaded as it is (load_state_dict), never merged again")
    first = states[0]["fingerprint"]
    base = {k: v for k, v in first.items() if k != "dp_rank"}
    for st in states[1:]:
        check_fingerprint({k: v for k, v in st["fingerprint"].items() if k != "dp_rank"}, base)
    dp = int(first["config"]["parallel"]["dp"])
    ranks = sorted(int(st["fingerprint"]["dp_rank"]) for st in states if st["fingerprint"]["dp_rank"] is not None)
    if ranks != list(range(dp)):
        raise ValueError(f"merge_states needs one state of each of the {dp} DP ranks that saved (dp={dp}), got the "
                         f"states of ranks {ranks}")
    by_rank = sorted(states, key=lambda st: int(st["fingerprint"]["dp_rank"]))
    low = min(_key(st["loader"]["step_state"]) for st in by_rank)
    behind = [st for st in by_rank if _key(st["loader"]["step_state"]) == low]
    # None is the start (a rank that has yielded nothing), the same position as any state of no step planned yet
    placed = [st for st in behind if st["loader"]["step_state"] is not None]
    if len({msgspec.json.encode(_plain(st["loader"]["step_state"])) for st in placed}) > 1:
        raise ValueError("these states stand at different positions of the stream although at the same step: "
                         "they are not the states of one save")
    ref = placed[0] if placed else behind[0]
    positions = []
    for st in by_rank:
        pos = st["loader"]
        ahead = _key(pos["step_state"]) != low
        if ahead and int(pos["skip"]):
            raise ValueError(f"DP rank {st['fingerprint']['dp_rank']} stands inside a later step than the others: "
                             "these states are not the states of one save")
        positions.append({"step_state": pos["step_state"], "skip": ALL if ahead else int(pos["skip"])})
    out = dict(ref, fingerprint=dict(first, dp_rank=None), ranks=positions)
    out["loader"] = {"step_state": ref["loader"]["step_state"], "skip": 0}
    return out


class Resume(msgspec.Struct):
    """Where a loader of the new layout starts: its StepNode state, and the pass bookkeeping."""

    step_state: dict | None
    next_epoch: int
    pass_left: int | None
    pass_open: bool


def elastic_start(state: dict, current_fingerprint: dict, replay) -> Resume:
    """The start of a loader whose layout differs from the saving one's (`state`: one rank's state or
    `merge_states`'). `replay(config, step_state)` plans the step at `step_state` with `config` and returns its
    StepWork (the interrupted step as the old layout planned it)."""
    check_fingerprint(drawn_fields(state["fingerprint"]), drawn_fields(current_fingerprint))
    old = msgspec.convert(state["fingerprint"]["config"], PlanConfig)
    positions = state.get("ranks")
    if positions is None:
        pos = state["loader"]
        if int(pos["skip"]) and old.parallel.dp > 1:
            raise ValueError(
                f"this state was saved inside a step (after {pos['skip']} of its micro-batches on DP rank "
                f"{state['fingerprint']['dp_rank']} of dp={old.parallel.dp}); resuming it at another layout needs "
                "every rank's state of that save: load merge_states([state of rank 0, ..., state of rank "
                f"{old.parallel.dp - 1}])"
            )
        positions = [pos]
    resume = Resume(state["loader"]["step_state"], int(state["next_epoch"]), state["pass_left"],
                    bool(state["pass_open"]))
    if not any(int(p["skip"]) for p in positions):
        return resume  # a step boundary: the stream position is layout-free
    before = state["loader"]["step_state"]
    work = replay(old, before)
    for p in positions:
        if int(p["skip"]) == ALL and _plain(p["step_state"]) != _plain(work.state_after):
            raise ValueError("a rank's state stands after the interrupted step, but not where that step ends: "
                             "these states are not the states of one save")
    pieces = remainder(work.plan, [int(p["skip"]) for p in positions])
    docs = {d for d, _, _ in pieces}
    rem = {"step": work.plan.step, "epoch": work.epoch, "last": work.last_in_epoch,
           "loss_tokens": work.plan.loss_tokens, "pieces": [list(p) for p in pieces],
           "doc_lengths": [[d, work.step_lengths[d]] for d in sorted(docs)],
           # the step each document drawn before this step was first drawn in: the delay its pieces count
           "drawn": [[d, (work.drawn or {})[d]] for d in sorted(docs) if d in (work.drawn or {})]}
    resume.step_state = dict(work.state_after, remainder=rem)
    return resume


def remainder(plan: StepPlan, skips: list[int]) -> list[tuple[int, int, int]]:
    """The pieces (doc, offset, length) of `plan` that no rank trained: rank r trained its first skips[r]
    micro-batches (a DP-Merge micro-batch counts as its group's first rank's). A piece none of whose slices was
    trained stays whole (it is sliced again if need be); the untrained slices of a piece begun before the
    interruption become pieces of their own, one per contiguous run."""
    chains: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}  # (doc, attend_from) -> [(start, end, trained)]
    seen: set = set()
    if plan.cp_mode == "dynamic":
        for s, trained in _dynamic_trained(plan, skips):
            chains.setdefault((s.doc, s.attend_from), []).append((s.start, s.end, trained))
    for r, rank in enumerate(plan.ranks if plan.cp_mode != "dynamic" else ()):
        for i, mb in enumerate(rank.micro_batches):
            owner = r
            if mb.dp_group and len(mb.dp_group) > 1:
                key = (tuple(mb.dp_group), i, tuple(mb.segments))
                if key in seen:
                    continue
                seen.add(key)
                owner = min(mb.dp_group)
            trained = i < skips[owner]
            for s in mb.segments:
                chains.setdefault((s.doc, s.attend_from), []).append((s.start, s.end, trained))
    out = []
    for (doc, af), segs in chains.items():
        segs.sort()
        if not any(t for *_, t in segs):
            out.append((doc, af, segs[-1][1] - af))
            continue
        run: list[int] | None = None
        for a, b, t in segs + [(0, 0, True)]:
            if not t and run is not None and run[1] == a:
                run[1] = b
                continue
            if run is not None:
                out.append((doc, run[0], run[1] - run[0]))
                run = None
            if not t:
                run = [a, b]
    return out



def _dynamic_trained(plan: StepPlan, skips: list[int]):
    """(segment, trained) once per segment of a per-document CP plan (`ranks`: the DP x CP pool, GPU g of DP rank
    g // cp; `skips` per DP rank): a segment of slot i is trained when the DP ranks of all its group's GPUs passed
    slot i. A group whose GPUs disagree (some passed it, some not) cannot be told trained or not: refused."""
    cp = max(1, len(plan.ranks) // max(1, len(skips)))
    seen: set = set()
    for g, rank in enumerate(plan.ranks):
        for i, mb in enumerate(rank.micro_batches):
            for s, p in zip(mb.segments, mb.cp or [None] * len(mb.segments)):
                gpus = range(p.first, p.first + p.size) if p is not None else (g,)
                if (i, s) in seen:
                    continue
                seen.add((i, s))
                done = {i < skips[x // cp] for x in gpus}
                if len(done) > 1:
                    raise ValueError(f"step {plan.step}: micro-batch {i} of the CP group of GPUs {gpus[0]}.."
                                     f"{gpus[-1]} (document {s.doc}) was yielded on some of its DP ranks and not on "
                                     "others: these states are not the states of one save")
                yield s, done.pop()
