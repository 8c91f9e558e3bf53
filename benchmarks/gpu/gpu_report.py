"""The docs/benchmarks.md section of a GPU proof, from its JSON: one short table per part."""

from __future__ import annotations

from pathlib import Path

SECTION = "gpu-proof"
HEADING = "GPU proof"


def _f(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]


def _calibrate(r: dict) -> list[str]:
    out = []
    for s in r.get("shapes", []):
        out.append(f"Calibration, {s['shape']} (one layer; fitted tile {s['fit']['tile']}): measured here against the "
                   "shipped measurement and the shipped profile (relative difference)")
        out += _table(["part", "n", "fwd ms", "bwd ms", "vs shipped row fwd/bwd", "vs profile fwd/bwd"],
                      [[x["part"], x["n"], x["fwd_ms"], x["bwd_ms"],
                        f"{_f(x['vs_shipped_fwd'], '+.1%')} / {_f(x['vs_shipped_bwd'], '+.1%')}",
                        f"{_f(x['vs_profile_fwd'], '+.1%')} / {_f(x['vs_profile_bwd'], '+.1%')}"] for x in s["rows"]])
        out.append("")
    cli = r.get("cli", {})
    if "command" in cli:
        out += [f"`{cli['command']}` (exit {cli['exit']}):", "", "```", cli["output"].strip(), "```", ""]
    return out


def _slices(r: dict) -> list[str]:
    out = [f"Slices ({r['profile']}; beside {r['filler']['tokens']} tokens of {r['filler']['doc_len']}-token "
           f"documents): {r.get('verdict', '')}"]
    out += _table(["q", "p", "measured ms", "rule ms", "alternative ms", "measured/rule", "measured/alt"],
                  [[x["q"], x["p"], x["measured_ms"], x["rule_ms"], x["alt_ms"], x["measured_over_rule"],
                    x["measured_over_alt"]] for x in r["rows"]])
    if "fit" in r:
        f = r["fit"]
        out.append(f"\nFitted slice term (tile {f['tile']}): pair rate x {f['pair_ratio_fwd']:.3g} (fwd) / "
                   f"{f['pair_ratio_bwd']:.3g} (bwd) of the model's; fit MAPE {f['mape_pct_fwd']:.1f} / "
                   f"{f['mape_pct_bwd']:.1f} %, the rule's {f['rule_mape_pct_fwd']:.1f} / {f['rule_mape_pct_bwd']:.1f} %.")
        out.append(f"The term is in the calibrated profile ({f['in_profile']}): part 4's calibrated row prices slices "
                   "by it." if f.get("in_profile") else "The term is not in a profile (no profile was calibrated here).")
    return out + [""]


def _accuracy(r: dict) -> list[str]:
    out = [f"Cost-model accuracy, {r['layers']} {r['shape']} layers, forward + backward (target MAPE <= "
           f"{r['target_mape_pct']:g} %):"]
    names = list(r["mape_pct"])
    out += _table(["predicted by"] + list(r["mape_pct"][names[0]]) if names else ["-"],
                  [[n] + [_f(v, ".1f") for v in r["mape_pct"][n].values()] for n in names])
    if "calibrated_slices" in r:
        out.append(f"\nThe calibrated profile prices slices by {r['calibrated_slices']}.")
    return out + [""]


def _balance(r: dict) -> list[str]:
    s = r["setup"]
    out = [f"Balance on measured time: DP {s['dp']} / PP {s['pp']}, micro-batches up to {s['cap']} tokens, "
           f"{s['tokens_per_step']} tokens per step, {r['layers_timed']} layers timed per micro-batch, scaled to "
           f"{r['stage_layers']:g} per stage; every strategy timed over the same {r.get('steps', '?')} steps, planned and "
           f"predicted with {r.get('profile', 'the shipped H100 profile')}. Each rank's slowest micro-batch is timed "
           "twice and keeps the faster run (last column: the most its first run was slower):"]
    out += _table(["strategy", "steps", "micro-batches / rank", "imbalance measured", "imbalance predicted",
                   "steps' time measured s", "predicted s", "tokens/s (measured)", "vs concat",
                   "slowest's first run x"],
                  [[x["strategy"], x.get("steps"), x.get("micro_batches_per_rank"), x.get("imbalance_measured"),
                    x.get("imbalance_predicted"), x.get("step_time_measured_s"), x.get("step_time_predicted_s"),
                    x.get("tokens_per_s_measured"), x.get("speedup_vs_concat", x.get("error")),
                    x.get("first_run_slowdown_max")] for x in r["rows"]])
    out += [f"\nPlanner warning: {w}" for w in r.get("planner_warnings", [])]
    return out + [""]


