"""The GPU proof: every measurement of issue 27 in one command, on one H100/H200, within 25 minutes.

    PYTHONPATH=$PWD python benchmarks/gpu/run_all.py --out out/gpu-proof                  # on the GPU
    PYTHONPATH=$PWD python benchmarks/gpu/run_all.py --parts slices,accuracy --budget-min 8
    PYTHONPATH=$PWD python benchmarks/gpu/run_all.py --quick --budget-min 4                # a short lease
    PYTHONPATH=$PWD python benchmarks/gpu/run_all.py --quick --seconds calibrate=45,balance=60  # set parts' budgets
    PYTHONPATH=$PWD python benchmarks/gpu/run_all.py --dry-run --out /tmp/gpu-dry          # CPU, tiny shapes

Parts (each a module beside this one, each with its share of the time budget; a part past its share stops and
reports what it measured): calibrate (part_calibrate), slices (part_slices), accuracy (part_accuracy), balance
(part_balance), runtime (part_runtime), loader (part_loader), cp_link (part_cp_link: `packloader calibrate --cp`
over the node's GPUs, a device file with the measured CP link), cp_shards (part_cp_shards: one GPU's CP shards of
16K-128K documents against 1/s of the whole, a device file with the measured cp_shard). The environment (torch, CUDA, driver, GPU) is
always recorded. Writes OUT/gpu-proof.json after every part (a run cut short keeps what it finished), the
measured tables (calibrated profiles, slices.csv) and OUT/gpu-proof.md, the docs/benchmarks.md section;
`--write-docs docs/benchmarks.md` also puts it between the `gpu-proof` markers there.

`--dry-run`: the same code on CPU with the reference attention backend, float32, tiny shapes and one repeat,
in well under a minute: tests/test_gpu_proof_dry_run.py runs it so the script cannot rot.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # benchmarks/: sections.write_section

import torch  # noqa: E402
from gpu_common import Budget, BudgetExceeded, Ctx  # noqa: E402
from gpu_env import environment  # noqa: E402

# part -> (module, minutes of a 25-minute run)
PARTS = {"calibrate": ("part_calibrate", 4.0), "slices": ("part_slices", 4.0), "accuracy": ("part_accuracy", 3.0),
         "balance": ("part_balance", 7.0), "runtime": ("part_runtime", 3.0), "loader": ("part_loader", 2.5),
         "cp_link": ("part_cp_link", 1.0), "cp_shards": ("part_cp_shards", 1.5)}
FULL_MINUTES = 25.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in this order: {','.join(PARTS)}")
    p.add_argument("--budget-min", type=float, default=FULL_MINUTES,
                   help="minutes for the selected parts together, shared in the parts' proportions")
    p.add_argument("--seconds", default="",
                   help="per-part budgets that replace the shares of --budget-min, e.g. calibrate=45,balance=60")
    p.add_argument("--out", default="out/gpu-proof", help="folder for gpu-proof.json, gpu-proof.md and tables")
    p.add_argument("--write-docs", default=None, help="also rewrite the gpu-proof section of this markdown file")
    p.add_argument("--dry-run", action="store_true", help="CPU, reference attention, float32, tiny shapes")
    p.add_argument("--quick", action="store_true",
                   help="the 7B shape only and no `packloader calibrate` CLI run: about 4 minutes on an H200")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 (fp32 dry run)")
    p.add_argument("--backend", default=None, help="force an attention backend (default: the dispatcher's choice)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per point (default 5; 1 dry run)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per point (default 2; 0 dry run)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        p.error(f"--parts: unknown part(s) {bad}; expected a comma-separated subset of {','.join(PARTS)}")
    if args.budget_min <= 0:
        p.error(f"--budget-min must be > 0, got {args.budget_min}")
    args.parts = parts
    try:
        args.seconds = {k.strip(): float(v) for k, v in (x.split("=") for x in args.seconds.split(",") if x.strip())}
    except ValueError:
        p.error(f"--seconds: expected part=seconds pairs separated by commas, got {args.seconds!r}")
    if any(k not in parts for k in args.seconds) or any(v <= 0 for v in args.seconds.values()):
        p.error(f"--seconds: each part must be one of --parts ({','.join(parts)}) with seconds > 0, got {args.seconds}")
    return args


def make_ctx(args) -> Ctx:
    dry = args.dry_run
    device = torch.device(args.device or ("cpu" if dry else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("run_all: no CUDA device here; run with --dry-run on CPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype or ("fp32" if dry else "bf16")]
    return Ctx(device=device, dtype=dtype, dry_run=dry, backend=args.backend or ("reference" if dry else None),
               repeats=args.repeats or (1 if dry else 5), warmup=args.warmup if args.warmup is not None else (0 if dry else 2),
               quick=args.quick)


def budgets(parts: list[str], minutes: float) -> dict[str, float]:
    """Seconds per selected part: `minutes` shared in the parts' proportions."""
    total = sum(PARTS[p][1] for p in parts)
    return {p: minutes * 60.0 * PARTS[p][1] / total for p in parts}


def run_part(name: str, ctx: Ctx, seconds: float, out_dir: Path) -> dict:
    module = importlib.import_module(PARTS[name][0])
    budget = Budget(seconds)
    print(f"== {name} (budget {seconds:.0f} s)", flush=True)
    try:
        res = module.run(ctx, budget, out_dir)
        status = "done"
    except BudgetExceeded as e:
        res, status = {"stopped": str(e)}, "budget"
    except Exception as e:  # noqa: BLE001 - one part failing must not lose the others' figures
        traceback.print_exc()
        res, status = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}, "error"
    res["status"], res["seconds"], res["budget_s"] = status, round(budget.used(), 2), round(seconds, 1)
    print(f"== {name}: {status} in {budget.used():.1f} s", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ctx = make_ctx(args)
    torch.manual_seed(ctx.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"command": " ".join(["python", "benchmarks/gpu/run_all.py", *(argv if argv is not None else sys.argv[1:])]),
              "dry_run": ctx.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "environment": environment(ctx.device, ctx.dtype), "budget_min": args.budget_min, "parts": {}}
    print(json.dumps(report["environment"], indent=1), flush=True)
    from gpu_report import render, write

    for name, seconds in {**budgets(args.parts, args.budget_min), **args.seconds}.items():
        report["parts"][name] = run_part(name, ctx, seconds, out_dir)
        report["total_s"] = round(time.perf_counter() - started, 1)
        (out_dir / "gpu-proof.json").write_text(json.dumps(report, indent=1, default=float))
    md = render(report)
    write(md, out_dir / "gpu-proof.md", args.write_docs, measured=ctx.cuda and not ctx.dry_run)
    failed = [n for n, r in report["parts"].items() if r["status"] == "error"]
    print(f"wrote {out_dir / 'gpu-proof.json'} and {out_dir / 'gpu-proof.md'} in {report['total_s']} s"
          + (f"; parts that failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
