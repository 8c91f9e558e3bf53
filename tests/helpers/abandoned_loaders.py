"""Run under torchrun (2 gloo ranks): two `PackedLoader`s, the second restored from the first's state, both left in
the middle of the epoch with their prefetch threads running, and no `destroy_process_group`: the shape of a
training script that saved and resumed. Rank 0 prefetches further ahead than rank 1, so its threads sit waiting
for rank 1's plans at exit, polling the rank store without pause (the store's C++ call releases the GIL: a thread
frozen there at interpreter exit used to abort the process, "terminate called without an active exception")."""

from __future__ import annotations

import sys

import numpy as np
import torch

from packloader import PackedLoader, ParallelConfig, PlanConfig


def make_loader(rank: int) -> PackedLoader:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, size=int(n)).astype(np.int32) for n in rng.integers(20, 600, size=400)]
    cfg = PlanConfig(strategy="wlb", parallel=ParallelConfig(dp=2), max_tokens=1024, context=256,
                     tokens_per_step=2048, num_micro_batches=2, allow_slicing=False, model="tiny")
    loader = PackedLoader(docs, config=cfg, prefetch=6 if rank == 0 else 1, append_eos=False, epochs=1)
    loader.exchange.poll = 0.0  # poll without pause: the waiting thread is inside the store's call most of the time
    return loader


def main(pairs: int = 3) -> int:
    """`pairs` times a loader and its restored successor, all kept open: more threads waiting at exit make the
    abort all but certain where the threads are left running (each is inside the store's call part of the time)."""
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    kept = []
    for _ in range(pairs):
        first = make_loader(rank)
        for b in first:
            if b.step == 2:
                break
        second = make_loader(rank)
        second.load_state_dict(first.state_dict())
        for b in second:
            if b.step == 4:
                break
        kept += [first, second]
    print(f"rank {rank}: {len(kept)} loaders trained to step 4", flush=True)
    return 0  # the loaders stay open, their threads running; no destroy_process_group


if __name__ == "__main__":
    sys.exit(main())
