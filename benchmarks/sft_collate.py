"""What a loss mask costs in collate: one step's micro-batches collated from the same documents plain and masked
(`MaskedTokens`, about half the tokens trained), in the same run, best of `--repeats`.

    python benchmarks/sft_collate.py [--docs 2000] [--mean-len 500] [--micro-batches 64] [--repeats 7]

Prints the seconds per step for each and the ratio masked / plain. SFT steps hold many short documents, so the
per-segment work of the mask pass is what is measured.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from packloader.collate.collate import collate_step
from packloader.contracts import Segment
from packloader.sources.loss_mask import MaskedTokens


def step_of(docs: list[np.ndarray], micro_batches: int) -> list[list[Segment]]:
    mbs: list[list[Segment]] = [[] for _ in range(micro_batches)]
    for i, d in enumerate(docs):
        mbs[i % micro_batches].append(Segment(i, 0, len(d), 0))
    return mbs


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--mean-len", type=int, default=500)
    p.add_argument("--micro-batches", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = np.maximum(2, rng.exponential(args.mean_len, args.docs).astype(int))
    plain = [rng.integers(0, 32000, n).astype(np.int32) for n in lengths]
    masked = [MaskedTokens(d, np.arange(len(d)) >= len(d) // 2) for d in plain]  # the second half: a completion
    mbs = step_of(plain, args.micro_batches)

    def run(docs):
        step = collate_step(mbs, dict(enumerate(docs)))
        return [step[i] for i in range(len(step))]  # the batches built, as a trainer takes them

    run(plain), run(masked)  # numba compiled, caches warm
    t_plain, t_masked = best(lambda: run(plain), args.repeats), best(lambda: run(masked), args.repeats)
    out = {"tokens": int(lengths.sum()), "docs": args.docs, "plain_s": t_plain, "masked_s": t_masked,
           "ratio": t_masked / t_plain}
    print(f"{out['tokens']} tokens, {args.docs} documents, {args.micro_batches} micro-batches: plain "
          f"{t_plain * 1e3:.1f} ms, masked {t_masked * 1e3:.1f} ms, masked / plain {out['ratio']:.2f}x")
    return out


if __name__ == "__main__":
    main()
