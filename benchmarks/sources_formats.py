"""One shuffled epoch of raw token reads from the same documents stored as a Megatron .bin/.idx pair, a Parquet
token shard, a datasets Dataset (memory-mapped from save_to_disk) and a datasets IterableDataset (blocks restored
through its state_dict), through DocumentStream as the loader reads them (chunks of 256 documents in epoch order).

    python benchmarks/sources_formats.py [--docs 20000] [--mean-len 500]

Prints seconds to open each source and tokens per second for its first epoch (each on a freshly opened source,
best of 3).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def write_all(root: Path, docs: list[np.ndarray]) -> dict:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(root / "m.bin"), dtype=np.int32)
    for d in docs:
        builder.add_document(torch.from_numpy(d), [len(d)])
    builder.finalize(str(root / "m.idx"))
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int32)
    arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(docs)))
    pq.write_table(pa.table({"tokens": arr, "length": [len(d) for d in docs]}), root / "p.parquet",
                   row_group_size=2048, compression="zstd", use_dictionary=False)
    datasets.Dataset(pa.table({"input_ids": arr})).save_to_disk(str(root / "hf"))
    return {"megatron": str(root / "m"), "parquet": str(root / "p.parquet"), "hf": str(root / "hf")}


def epoch_seconds(stream, chunk: int = 256) -> float:
    t = time.perf_counter()
    n = 0
    for lo in range(0, stream.num_docs, chunk):
        ids = stream.doc_ids(0, np.arange(lo, min(stream.num_docs, lo + chunk)))
        n += sum(len(x) for x in stream.read(ids))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--mean-len", type=int, default=500)
    args = ap.parse_args()

    import datasets

    from packloader.sources.hf_iterable import IterableDatasetSource
    from packloader.sources.open import open_source
    from packloader.sources.stream import DocumentStream

    datasets.disable_progress_bars()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100_000, size=int(n)).astype(np.int32)
            for n in np.clip(rng.exponential(args.mean_len, args.docs), 1, None)]
    total = sum(len(d) for d in docs)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_all(Path(tmp), docs)
        opens = {
            "megatron .bin/.idx": lambda: open_source(paths["megatron"]),
            "parquet (zstd)": lambda: open_source(paths["parquet"]),
            "datasets Dataset (save_to_disk)": lambda: open_source(paths["hf"]),
            "datasets IterableDataset": lambda: IterableDatasetSource(
                datasets.load_from_disk(paths["hf"]).to_iterable_dataset(num_shards=4)),
        }
        print(f"{args.docs} documents, {total:,} tokens")
        print("| source | open (s) | epoch read (s) | tokens/s |")
        print("| --- | ---: | ---: | ---: |")
        for name, make in opens.items():
            runs = []
            for _ in range(3):  # a fresh source each time: no decoded row group or block cached from before
                t = time.perf_counter()
                src = make()
                opened = time.perf_counter() - t
                runs.append((epoch_seconds(DocumentStream(src, tokenizer=None, seed=1)), opened))
            read, opened = min(runs)
            print(f"| {name} | {opened:.2f} | {read:.2f} | {total / read:,.0f} |")

if __name__ == "__main__":
    main()
