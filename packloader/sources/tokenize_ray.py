"""`tokenize` on a Ray cluster: a Ray Data pipeline over the part indices 0..N-1, each task tokenizing its part
(`tokenize_parts.py`) into one shared output directory, so the result is the same tokens in the same order as one
machine's `tokenize`. `address=None` starts a local Ray instance; a cluster address ("ray://host:10001", "auto")
joins one whose workers all see `out_dir` (a shared filesystem) and the inputs.

Each task opens the input and the tokenizer itself from their specs (paths and names travel; open sources and
tokenizer objects stay where they are built).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from packloader.sources.tokenize_parts import PartRecord, check_parts


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401 - the pipeline's API
    except ImportError as e:
        raise ImportError(f"tokenize on Ray needs the ray package: pip install 'packloader[ray]' ({e})") from e
    return ray


def _run_part(row: dict[str, Any]) -> dict[str, Any]:
    from packloader.sources.errors import SourceError
    from packloader.sources.tokenize_parts import tokenize_part

    job = msgspec.json.decode(row["job"])
    try:
        source, tokenizer = job_inputs(job)
        tokenize_part(source, tokenizer, job["out_dir"], int(row["part"]), job["parts"],
                      progress=False, **job["options"])
    except (SourceError, FileNotFoundError, FileExistsError, ValueError) as e:  # back to the driver as data: Ray
        # re-raises a task's error as its own wrapper, which keeps the message but not the type
        kind = next(c.__name__ for c in (SourceError, FileNotFoundError, FileExistsError, ValueError) if isinstance(e, c))
        return {"part": int(row["part"]), "error": kind, "message": f"part {row['part']}/{job['parts']}: {e}"}
    return {"part": int(row["part"]), "error": "", "message": ""}


_ERRORS = {"FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError, "ValueError": ValueError}


def job_inputs(job: dict[str, Any]):
    """The source and tokenizer a job's specs name (the CLI's `open_source` arguments and tokenizer name)."""
    from packloader.sources.tokenize_input import open_input
    from packloader.sources.tokenizers import get_tokenizer

    source = open_input(job["inputs"], job["open"])
    return source, get_tokenizer(job["tokenizer"], num_threads=job.get("threads"), eos=job.get("eos"))


def tokenize_on_ray(inputs: list[str], tokenizer: str, out_dir: str | os.PathLike, *, workers: int,
                    address: str | None = None, open_options: dict[str, Any] | None = None,
                    options: dict[str, Any] | None = None, threads: int | None = 1, eos=None) -> list[PartRecord]:
    """Tokenize `inputs` in `workers` parts as Ray tasks, at most `workers` at once; returns the parts' records,
    checked to form one whole (`check_parts`)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ray = _ray()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 **({"num_cpus": workers} if address is None else {}))
    try:
        local = [os.path.abspath(p) if os.path.exists(p) else p for p in inputs]  # workers run in other folders
        job = msgspec.json.encode({"inputs": local, "open": open_options or {}, "tokenizer": tokenizer,
                                   "threads": threads, "eos": eos, "out_dir": os.path.abspath(out_dir), "parts": workers,
                                   "options": options or {}})
        ds = ray.data.from_items([{"part": i, "job": job} for i in range(workers)], override_num_blocks=workers)
        rows = ds.map(_run_part, compute=ray.data.TaskPoolStrategy(size=workers), num_cpus=1).take_all()
    finally:
        if started:
            ray.shutdown()
    failed = sorted((r for r in rows if r["error"]), key=lambda r: r["part"])
    if failed:
        from packloader.sources.errors import SourceError

        raise _ERRORS.get(failed[0]["error"], SourceError)(failed[0]["message"])
    records = check_parts(out_dir)
    assert records is not None and sorted(r["part"] for r in rows) == list(range(workers))
    return records
