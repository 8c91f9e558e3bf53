"""One epoch of a `PackedDataset` through spawned DataLoader workers, checked by the ledger: the object-storage
tests' way to show that a pickled source (no client, no open object) reads on in each worker."""

from __future__ import annotations

from helpers.ledger import TokenLedger


def spawned_epoch(ds, num_workers: int = 2) -> tuple[int, list[list[int]]]:
    """The tokens the ledger counts for epoch 0 (raising unless each was yielded once) and every yielded piece."""
    from torch.utils.data import DataLoader

    steps = list(DataLoader(ds, batch_size=None, num_workers=num_workers, multiprocessing_context="spawn"))
    ledger = TokenLedger(ds._p.stream)
    got = []
    for mbs in steps:
        ledger.add(mbs)
        for b in mbs:
            ids, cu = b.input_ids.numpy().reshape(-1), b.cu_seqlens.numpy()
            got += [ids[a:e].tolist() for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return ledger.check_epoch(0), got
