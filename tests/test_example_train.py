"""examples/train_llama.py at CI size: Parquet shards written by tokenize_to_parquet, a random Llama trained
through packloader with the runtime's varlen attention for one whole epoch with `fixed`, `auto` and `wlb`; every
run trains exactly the shards' tokens (counted here from the Parquet files), the loss starts at the
uniform-prediction value ln(vocab) and falls; the comparison helpers on hand-worked numbers; --cp 2 and --pp 2
(sliced plans through pipeline stages) against single-process runs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_llama.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_llama_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_training_run_same_tokens_and_loss_falls(tmp_path):
    import pyarrow.parquet as pq

    ex = load_example()
    result = ex.main(["--out", str(tmp_path), "--tiny", "--planners", "fixed,auto,wlb", "--quiet"])
    assert (tmp_path / "curves.png").stat().st_size > 0
    saved = json.loads((tmp_path / "curves.json").read_text())
    assert set(saved["summary"]) == {"fixed/0", "auto/0", "wlb/0"}
    shards = list((tmp_path / "shards" / "train").glob("part-*.parquet"))
    epoch_tokens = sum(len(t) for p in shards for t in pq.read_table(p, columns=["tokens"]).column("tokens").to_pylist())
    vocab = result["config"]["vocab"]
    for run in result["runs"]:
        name = run["strategy"]
        # a whole epoch, flushed at its end: the same tokens for every planner, each once
        assert run["tokens_trained"] == epoch_tokens, (name, run["tokens_trained"], epoch_tokens)
        assert run["curve"][-1]["trained"] == epoch_tokens
        assert run["empty_micro_batches"] == 0, name
        losses = [c["loss"] for c in run["curve"]]
        # a random init predicts nearly uniformly: the first loss is close to ln(vocab)
        assert abs(losses[0] - math.log(vocab)) < 0.4, (name, losses[0])
        # and training lowers it clearly (mean of the last 3 steps)
        assert sum(losses[-3:]) / 3 < losses[0] - 0.5, (name, losses)
        assert math.isfinite(run["held_out_loss"]) and run["held_out_loss"] < math.log(vocab) - 0.5
    assert set(saved["comparison"]) >= {"fixed", "auto", "wlb"}


def test_lr_schedule_by_tokens_hand_values():
    ex = load_example()
    args = ex.parse_args(["--out", "unused", "--warmup-frac", "0.1"])
    assert ex.lr_factor(args, 0.0) == 0.0
    assert ex.lr_factor(args, 0.05) == pytest.approx(0.5 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.05))))
    assert ex.lr_factor(args, 0.5) == pytest.approx(0.1 + 0.45)  # cos(pi/2) = 0
    assert ex.lr_factor(args, 1.0) == pytest.approx(0.1)


def test_compare_hand_worked():
    ex = load_example()
    runs = [{"strategy": s, "seed": k, "held_out_loss": v} for s, vals in
            {"fixed": [5.0, 5.2, 5.1], "wlb": [5.05, 5.15, 5.16]}.items() for k, v in enumerate(vals)]
    c = ex.compare(runs)
    assert c["fixed"]["mean"] == pytest.approx(5.1) and c["fixed"]["std"] == pytest.approx(0.1)
    # paired differences 0.05, -0.05, 0.06: mean 0.02, std sqrt((0.03^2 + 0.07^2 + 0.04^2) / 2)
    sd = math.sqrt((0.03 ** 2 + 0.07 ** 2 + 0.04 ** 2) / 2)
    assert c["wlb"]["diff_mean"] == pytest.approx(0.02)
    assert c["wlb"]["diff_std"] == pytest.approx(sd)
    assert c["wlb"]["t"] == pytest.approx(0.02 / (sd / math.sqrt(3)))
    assert c["wlb"]["within_noise"] is True  # 0.02 below fixed's seed std 0.1 and below 2 standard errors
    runs[3:] = [{"strategy": "wlb", "seed": k, "held_out_loss": v} for k, v in enumerate([5.3, 5.5, 5.4])]
    assert ex.compare(runs)["wlb"]["within_noise"] is False  # +0.3 every seed


@pytest.mark.multiprocess
def test_zeppelin_cp_run_matches_the_single_process_run(tmp_path):
    """--cp 2 (Zeppelin's hierarchical CP with layout remapping over 2 gloo processes, documents of 128 tokens or
    more sharded) trains the same steps as the single-process run: per-step loss and held-out loss agree up to
    float32 summation order."""
    ex = load_example()
    common = ["--out", str(tmp_path), "--tiny", "--planners", "fixed", "--steps", "3", "--quiet", "--threads", "1"]
    one = ex.main(common)["runs"][0]
    res = ex.main(common + ["--cp", "2", "--cp-threshold", "128"])
    assert res["config"]["cp"] == 2 and res["config"]["cp_mode"] == "hierarchical"
    two = res["runs"][0]
    assert [c["tokens"] for c in two["curve"]] == [c["tokens"] for c in one["curve"]]
    for a, b in zip(one["curve"], two["curve"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    assert two["held_out_loss"] == pytest.approx(one["held_out_loss"], rel=1e-4)


@pytest.mark.multiprocess
def test_pipeline_pp_run_matches_the_whole_document_run(tmp_path):
    """--pp 2 (two gloo processes, one decoder layer per stage, slimpack plans with slices: a sliced document's
    later slices read the earlier slices' keys from each stage's carried KV) trains the same steps as the unsliced
    run: one process, the same plans, each step's documents rejoined and run whole through the unsplit model with
    plain varlen attention. Per-step loss and held-out loss agree up to float32 summation order."""
    ex = load_example()
    common = ["--out", str(tmp_path), "--tiny", "--pp", "2", "--steps", "3", "--quiet", "--threads", "1"]
    res_whole = ex.main(common + ["--pp-whole"])
    whole = res_whole["runs"][0]
    res = ex.main(common)
    assert res["config"]["pp"] == 2 and res["config"]["layers"] == 2 and res["config"]["planners"] == "slimpack"
    pp = res["runs"][0]
    assert len(pp["curve"]) == len(whole["curve"]) == 3
    # the plans held slices on every step (else the pipeline's KV carry is not exercised)
    assert pp["sliced_steps"] == whole["sliced_steps"] == 3
    assert [c["tokens"] for c in pp["curve"]] == [c["tokens"] for c in whole["curve"]]
    for a, b in zip(whole["curve"], pp["curve"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    assert pp["held_out_loss"] == pytest.approx(whole["held_out_loss"], rel=1e-4)
    # each step ran in the order the simulator scores for the plan's backward order (first stage, empty slots
    # dropped), from the loader's own plans
    from packloader.balancers.sim.simulator import simulate_rank
    from packloader.contracts import ParallelConfig

    args = ex.parse_args(common)
    args.seed = 0
    steps = []
    for b in ex.make_loader(ex.write_shards(tmp_path, args.files, args.valid_fraction, args.data_seed)[0], args,
                            "slimpack", epochs=1):
        if b.step >= 3:
            break
        if b.index_in_step == 0:
            steps.append([])
        steps[-1].append(b)
    for mbs, executed in zip(steps, pp["pipeline_orders"]):
        sim = simulate_rank(ex.planned_rank_plan(mbs), None, ParallelConfig(pp=2), use_plan_costs=True)
        assert [tuple(a) for a in executed] == sim.order(0)
    # training moved the model: the steps' losses differ, so equal curves are not equal inits alone
    assert whole["curve"][2]["loss"] < whole["curve"][0]["loss"] - 0.05


def _first_stage_lists(ex, tmp_path, common, planner, schedule, **parallel) -> list[tuple[str, list]]:
    """Per step of the first two: the schedule the plan chose (`auto` records its choice in the plan) and the first
    stage's action lists `packloader plan` writes for the loader's own plans, empty slots dropped and renumbered;
    rebuilt here from the plans, independently of the run."""
    import msgspec

    from packloader.balancers.cost.model import CostModel
    from packloader.balancers.sim.actions import step_actions
    from packloader.contracts import CostProfile, ParallelConfig, Poly

    linear = CostModel(CostProfile(name="linear", tile=1, attn_fwd=Poly(), attn_bwd=Poly(), lin_fwd=Poly(0, 1.0, 0),
                                   lin_bwd=Poly(0, 2.0, 0)))  # the lists follow the schedule's rule, not the costs
    args = ex.parse_args(common)
    args.seed = 0
    steps = []
    for b in ex.make_loader(ex.write_shards(tmp_path, args.files, args.valid_fraction, args.data_seed)[0], args,
                            planner, epochs=1):
        if b.step >= 2:
            break
        if b.index_in_step == 0:
            steps.append([])
        steps[-1].append(b)
    out = []
    for mbs in steps:
        lists = msgspec.json.decode(msgspec.json.encode(
            step_actions(mbs[0].plan, linear, ParallelConfig(**parallel), schedule=schedule)[0][0]))
        keep = {j: i for i, j in enumerate(j for j, b in enumerate(mbs) if b.num_tokens)}
        out.append((mbs[0].plan.schedule or schedule, [[op, keep[u], st] for op, u, st in lists if u in keep]))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("planner,schedule", [("slimpack", "zb-h1"), ("auto", "auto")])
def test_pipeline_pp_zb_h1_runs_the_written_lists_like_the_whole_document_run(tmp_path, planner, schedule):
    """--pp 2 --schedule zb-h1 (and `auto` choosing per step): every step runs exactly the action lists `packloader
    plan` writes for the loader's own plans (under ZB-H1 split input / weight backwards, "W", which a 1F1B run would
    not execute; empty slots dropped), and trains the same steps as the unsliced whole-document run of the same
    plans (same tolerance as 1F1B above)."""
    ex = load_example()
    common = ["--out", str(tmp_path), "--tiny", "--pp", "2", "--steps", "2", "--quiet", "--threads", "1",
              "--schedule", schedule, "--planners", planner]
    whole = ex.main(common + ["--pp-whole"])["runs"][0]
    pp = ex.main(common)["runs"][0]
    assert len(pp["curve"]) == len(whole["curve"]) == 2
    for a, b in zip(whole["curve"], pp["curve"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    # the lists, rebuilt here from the loader's plans (independently of the run), are what the first stage ran
    acts = pp["pipeline_actions"]
    for k, (chosen, want) in enumerate(_first_stage_lists(ex, tmp_path, common, planner, schedule, pp=2)):
        assert chosen in ("1f1b", "zb-h1")
        assert any(a[0] == "W" for a in want) == (chosen == "zb-h1")
        assert acts["written"][k] == want
        assert acts["executed"][k] == want


@pytest.mark.multiprocess
@pytest.mark.parametrize("planner,schedule", [("slimpack", "interleaved"), ("slimpack", "zb-v"), ("auto", "auto")])
def test_pipeline_vpp2_runs_the_written_lists_like_the_whole_document_run(tmp_path, planner, schedule):
    """--pp 2 --vpp 2 (two model chunks per rank, four decoder layers): interleaved 1F1B on the loop placement
    (rank 0: stages 0 and 2), ZB-V on the V (rank 0: stages 0 and 3, "W" actions), and `auto` choosing per step
    among interleaved, interleaved zero bubble and ZB-V: every step runs exactly the action lists rebuilt here from
    the loader's plans, and trains the same losses as the unsliced whole-document run of the same plans."""
    ex = load_example()
    common = ["--out", str(tmp_path), "--tiny", "--pp", "2", "--vpp", "2", "--steps", "2", "--quiet", "--threads",
              "1", "--schedule", schedule, "--planners", planner]
    whole = ex.main(common + ["--pp-whole"])["runs"][0]
    res = ex.main(common)
    pp = res["runs"][0]
    assert res["config"]["layers"] == 4 and res["config"]["vpp"] == 2
    assert len(pp["curve"]) == len(whole["curve"]) == 2
    for a, b in zip(whole["curve"], pp["curve"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    acts = pp["pipeline_actions"]
    for k, (chosen, want) in enumerate(_first_stage_lists(ex, tmp_path, common, planner, schedule, pp=2, vpp=2)):
        assert chosen in ("interleaved", "zb-h1", "zb-v")
        assert acts["schedules"][k] == chosen
        assert {a[2] for a in want} == ({0, 3} if chosen == "zb-v" else {0, 2})
        assert any(a[0] == "W" for a in want) == (chosen != "interleaved")
        assert acts["written"][k] == want
        assert acts["executed"][k] == want


def test_whole_documents_rejoins_slices_hand_worked():
    from types import SimpleNamespace

    import torch

    from packloader.contracts import Segment

    def mb(segs, ids):
        lens = [s.end - s.start for s in segs]
        cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
        t = torch.tensor(ids)
        return SimpleNamespace(segments=segs, cu_seqlens=cu, input_ids=t, labels=t + 100, position_ids=t + 1000)

    # document 7: tokens 0..5 in slices 0..2 (micro-batch 0) and 2..5 (micro-batch 1); document 3 whole; a piece
    # of document 9 starting at 4 (positions continue from the piece start)
    ex = load_example()
    a = mb([Segment(7, 0, 2, 0), Segment(3, 0, 2, 0)], [70, 71, 30, 31])
    b = mb([Segment(9, 4, 6, 4), Segment(7, 2, 5, 0)], [94, 95, 72, 73, 74])
    ids, labels, pos, cu, longest = ex.whole_documents([a, b])
    assert ids.tolist() == [70, 71, 72, 73, 74, 30, 31, 94, 95]
    assert labels.tolist() == [i + 100 for i in ids.tolist()] and pos.tolist() == [i + 1000 for i in ids.tolist()]
    assert cu.tolist() == [0, 5, 7, 9] and longest == 5
    gap = mb([Segment(7, 3, 5, 0)], [73, 74])
    with pytest.raises(ValueError, match="document 7: its slices in this step leave tokens 0..2 out"):
        ex.whole_documents([gap])


def test_planned_rank_plan_keeps_the_planners_backward_order_hand_worked():
    """The --pp run gives the schedule the plan's backward order (not the simulator's default), with empty slots
    dropped and the others renumbered in the same relative order."""
    from types import SimpleNamespace

    from packloader.contracts import MicroBatch, RankPlan, Segment, StepPlan

    segs = [[Segment(4, 0, 10, 0)], [Segment(4, 10, 20, 0)], [], [Segment(5, 0, 7, 0)]]
    # a valid order that is not the default (which would be [1, 0, 2, 3]): 3 and 2 first
    plan = StepPlan(step=9, ranks=[RankPlan(micro_batches=[MicroBatch(segments=s) for s in segs],
                                            backward_order=[3, 2, 1, 0])])
    batches = [SimpleNamespace(segments=s, num_tokens=sum(x.end - x.start for x in s), plan=plan)
               for s in segs]
    ex = load_example()
    rp = ex.planned_rank_plan(batches)
    assert [list(m.segments) for m in rp.micro_batches] == [segs[0], segs[1], segs[3]]
    assert rp.backward_order == [2, 1, 0]
    plan.ranks[0].backward_order = None
    assert ex.planned_rank_plan(batches).backward_order is None
    batches[1].segments = [Segment(4, 10, 19, 0)]
    with pytest.raises(ValueError, match="step 9: the micro-batches are not those the plan gives DP rank 0"):
        ex.planned_rank_plan(batches)


@pytest.mark.multiprocess
def test_zeppelin_cp_inside_data_parallel_replicas_matches_plain_data_parallel(tmp_path):
    """--cp 2 --dp 2 (4 gloo processes: 2 DP replicas, each Zeppelin's hierarchical CP with layout remapping over
    its own CP group from packloader.runtime.groups.ProcessGroupCache) trains the same steps as --dp 2 (plain data
    parallelism, every micro-batch whole on its DP rank): per-step and held-out loss agree up to float32 order."""
    ex = load_example()
    common = ["--out", str(tmp_path), "--tiny", "--planners", "fixed", "--steps", "2", "--quiet", "--threads", "1",
              "--dp", "2"]
    dp = ex.main(common)["runs"][0]
    res = ex.main(common + ["--cp", "2", "--cp-threshold", "128"])
    assert res["config"]["cp"] == 2 and res["config"]["dp"] == 2
    both = res["runs"][0]
    assert len(both["curve"]) == len(dp["curve"]) == 2
    assert [c["tokens"] for c in both["curve"]] == [c["tokens"] for c in dp["curve"]]
    for a, b in zip(dp["curve"], both["curve"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    assert both["held_out_loss"] == pytest.approx(dp["held_out_loss"], rel=1e-4)


def _rank_switch_placements(rank, world, out_dir, paths):
    """One PipelineRun at --pp 2 --vpp 2 runs a ZB-V step, then an interleaved one, then ZB-V again (what `auto`
    may choose step by step); after each, every rank's whole-model gradient and the loss, against the same step's
    documents run whole through an unsplit copy of the model (this process, no pipeline)."""
    import copy

    import torch

    ex = load_example()
    torch.set_num_threads(1)
    args = ex.parse_args(["--out", out_dir, "--tiny", "--pp", "2", "--vpp", "2", "--quiet"])
    args.seed = 0
    table = torch.from_numpy(ex.vocab_map(paths, args.vocab))
    model = ex.build_model(args, args.vocab)
    ref = copy.deepcopy(model)
    pipe = ex.PipelineRun(model, args)
    out = []
    for k, schedule in enumerate(["zb-v", "interleaved", "zb-v"]):
        args.schedule = schedule
        loader = ex.make_loader(paths, args, "slimpack", epochs=1)
        mbs = [b for b in loader if b.step == k]
        n_step = mbs[0].loss_tokens_in_step
        model.zero_grad(set_to_none=True)
        loss = pipe.step(mbs, table, n_step, loader.config)
        ref.zero_grad(set_to_none=True)
        ref_loss = ex.whole_step_loss_sum(ref, mbs, table)
        (ref_loss / n_step).backward()
        worst = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-12))
                    for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None)
        out.append((schedule, pipe.schedules[-1], sorted({a[2] for a in pipe.executed[-1]}), loss,
                    float(ref_loss) / n_step, worst))
    return out


@pytest.mark.multiprocess
def test_pipeline_vpp2_switches_placement_between_steps(tmp_path):
    """The example's PipelineRun builds the stages of whichever placement a step's schedule needs (ZB-V: rank 0
    holds stages 0 and 3; interleaved: 0 and 2) on the same model: switching back and forth, each step's loss and
    every rank's summed whole-model gradient equal the unsplit model's over the step's whole documents."""
    from helpers.distributed import run_ranks

    ex = load_example()
    args = ex.parse_args(["--out", str(tmp_path), "--tiny", "--pp", "2", "--vpp", "2"])
    paths = ex.write_shards(tmp_path, args.files, args.valid_fraction, args.data_seed)[0]
    res = run_ranks(_rank_switch_placements, 2, str(tmp_path), paths, timeout=300)
    for rank, steps in enumerate(res):
        for schedule, ran, stages, loss, ref, worst in steps:
            assert ran == schedule
            assert stages == ({0: [0, 3], 1: [1, 2]} if schedule == "zb-v" else {0: [0, 2], 1: [1, 3]})[rank]
            assert loss == pytest.approx(ref, rel=1e-5)
            assert worst < 1e-4, (rank, schedule, worst)
