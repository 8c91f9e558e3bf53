"""Written action lists (what `packloader plan` writes per step and DP rank, `balancers.sim.actions`) turned into
the pipelining engine's compute actions, after checking that they are a schedule this DP rank can run: so a
trainer executes exactly the order the plan was scored with, or gets an error naming the rank and action."""

from __future__ import annotations

from typing import Mapping, Sequence

from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, _Action

_OPS = {"F": FORWARD, "B": FULL_BACKWARD, "W": BACKWARD_WEIGHT}
_NAMES = {FORWARD: "F", FULL_BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}


def rank_stages(s: int, pp: int, vpp: int = 1, v_shape: bool = False) -> list[int]:
    """The model stages pipeline rank s holds: s, s + pp, ... (loop placement), or s and 2*pp-1-s (ZB-V's V)."""
    return sorted({s, 2 * pp - 1 - s}) if v_shape else [c * pp + s for c in range(vpp)]


def engine_actions(written: Sequence[Sequence[Sequence]], m: int, pp: int, vpp: int = 1,
                   readers: Mapping[int, set[int]] | None = None, v_shape: bool = False) -> dict[int, list[_Action]]:
    """Per pipeline rank, the engine's actions for `written[rank] = [[op, micro_batch, stage], ...]`.

    Checked: one list per pipeline rank; op "F", "B" or "W"; the stages of rank s (`rank_stages`: s + c*pp, or
    s and 2*pp-1-s with `v_shape`, ZB-V); every micro-batch's forward and backward once on each of the rank's
    stages, the forward first, and a W (weight gradient) at most once, after its B (then the input gradient
    alone: the engine's I); and, for slices (`readers[u]`: the later micro-batches that read u's keys), on every
    stage u's forward before its readers' and their backwards before u's (u's key/value gradients come from
    them)."""
    if len(written) != pp:
        raise ValueError(f"action lists: {len(written)} pipeline ranks' lists for pp={pp}")
    readers = readers or {}
    out: dict[int, list[_Action]] = {}
    for s, lst in enumerate(written):
        acts, pos = [], {}
        split = {(a[1], a[2]) for a in lst if len(a) == 3 and a[0] == "W"}  # input-gradient Bs
        stages = set(rank_stages(s, pp, vpp, v_shape))
        for k, a in enumerate(lst):
            where = f"pipeline rank {s}, action {k} {list(a)!r}"
            if len(a) != 3:
                raise ValueError(f"action lists: {where}: expected [op, micro_batch, stage]")
            op, u, st = a[0], a[1], a[2]
            if op not in _OPS:
                raise ValueError(f"action lists: {where}: op must be 'F', 'B' or 'W'")
            if not isinstance(u, int) or not 0 <= u < m:
                raise ValueError(f"action lists: {where}: micro-batch must be in 0..{m - 1}")
            if st not in stages:
                raise ValueError(f"action lists: {where}: stage must be one of {sorted(stages)} "
                                 f"({'the V: rank and 2*pp-1-rank' if v_shape else 'stage c*pp + rank'})")
            if (op, u, st) in pos:
                raise ValueError(f"action lists: {where}: runs twice (first at action {pos[(op, u, st)]})")
            if op == "B" and ("F", u, st) not in pos:
                raise ValueError(f"action lists: {where}: backward before the micro-batch's forward on that stage")
            if op == "W" and ("B", u, st) not in pos:
                raise ValueError(f"action lists: {where}: weight gradient before the micro-batch's backward (B)")
            pos[(op, u, st)] = k
            acts.append(_Action(st, BACKWARD_INPUT if op == "B" and (u, st) in split else _OPS[op], u))
        missing = [(op, u, st) for st in sorted(stages) for u in range(m) for op in "FB" if (op, u, st) not in pos]
        if missing:
            raise ValueError(f"action lists: pipeline rank {s} never runs {[list(x) for x in missing[:4]]}"
                             f"{' ...' if len(missing) > 4 else ''} (each micro-batch's F and B once per stage)")
        for u, later in readers.items():
            for v in sorted(later):
                for st in sorted(stages):
                    if pos[("F", v, st)] < pos[("F", u, st)]:
                        raise ValueError(f"action lists: pipeline rank {s}, stage {st}: forward of micro-batch {v} "
                                         f"before that of micro-batch {u}, whose keys its slice reads")
                    if pos[("B", u, st)] < pos[("B", v, st)]:
                        raise ValueError(f"action lists: pipeline rank {s}, stage {st}: backward of micro-batch {u} "
                                         f"before that of micro-batch {v}, which reads its keys: their key/value "
                                         f"gradients are not ready")
        out[s] = acts
    return out


def written_actions(actions: Mapping[int, Sequence[_Action]]) -> list[list[list]]:
    """The engine's compute actions per pipeline rank, back in the written form [[op, micro_batch, stage], ...]."""
    return [[[_NAMES[a.computation_type], int(a.microbatch_index), int(a.stage_index)] for a in actions[s]]
            for s in sorted(actions)]
