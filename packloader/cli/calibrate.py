"""`packloader calibrate`: time attention and the linear part on this device and write a cost profile JSON.

    packloader calibrate --model llama3-8b --max-len 32768 --out h100-llama3-8b.json          # on a GPU
    packloader calibrate --device cpu --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --ffn 128 \\
        --max-len 512 --dtype fp32 --out cpu.json                                               # the CPU reference

    torchrun --nproc-per-node 8 -m packloader.cli.main calibrate --cp intra --out h100-ours.json
                                                        # a device file with this node's measured CP link
    packloader calibrate --cp-shards --model llama2-7b --out h100-shards.json
                                                        # one GPU: a device file with the measured CP-shard overhead

The profile is per pipeline stage (`--layers` layers, default the preset's layers / `--pp`, or 1 for an explicit
shape) on one GPU (CP 1); the balancers load it with `--model profile.json` / `load_cost_model(path)`, which at
`--cp` > 1 scales it to one CP rank's share (`cost.cp_shard_attention.scale_profile_to_cp`).
"""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from packloader.cli.exit_codes import EXIT_BAD_INPUT

log = logging.getLogger("packloader.calibrate")

CPU_NOTE = ("a CPU profile prices this CPU running the reference attention in {dtype}, not a GPU's kernels: its "
            "balance of attention against the linear part differs from a GPU's, so plans priced with it are balanced "
            "for this CPU. Use it to try the command; for training, calibrate on the training GPU, or keep a preset "
            "as --model (priced with the shipped H100 measurements)")

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available, else cpu")
    p.add_argument("--model", default=None, help="a model preset (packloader.balancers.cost.presets), e.g. llama3-8b")
    p.add_argument("--hidden", type=int, help="hidden size (instead of --model)")
    p.add_argument("--heads", type=int, help="query heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int, help="head dimension (default: hidden / heads)")
    p.add_argument("--ffn", type=int, help="MLP intermediate size")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size, to time the LM head (presets know it)")
    p.add_argument("--max-len", type=int, default=None, help="context length: the longest document timed "
                   "(default 8192 on cuda, 1024 on cpu)")
    p.add_argument("--max-tokens", type=int, default=None, help="largest micro-batch timed for the linear part "
                   "(default --max-len)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--backend", default=None, help="force an attention backend (flash, torch, reference); "
                   "default: the fastest available")
    p.add_argument("--layers", type=float, default=None, help="layers per pipeline stage the profile covers")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default layers = preset layers / pp)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: time the per-GPU shard of the layer")
    p.add_argument("--no-head", action="store_true", help="leave the LM head out of the linear part")
    p.add_argument("--lengths", type=int, default=13, help="attention lengths measured (geometric, 64..max-len)")
    p.add_argument("--sizes", type=int, default=9, help="micro-batch sizes measured for the linear part")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per point (the median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before each point")
    p.add_argument("--tile", type=int, default=None, help="the kernel's tile (default: chosen by the fit)")
    p.add_argument("--name", default=None, help="profile name (default: model@device/backend/dtype/layers)")
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.add_argument("--slices", default=None, metavar="CSV", help="also time slices (q query tokens after p earlier "
                   "keys, beside short documents), write their table here, fit the slice term against the profile and "
                   "save the profile with it")
    p.add_argument("--quiet", action="store_true", help="print only the fit")
    p.add_argument("--cp", choices=["intra", "inter"], default=None, help="instead of the kernels: time the CP K/V "
                   "all-gather over groups of 2, 4, ... of the torchrun processes (one per GPU, inside one node: intra; "
                   "one per node: inter), fit bandwidth and latency and write --out as a device file with that half "
                   "of --base-device's cp_link replaced")
    p.add_argument("--cp-shards", action="store_true", help="instead of the kernels: time one layer's attention on "
                   "whole documents of --max-len / 8, / 4, / 2 and --max-len tokens (default max-len 131072 on cuda, "
                   "256 on cpu) and on every rank's zigzag CP shard of them at --cp-sizes, fit the slowest shard's "
                   "overhead over 1/s per size and write --out as a device file with --base-device's fields and "
                   "cp_shard set (one GPU)")
    p.add_argument("--cp-sizes", default=None, help="with --cp-shards: CP sizes (default 2,4,8,16 on cuda, 2,4,8 on cpu)")
    p.add_argument("--base-device", default="h100", help="with --cp or --cp-shards: the device (name or file) the new "
                   "file copies")
    p.add_argument("--gpus-per-node", type=int, default=None, help="with --cp: also set cp_link.gpus_per_node")


def run(args: argparse.Namespace) -> int:
    """`_run`, with bad input (a missing shape, bad --cp-sizes, an unknown preset or file, no torchrun for --cp)
    reported as every command does: one line on stderr and exit status 2."""
    try:
        return _run(args)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"packloader calibrate: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    import torch

    from packloader.balancers.cost.profile_io import save_profile
    from packloader.runtime.calibrate import calibrate, fit_warnings, format_fit

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.cp:
        return _cp_link(args, device)
    dtype = getattr(torch, DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")])
    if args.cp_shards:
        return _cp_shards(args, device, dtype)
    if device == "cpu":
        found = "" if args.device else "no GPU found (torch.cuda.is_available() is False): calibrating on the CPU; "
        log.warning("%s%s", found, CPU_NOTE.format(dtype=str(dtype).removeprefix("torch.")))
    shape = _shape(args)
    layers = args.layers if args.layers is not None else (shape.layers / args.pp if shape.layers else 1.0)
    max_len = args.max_len or (8192 if device == "cuda" else 1024)
    say = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    profile, _ = calibrate(
        shape, device=device, dtype=dtype, max_len=max_len, max_tokens=args.max_tokens, layers=layers, pp=args.pp,
        include_head=not args.no_head, num_lengths=args.lengths, num_sizes=args.sizes, repeats=args.repeats,
        warmup=args.warmup, tile=args.tile, backend=args.backend, name=args.name, progress=say,
    )
    save_profile(profile, args.out)
    print(format_fit(profile))
    print(f"wrote {args.out}")
    if args.slices:  # the profile is on disk already: a failure timing slices does not lose it
        profile = _slices(args, shape, profile, device, dtype, layers, max_len, say)
        save_profile(profile, args.out)
        print(f"wrote {args.out} with the slice term")
    bad = fit_warnings(profile)
    if bad:
        log.warning("the fit is far from the measurements on lengths it did not see (%s): plans priced with %s are "
                    "balanced against times that far off. More --repeats and --warmup on an otherwise idle device "
                    "usually help%s", "; ".join(bad), args.out, "; on a CPU they often do not" if device == "cpu" else "")
    return 0


def _shape(args: argparse.Namespace):
    """The layer shape from --model or --hidden/--heads/..., divided by --tp."""
    from packloader.runtime.calibrate import LayerShape, shape_from_preset

    if args.model:
        shape = shape_from_preset(args.model)
        if args.vocab:
            shape = msgspec.structs.replace(shape, vocab=args.vocab)
    else:
        missing = [f"--{n}" for n in ("hidden", "heads", "ffn") if getattr(args, n) is None]
        if missing:
            raise SystemExit(f"packloader calibrate: give --model PRESET or the shape ({', '.join(missing)} missing)")
        head_dim = args.head_dim or args.hidden // args.heads
        shape = LayerShape(hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                           head_dim=head_dim, ffn=args.ffn, vocab=args.vocab)
    return shape.sharded(args.tp)


def _cp_shards(args: argparse.Namespace, device: str, dtype) -> int:
    """Time whole documents and their CP shards on this device and write a device file with the fitted cp_shard."""
    from pathlib import Path

    import torch

    from packloader.balancers.cost.devices import load_device, read_device
    from packloader.runtime.calibrate_cp import write_device
    from packloader.runtime.calibrate_cp_shards import (
        CPU_SIZES,
        GPU_SIZES,
        device_with_cp_shard,
        fit_overhead,
        time_cp_shards,
    )

    base = read_device(args.base_device) if Path(args.base_device).suffix == ".json" else load_device(args.base_device)
    shape = _shape(args)
    max_len = args.max_len or (131072 if device == "cuda" else 256)
    lengths = sorted({max(2, max_len // d) for d in (8, 4, 2, 1)})
    try:
        sizes = [int(s) for s in args.cp_sizes.split(",")] if args.cp_sizes else list(GPU_SIZES if device == "cuda" else CPU_SIZES)
    except ValueError:
        raise SystemExit(f"packloader calibrate: --cp-sizes expects CP sizes separated by commas, got {args.cp_sizes!r}") from None
    bad = [s for s in sizes if s < 2 or s & (s - 1)]
    if bad:
        raise SystemExit(f"packloader calibrate: --cp-sizes must be powers of two >= 2, got {bad}")
    say = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    rows = time_cp_shards(shape, lengths, sizes, device=torch.device(device), dtype=dtype, backend=args.backend,
                          repeats=args.repeats, warmup=args.warmup, progress=say)
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (a dry run, not a GPU's kernels)"
    source = (f"packloader calibrate --cp-shards on {where}, {str(dtype).removeprefix('torch.')}, {shape.heads} heads "
              f"({shape.kv_heads} kv) x {shape.head_dim}, documents of {', '.join(map(str, lengths))} tokens")
    overhead, raw = fit_overhead(rows, source)
    out = Path(args.out)
    write_device(device_with_cp_shard(base, overhead, name=out.stem), out)
    for size, f in raw.items():
        print(f"CP {size:>2d}: slowest shard x{f['fwd']:.3f} fwd, x{f['bwd']:.3f} bwd of 1/{size} of the document "
              f"(mean rank x{f['mean_fwd']:.3f}, x{f['mean_bwd']:.3f}; token-weighted over the lengths)")
    print(f"wrote {out} (cp_shard; factors below 1 recorded as 1). Load it with register_device or "
          f"PACKLOADER_DEVICE_PATH, then PlanConfig.device={out.stem!r}")
    return 0


def _slices(args, shape, profile, device, dtype, layers, max_len, say):
    """Time one layer's slices, scale them to the profile's layers, write the table, print the fitted term and
    return the profile with it."""
    import torch

    from packloader.balancers.cost.slice_fit import (
        fit_slice_term,
        format_slice_term,
        scaled_timings,
        with_slice_term,
        write_slice_csv,
    )
    from packloader.runtime.calibrate_slices import slice_grid, time_slices

    qs, ps = slice_grid(max_len)
    one = time_slices(shape, qs, ps, device=torch.device(device), dtype=dtype, backend=args.backend,
                      filler_len=max(1, min(512, max_len // 8)), filler_tokens=max(1, max_len // 2),
                      repeats=args.repeats, warmup=args.warmup, progress=say)
    table = scaled_timings(one, layers)
    write_slice_csv(table, args.slices)
    print(f"wrote {args.slices}")
    try:
        term = fit_slice_term(profile, table)
    except ValueError as e:  # too few slices over the timer's resolution: the calibration itself still stands
        print(f"slice term not fitted ({e}): the profile prices slices by the rule")
        return profile
    print(format_slice_term(term))
    return with_slice_term(profile, term)


CP_ROWS = {"cuda": [1024, 4096, 16384, 65536], "cpu": [64, 256, 1024, 4096]}  # tokens of 4 KiB of K/V per rank
NOT_LAUNCHED = ("packloader calibrate --cp times a collective: run it with one process per GPU under torchrun, e.g. "
                "torchrun --nproc-per-node 8 -m packloader.cli.main calibrate --cp intra --out dev.json (WORLD_SIZE "
                "is not set and no process group is initialised)")


def _cp_link(args: argparse.Namespace, device: str) -> int:
    """Time the CP all-gather over this job's ranks and write a device file with the fitted half of cp_link."""
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from packloader.balancers.cost.devices import load_device, read_device
    from packloader.runtime.calibrate_cp import device_with_cp_link, fit_cp_link, measure_cp_groups, write_device

    base = read_device(args.base_device) if Path(args.base_device).suffix == ".json" else load_device(args.base_device)
    launched = not dist.is_initialized()
    if launched:
        if "WORLD_SIZE" not in os.environ:
            raise SystemExit(NOT_LAUNCHED)
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        on = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        samples = measure_cp_groups(CP_ROWS[device], 4096, device=on, repeats=args.repeats, warmup=args.warmup)
    finally:
        if launched:
            dist.destroy_process_group()
    if not samples:  # ranks other than 0
        return 0
    gbps, latency_us = fit_cp_link(samples)
    out = Path(args.out)
    write_device(device_with_cp_link(base, args.cp, gbps, latency_us, name=out.stem,
                                     gpus_per_node=args.gpus_per_node), out)
    for size, received, seconds in samples:
        print(f"all-gather over {size} ranks: {received / 1e6:.3g} MB received per rank in {seconds * 1e3:.3g} ms")
    print(f"cp_link {args.cp}_node: {gbps:.3g} GB/s, {latency_us:.3g} us per ring step "
          f"({max(size for size, _, _ in samples)} ranks, {device}{'; a CPU dry run, not a GPU link' if device == 'cpu' else ''})")
    print(f"wrote {out} (load it with register_device or PACKLOADER_DEVICE_PATH, then PlanConfig.device="
          f"{out.stem!r})")
    return 0
