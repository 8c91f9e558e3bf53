"""Does calibration's linear part time what a real Llama layer runs around its attention? (issue 27, part 4)

    /work/bin/wpy benchmarks/calibrate_layer_gap.py                 # CPU, float32, one thread, 7 rounds, thread CPU time

Times, in rounds (each round all three, so a busy machine's drift hits them alike), forward + backward of:

* the full layer: the GPU proof's model (benchmarks/gpu/gpu_model.py, one layer) on a pack of `--tokens` tokens
  in documents of `--doc` tokens, attention through varlen_attention;
* attention alone, as calibration times it (`calibrate.time_attention`: the same documents packed in one call);
* the linear part, as calibration times it (`calibrate.time_linear` at the same token count).

and prints (full - attention) / linear per round and its median: 1 when the linear part is what the layer does
around attention. The packloader imported decides the code measured: run it with another checkout first on
sys.path (e.g. an older commit's) to compare; benchmarks/gpu is taken from beside that packloader.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

import packloader
from packloader.runtime import calibrate
from packloader.runtime.calibrate import LayerShape, _time_fwd_bwd, time_attention, time_linear


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--doc", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="thread: this thread's CPU time (one torch thread: the ops and the CPU backward run on it), "
                         "less disturbed by other processes on a shared machine than wall time")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.clock == "thread":  # calibrate's timer reads time.perf_counter on CPU
        calibrate.time = types.SimpleNamespace(perf_counter=time.thread_time)
    sys.path.insert(0, str(Path(packloader.__file__).resolve().parents[1] / "benchmarks" / "gpu"))
    from gpu_model import Layers, Pack, pack_runner

    shape = LayerShape(hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=704, name="small")
    dev, dtype, T = torch.device("cpu"), torch.float32, args.tokens
    docs = T // args.doc
    torch.manual_seed(0)
    model = Layers(shape, 1).to(dev, dtype)
    run_full = pack_runner(model, Pack([args.doc] * docs, [0] * docs, dev, "reference"), shape, dtype)
    print(f"packloader from {Path(packloader.__file__).parent}; {docs} documents of {args.doc} tokens, "
          f"{args.clock} clock")
    ratios = []
    for r in range(args.rounds):
        f, b = _time_fwd_bwd(run_full, dev, args.repeats, 2)
        af, ab = time_attention(shape, np.array([args.doc]), device=dev, dtype=dtype, backend="reference",
                                token_budget=T, repeats=args.repeats, warmup=2)
        lf, lb, _, _ = time_linear(shape, np.array([T]), device=dev, dtype=dtype, repeats=args.repeats, warmup=2)
        full, attn, lin = f + b, float(af[0] + ab[0]) * docs, float(lf[0] + lb[0])
        ratios.append((full - attn) / lin)
        print(f"round {r + 1}: full {full * 1e3:8.2f} ms  attention {attn * 1e3:8.2f} ms  linear {lin * 1e3:8.2f} ms"
              f"  (full - attention) / linear {ratios[-1]:.3f}")
    print(f"median (full - attention) / linear: {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