def _runtime(r: dict) -> list[str]:
    out = ["Runtime against the CPU reference (largest relative error):"]
    errs = dict(r.get("distributed_max_rel_err", {}))
    errs.update({f"slice executor {k}": v for k, v in r.get("slice_executor", {}).items()})
    errs.update(r.get("pipeline_max_rel_err", {}))
    out += _table(["check", "max rel err"], [[k, v] for k, v in errs.items()])
    out.append("\nDispatcher overhead (varlen_attention against the kernel called directly, target < 2 %):")
    out += _table(["docs x len", "backend", "dispatcher ms", "direct ms", "overhead %"],
                  [[f"{x['docs']} x {x['doc_len']}", x["backend"], x["dispatcher_ms"], x["direct_ms"],
                    _f(x["overhead_pct"], "+.2f")] for x in r.get("overhead", [])])
    return out + [f"\nPipeline schedule: {r.get('pipeline', '-')}", ""]


def _loader(r: dict) -> list[str]:
    warn = [f"\nPlanner warning: {w}" for w in r.get("plan_warnings", [])]
    return [f"Loader ({r.get('model', 'llama2-7b')} planned for device {r.get('device', 'h100')}): "
            f"{_f(r['loader_tokens_per_s'], '.3g')} tokens/s alone; the {r['layers_timed']} timed layers "
            f"consume {_f(r['consumed_tokens_per_s'], '.3g')} tokens/s (a whole model "
            f"{_f(r['consumed_tokens_per_s_full_model'], '.3g')}); together {_f(r['together_tokens_per_s'], '.3g')} "
            f"tokens/s with {_f(r['together_wait_share'], '.1%')} of the time waiting for batches; keeps up: "
            f"{r['keeps_up']}.", *warn, ""]


def _cp_link(r: dict) -> list[str]:
    if "skipped" in r:
        return [f"CP link: not measured ({r['skipped']}).", ""]
    link = r.get("cp_link")
    head = (f"CP link (per-document CP's K/V all-gather inside a node): {_f(link['intra_node_gbps'])} GB/s, "
            f"{_f(link['intra_node_latency_us'])} us per ring step, written to {r['device_file']}." if link
            else f"CP link: `{r['command']}` failed (exit {r['exit']}).")
    return [head, "", "```", r["output"].strip(), "```", ""]


def _cp_shards(r: dict) -> list[str]:
    head = (f"CP shards ({r['shape']}, one layer's attention): the slowest rank's zigzag shard over 1/s of the whole "
            f"document, token-weighted over the lengths (written to {r['device_file']} as cp_shard, each at least 1):")
    out = [head, "", "| CP size | forward | backward | mean rank forward | mean rank backward |", "| ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {s} | {f['fwd']:.3f}x | {f['bwd']:.3f}x | {f['mean_fwd']:.3f}x | {f['mean_bwd']:.3f}x |"
            for s, f in r["factors"].items()]
    out += ["", "| length | CP size | whole fwd ms | whole bwd ms | slowest fwd | slowest bwd |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {x['length']:,} | {x['size']} | {x['whole_fwd_ms']:.3f} | {x['whole_bwd_ms']:.3f} | {x['fwd']:.3f}x | "
            f"{x['bwd']:.3f}x |" for x in r["rows"]]
    return out + [""]


RENDER = {"calibrate": _calibrate, "slices": _slices, "accuracy": _accuracy, "balance": _balance,
          "runtime": _runtime, "loader": _loader, "cp_link": _cp_link, "cp_shards": _cp_shards}


def render(report: dict) -> str:
    env = report["environment"]
    lines = [f"Measured by `{report['command']}` on {env.get('gpu') or env['device']} (driver {_f(env.get('driver'))}), "
             f"torch {env['torch']}, CUDA {_f(env.get('cuda'))}, {env['dtype']}, attention backend "
             f"{env['attention_backend']}, {report['started']}; {report.get('total_s', 0):g} s in all."
             + (" DRY RUN: CPU, tiny shapes; the figures check the code path, not a GPU." if report["dry_run"] else ""),
             ""]
    for name, res in report["parts"].items():
        lines.append(f"**{name}** ({res['status']}, {res['seconds']:g} s of {res['budget_s']:g})")
        lines.append("")
        if res["status"] == "error":
            lines += [f"Failed: {res['error']}", ""]
            continue
        if res["status"] == "budget":
            lines += [f"Stopped: {res['stopped']}", ""]
            continue
        lines += RENDER[name](res)
    return "\n".join(lines)


PENDING = f"## {HEADING} (pending a GPU)"


def write(md: str, path: Path, docs: str | None, *, measured: bool = False) -> None:
    """The section to `path`, and between its markers in `docs` when given; a run on a GPU (`measured`) also
    drops "(pending a GPU)" from the section's heading there."""
    path.write_text(md + "\n")
    if docs:
        from sections import write_section

        write_section(Path(docs), SECTION, HEADING, md)
        text = Path(docs).read_text()
        if measured and PENDING in text:
            Path(docs).write_text(text.replace(PENDING, f"## {HEADING}", 1))
