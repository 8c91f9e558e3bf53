"""The small end of the cost model, refitted offline from the H200 proof's recorded measurements (issue 38 part 1;
no GPU needed): part 3's slice table fitted with the key-buffer assembly and a per-slice floor, part 4's packs
priced by the refit per class, and (`--replan`) part 5's `auto` planned again with the refitted profile.

    python benchmarks/cost_small_end.py                # the fit and the accuracy table (seconds)
    python benchmarks/cost_small_end.py --replan       # plus the re-plan of part 5's two steps (minutes of CPU)

What it shows: the slices' floor is not the attention kernel's. The runtime indexed each segment's keys out of
the micro-batch (`k[lo:hi]`), so the backward of a launch holding a slice wrote a zero-filled copy of all T keys
per segment: beta * segments * T. Fitted on the slice table alone it accounts for most of the 0.377 ms of a 128-token slice
after 0 keys and the 20-28 ms per layer that part 4's slice packs (49 segments) ran over their price. The
runtime now splits the keys once (`SliceContext.attention`), so the profile prices slices by x and y only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

from packloader.balancers.cost.model import CostModel  # noqa: E402
from packloader.balancers.cost.profile_io import load_profile  # noqa: E402
from packloader.balancers.cost.slice_fit import (  # noqa: E402
    assembly_times,
    fit_slice_term,
    format_slice_term,
    read_slice_csv,
    with_slice_term,
)

RUN = Path(__file__).resolve().parent / "gpu" / "results" / "2026-11-26-h200" / "run3"
LAUNCH = (33, 16385)  # calibrate_slices' launch: 32 documents of 512 tokens and its 1-token slice after 1 key
FILL = [512] * 48  # part_accuracy.packs: each slice beside 48 documents of 512 tokens
LAYERS = 2  # part 4 timed two layers


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, dtype=np.float64), np.asarray(meas, dtype=np.float64)
    return float(np.mean(np.abs(pred - meas) / meas) * 100)


def fits(run: Path):
    """(profile without a term, the term fitted as part 3 did, the term fitted with the launch known)."""
    prof = msgspec.structs.replace(load_profile(run / "profile-llama2-7b.json"), slice_term=None)
    old = fit_slice_term(prof, read_slice_csv(run / "slices.csv"))
    new = fit_slice_term(prof, read_slice_csv(run / "slices.csv", launch=LAUNCH))
    return prof, old, new


def pack_of(row: dict) -> tuple[list[int], list[int]]:
    if row["kind"] != "slices":
        raise ValueError("whole-document packs are not kept segment by segment in the JSON")
    return [row["tokens"] - sum(FILL)] + FILL, [row["max_p"]] + [0] * len(FILL)


def accuracy(run: Path, prof, new) -> dict:
    """MAPE per class: as recorded, and the refit (slices priced by the new term plus the assembly the recorded
    runtime paid: beta from the slice table, and beta fitted on the other three slice packs, held out)."""
    acc = json.loads((run / "gpu-proof.json").read_text())["parts"]["accuracy"]
    rows = acc["rows"]
    termed = CostModel(with_slice_term(prof, new)).scaled(float(LAYERS))
    sl = [r for r in rows if r["kind"] == "slices"]
    parts = []  # (model seconds fwd+bwd, segments*tokens) of each slice pack
    for r in sl:
        q, p = pack_of(r)
        parts.append((sum(termed.microbatch_time_of(q, p)), len(q) * sum(q)))
    table_beta = new.fwd.assembly + new.bwd.assembly
    by_table, held_out, beta_packs = [], [], []
    for i, r in enumerate(sl):
        af, ab = assembly_times(new, 1, parts[i][1])
        by_table.append((parts[i][0] + LAYERS * (af + ab)) * 1e3)
        others = [j for j in range(len(sl)) if j != i]  # beta of the other packs: their excess per (segment, token)
        b = np.mean([(sl[j]["measured_ms"] * 1e-3 - parts[j][0]) / (LAYERS * parts[j][1]) for j in others])
        beta_packs.append(float(b))
        held_out.append((parts[i][0] + LAYERS * b * parts[i][1]) * 1e3)
    out = {"classes": {}, "beta_table_ns": table_beta * 1e9, "beta_packs_ns": [b * 1e9 for b in beta_packs],
           "slice_packs": []}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        rs = [r for r in rows if r["kind"] == kind]
        meas = [r["measured_ms"] for r in rs]
        rec = mape([r["calibrated_ms"] for r in rs], meas)
        if kind == "slices":
            out["classes"][kind] = {"recorded": rec, "refit_table_beta": mape(by_table, meas),
                                    "refit_held_out_beta": mape(held_out, meas)}
        else:  # no slice: the refit prices them as the recorded profile did
            out["classes"][kind] = {"recorded": rec, "refit_table_beta": rec, "refit_held_out_beta": rec}
    for r, a, b in zip(sl, by_table, held_out):
        out["slice_packs"].append({"q": pack_of(r)[0][0], "p": r["max_p"], "measured_ms": r["measured_ms"],
                                   "recorded_ms": r["calibrated_ms"], "refit_table_ms": a, "refit_held_out_ms": b})
    meas = [r["measured_ms"] for r in rows]
    rec_all = [r["calibrated_ms"] for r in rows]
    tab_all = [r["calibrated_ms"] for r in rows if r["kind"] != "slices"] + by_table
    ho_all = [r["calibrated_ms"] for r in rows if r["kind"] != "slices"] + held_out
    meas_o = [r["measured_ms"] for r in rows if r["kind"] != "slices"] + [r["measured_ms"] for r in sl]
    out["classes"]["all"] = {"recorded": mape(rec_all, meas), "refit_table_beta": mape(tab_all, meas_o),
                             "refit_held_out_beta": mape(ho_all, meas_o)}
    return out


def replan(run: Path, prof, new) -> list[dict]:
    """Part 5's `auto` planned again (the same corpus, windows and stage profile as the run), with the recorded
    profile and with the refit, priced by the refit as the runtime now runs (no assembly)."""
    import tempfile

    from gpu_common import long_tail_lengths

    from packloader.balancers.cost import presets
    from packloader.balancers.cost.measured import measured_profile
    from packloader.balancers.cost.profile_io import save_profile
    from packloader.balancers.draw import draw_windows
    from packloader.balancers.factory import make_planner
    from packloader.balancers.sim.simulator import simulate_step
    from packloader.contracts import ParallelConfig, PlanConfig, PlannerState

    bal = json.loads((run / "gpu-proof.json").read_text())["parts"]["balance"]
    s = bal["setup"]
    par, shape = ParallelConfig(dp=s["dp"], pp=s["pp"]), presets.get_shape("llama2-7b")
    windows = draw_windows(long_tail_lengths(200_000, 0, scale=s["scale"]), s["tokens_per_step"], s["cap"],
                           bal["steps"], incomplete=False).windows
    recorded = load_profile(run / "profile-llama2-7b.json")
    refit = with_slice_term(prof, new)
    price = CostModel(measured_profile(shape, par, base=refit, include_head=False))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, base in (("recorded profile", recorded), ("refit", refit)):
            path = Path(tmp) / f"{label.replace(' ', '-')}.json"
            save_profile(measured_profile(shape, par, base=base), path)
            own = CostModel(measured_profile(shape, par, base=base, include_head=False))
            for strategy in ("auto", "concat"):
                cfg = PlanConfig(strategy=strategy, parallel=par, max_tokens=s["cap"], context=s["cap"],
                                 tokens_per_step=s["tokens_per_step"], model=str(path), device=bal["plan_device"])
                planner, state = make_planner(cfg), PlannerState()
                mbs, t_own, t_refit = [], 0.0, 0.0
                for i in range(bal["steps"]):
                    plan, state = planner.plan(windows[i], state, i)
                    mbs += [len(r.micro_batches) for r in plan.ranks]
                    t_own += simulate_step(plan, own, par).step_time
                    t_refit += simulate_step(plan, price, par).step_time
                out.append({"planned_with": label, "strategy": strategy, "micro_batches_per_rank": mbs,
                            "predicted_own_s": t_own, "predicted_refit_s": t_refit})
    rec = {r["strategy"]: r for r in bal["rows"]}
    for r in out:
        r["recorded_measured_s"] = rec[r["strategy"]]["step_time_measured_s"]
        r["recorded_predicted_s"] = rec[r["strategy"]]["step_time_predicted_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=str(RUN), help="a GPU run's folder (slices.csv, gpu-proof.json, profile)")
    ap.add_argument("--replan", action="store_true", help="also plan part 5's steps again (minutes of CPU)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    run = Path(args.run)
    prof, old, new = fits(run)
    print("as part 3 fitted it (slices only):\n" + format_slice_term(old))
    print("with the launch known (p = 0 rows, floor and assembly):\n" + format_slice_term(new))
    res = {"fit": {"recorded": msgspec.to_builtins(old), "refit": msgspec.to_builtins(new)}, **accuracy(run, prof, new)}
    print(f"\nassembly from the slice table: {res['beta_table_ns']:.1f} ns per (segment, token) and layer; from the"
          f" slice packs (each fitted on the other three): {', '.join(f'{b:.1f}' for b in res['beta_packs_ns'])}")
    print("\n| slice q | after p | measured ms | recorded model ms | refit, table's beta ms | refit, held-out beta ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in res["slice_packs"]:
        m = r["measured_ms"]
        cells = [f"{r[k]:.1f} ({r[k] / m - 1:+.1%})" for k in ("recorded_ms", "refit_table_ms", "refit_held_out_ms")]
        print(f"| {r['q']} | {r['p']} | {m:.1f} | " + " | ".join(cells) + " |")
    print("\n| class | recorded MAPE % | refit, table's beta % | refit, held-out beta % |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in res["classes"].items():
        print(f"| {k} | {v['recorded']:.1f} | {v['refit_table_beta']:.1f} | {v['refit_held_out_beta']:.1f} |")
    if args.replan:
        res["replan"] = replan(run, prof, new)
        print("\n| planned with | strategy | micro-batches per rank (min-max, mean) | predicted by its own profile s |"
              " priced by the refit s | recorded: predicted / measured s |")
        print("| --- | --- | --- | ---: | ---: | --- |")
        for r in res["replan"]:
            m = r["micro_batches_per_rank"]
            print(f"| {r['planned_with']} | {r['strategy']} | {min(m)}-{max(m)}, {np.mean(m):.1f} | "
                  f"{r['predicted_own_s']:.2f} | {r['predicted_refit_s']:.2f} | "
                  f"{r['recorded_predicted_s']:.2f} / {r['recorded_measured_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
