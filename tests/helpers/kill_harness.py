"""Exactly once under SIGKILL: a loader process is killed at chosen or random points and resumed in a new process
from its last saved state; the stitched stream must equal one uninterrupted epoch, token by token.

The child process (`child_main`) does what a trainer does. It builds the loader(s), loads the last saved state
when there is one, truncates its batch log to the position that state was saved at (what came after is trained
again), and iterates. After each round (one item from every rank it runs: a micro-batch from `PackedLoader`,
a whole step from a `StatefulDataLoader` over `PackedDataset`) it appends one line per micro-batch to the log:
rank, step, index in step, epoch, the segments (document, start, end), hashes of the tensors and the DP-Merge
group (a micro-batch that several ranks train together, as context parallelism, is counted once). At the rounds
listed in `save_at` it saves every rank's `state_dict()` with the log's byte position, atomically (write a
temporary file, fsync, rename). It dies by SIGKILL to its process group (itself and its DataLoader workers) at
`kill_at` rounds, after logging ("log"), between writing and renaming a state ("save") or after saving ("saved");
or the parent kills the group after a random delay ("timer").

The parent (`run_config`) first runs the configuration once uninterrupted (the reference), then runs it again
through the kills, each time starting a new child from the latest state saved by every rank, and compares
(`verify`): the stitched log record by record against the reference (same micro-batches in the same order),
every micro-batch's input_ids against the source's tokens for its segments (documents the parent generated
itself, located with the pure-numpy epoch order), and every token of every document of the epoch covered
exactly once over all ranks: `lost` tokens were never trained, `repeated` ones more than once (tokens of a
document from outside the epoch count as repeated: they are an extra epoch's).

Ranks: `ranks="local"` runs all dp ranks' loaders in one process (explicit dp_rank, killed together);
`ranks="gloo"` runs one process per rank in a torch.distributed gloo group (the loader checks plans across
ranks), killed and restarted together. Processes: children are forked from a parent that has imported torch
and packloader but never built a loader (no loader threads or state to inherit), so a restart costs a loader
build, not an interpreter start; `fork=False` starts each child as a fresh interpreter instead.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

PHASES = ("log", "save", "saved")


# --- corpora -----------------------------------------------------------------------------------------------------


def long_tail_lengths(n: int, seed: int, scale: float, cap: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.pareto(1.1, size=n) * scale + 1, cap).astype(np.int64)


def write_parquet_corpus(d: Path, n: int = 240, seed: int = 0, shards: int = 4,
                         lengths: np.ndarray | None = None) -> tuple[list[str], list[list[np.ndarray]]]:
    """Token shards with a length column (`lengths="column"`); returns the paths and each shard's documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    lengths = long_tail_lengths(n, seed, 40, 2500) if lengths is None else lengths
    n = len(lengths)
    docs = [rng.integers(0, 256, size=int(k)).astype(np.int32)  # in the vocabulary of the tokenizer named, bytes
            for k in lengths]
    paths, per_shard = [], []
    for s, part in enumerate(np.array_split(np.arange(n), shards)):
        rows = [docs[i] for i in part]
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
        table = pa.table({"tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(rows))),
                          "length": pa.array([len(r) for r in rows], pa.int32())})
        p = d / f"tok-{s:03d}.parquet"
        pq.write_table(table, p, row_group_size=17)
        paths.append(str(p))
        per_shard.append(rows)
    return paths, per_shard


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "über", "naïve", "日本"]


def write_jsonl_corpus(d: Path, n: int = 200, seed: int = 0, shards: int = 3) -> tuple[list[str], list[list[np.ndarray]]]:
    """Text in gzipped JSON Lines, for the bytes tokenizer (UTF-8 bytes, EOS 256); returns the paths and each
    shard's documents as the token ids the loader must yield."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 2)
    texts = [" ".join(rng.choice(WORDS, size=int(k))) + f" #{i}" for i, k in enumerate(long_tail_lengths(n, seed, 6, 400))]
    paths, per_shard = [], []
    for s, part in enumerate(np.array_split(np.arange(n), shards)):
        p = d / f"text-{s:03d}.jsonl.gz"
        with gzip.open(p, "wt", encoding="utf-8") as f:
            for i in part:
                f.write(json.dumps({"id": int(i), "text": texts[i]}, ensure_ascii=False) + "\n")
        paths.append(str(p))
        per_shard.append([np.append(np.frombuffer(texts[i].encode(), np.uint8).astype(np.int64), 256) for i in part])
    return paths, per_shard


GIANT_TOKENS_PER_STEP = 256  # the "giant" corpus's configurations draw this many tokens per step, all ranks
GIANT_FACTOR = 1000  # its two giant documents hold this many steps' tokens each


def giant_lengths(seed: int) -> np.ndarray:
    """A long tail of short documents with two giant ones (1,000 steps' tokens, not a multiple of the context)."""
    lengths = long_tail_lengths(60, seed, 20, 600)
    giant = GIANT_FACTOR * GIANT_TOKENS_PER_STEP
    return np.insert(lengths, [9, 41], [giant + 37, giant + 101])


def write_corpus(kind: str, d: Path, seed: int = 0):
    if kind == "parquet":
        return write_parquet_corpus(d, seed=seed)
    if kind == "giant":
        return write_parquet_corpus(d, seed=seed, lengths=giant_lengths(seed), shards=3)
    if kind == "jsonl.gz":
        return write_jsonl_corpus(d, seed=seed)
    raise ValueError(f"unknown corpus kind {kind!r}")


# --- configurations ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KillConfig:
    # "parquet" (token shards, length column), "jsonl.gz" (text, bytes tokenizer) or "giant" (token shards with two
    # documents of 1,000 steps' tokens each)
    source: str = "parquet"
    strategy: str = "auto"  # "auto" or "wlb" (queues outliers)
    slicing: bool = False  # auto with slicing: context is twice max_tokens, so slimpack slices the long pieces
    dp: int = 1
    workers: int = 0  # 0: PackedLoader; >= 1: StatefulDataLoader(PackedDataset, num_workers=workers)
    ranks: str = "local"  # "local": all ranks in one process; "gloo": one process per rank
    seed: int = 0

    @property
    def name(self) -> str:
        parts = [self.source, self.strategy, "slicing" if self.slicing else "no-slicing", f"dp{self.dp}"]
        if self.dp > 1:
            parts[-1] += f"-{self.ranks}"
        parts.append(f"workers{self.workers}")
        return " ".join(parts)


def plan_config(cfg: KillConfig):
    from packloader.contracts import ParallelConfig, PlanConfig

    cap = 512 if cfg.source != "giant" else 64
    context = 2 * cap if cfg.slicing and cfg.strategy == "auto" else cap
    per_rank = 2048 if cfg.workers == 0 else 768  # a worker's item is a whole step: more, smaller steps
    tokens_per_step = per_rank * cfg.dp if cfg.source != "giant" else GIANT_TOKENS_PER_STEP
    return PlanConfig(strategy=cfg.strategy, max_tokens=cap, context=context, tokens_per_step=tokens_per_step,
                      allow_slicing=cfg.slicing, parallel=ParallelConfig(dp=cfg.dp), seed=cfg.seed)


# --- the child ---------------------------------------------------------------------------------------------------


class _Feed:
    """One rank's loader: `PackedLoader` (items are micro-batches) or a StatefulDataLoader over `PackedDataset`
    (items are steps)."""

    def __init__(self, cfg: KillConfig, paths: list[str], rank: int, worker_start: str) -> None:
        from packloader.loader.dataset import PackedDataset
        from packloader.loader.loader import PackedLoader

        kw = dict(tokenizer="bytes", config=plan_config(cfg), dp_rank=rank, epochs=1, chunk_docs=32)
        if cfg.workers == 0:
            self.obj = PackedLoader(paths, num_threads=2, timeout=60, **kw)
            self.steps = False
        else:
            from torchdata.stateful_dataloader import StatefulDataLoader

            ds = PackedDataset(paths, num_threads=1, **kw)
            self.obj = StatefulDataLoader(ds, batch_size=None, num_workers=cfg.workers,
                                          multiprocessing_context=worker_start)
            self.steps = True
        self.it = None

    def load(self, state: dict) -> None:
        self.obj.load_state_dict(state)

    def state(self) -> dict:
        return self.obj.state_dict()

    def next(self):
        if self.it is None:
            self.it = iter(self.obj)
        try:
            item = next(self.it)
        except StopIteration:
            return None
        return list(item) if self.steps else [item]

    def close(self) -> None:
        if hasattr(self.obj, "close"):
            self.obj.close()


def _hash(*arrays) -> str:
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def record(rank: int, b) -> list:
    """One log line's content: what identifies a micro-batch's tokens, and hashes to compare them by."""
    ids = b.input_ids.reshape(-1).numpy()
    fp = _hash(ids, b.labels.reshape(-1).numpy(), b.position_ids.reshape(-1).numpy(), b.cu_seqlens.numpy(),
               b.cu_seqlens_k.numpy())
    return [rank, b.step, b.index_in_step, b.micro_batches_in_step, b.epoch,
            [[s.doc, s.start, s.end] for s in b.segments], _hash(ids), fp, b.dp_group]


def state_path(workdir: Path, tag: str, count: int) -> Path:
    return workdir / f"state-{tag}-{count:06d}.pkl"


def saved_counts(workdir: Path, tag: str) -> set[int]:
    return {int(p.stem.rsplit("-", 1)[1]) for p in workdir.glob(f"state-{tag}-*.pkl")}


def _die() -> None:
    os.killpg(0, signal.SIGKILL)
    time.sleep(60)  # not reached


def child_main(spec: dict) -> None:
    """Run (or resume) the loader(s) of `spec`, logging every micro-batch; see the module docstring."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # torchdata's deprecation notices, once per worker
    torch.set_num_threads(1)
    cfg = KillConfig(**spec["config"])
    workdir = Path(spec["workdir"])
    rank = spec.get("rank")
    if rank is not None:  # gloo: this process is one rank of the group
        import datetime

        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK=str(rank),
                          WORLD_SIZE=str(cfg.dp))
        dist.init_process_group("gloo", rank=rank, world_size=cfg.dp, timeout=datetime.timedelta(seconds=60))
        ranks, tag = [rank], f"r{rank}"
    else:
        ranks, tag = list(range(cfg.dp)), "all"
    feeds = [_Feed(cfg, spec["paths"], r, spec.get("worker_start", "fork")) for r in ranks]
    log_path = workdir / f"log-{tag}.jsonl"
    resume = spec.get("resume")
    if resume is not None:
        with open(state_path(workdir, tag, resume), "rb") as f:
            saved = pickle.load(f)
        for feed, st in zip(feeds, saved["states"]):
            feed.load(st)
        log = open(log_path, "r+b")
        log.truncate(saved["log_pos"])
        log.seek(saved["log_pos"])
        count = saved["count"]
    else:
        log = open(log_path, "wb")
        count = 0
    kill = spec.get("kill") or {}
    save_at = set(spec.get("save_at", ()))
    while True:
        items = [feed.next() for feed in feeds]
        if all(it is None for it in items):
            break
        lines = [json.dumps(record(r, b)) for r, item in zip(ranks, items) for b in (item or [])]
        log.write(("\n".join(lines) + "\n").encode())
        log.flush()
        count += 1
        at_kill = kill.get("at") == count
        if at_kill and kill["phase"] == "log":
            _die()
        if count in save_at:
            blob = pickle.dumps({"count": count, "log_pos": log.tell(), "states": [f.state() for f in feeds]})
            final = state_path(workdir, tag, count)
            tmp = final.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            if at_kill and kill["phase"] == "save":
                _die()
            os.replace(tmp, final)
        if at_kill:
            _die()
    log.close()
    for feed in feeds:
        feed.close()
    (workdir / f"done-{tag}").write_text(str(count))
    if rank is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


# --- the parent --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(spec: dict, fork: bool) -> int:
    """Start one child in a process group of its own (so a kill takes its DataLoader workers too); its pid."""
    if fork:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setpgid(0, 0)
                # the store's complaints of a rank whose peer was just killed go to the run's file, not the parent's
                os.dup2(os.open(Path(spec["workdir"]) / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
                child_main(spec)
            except BaseException:  # noqa: BLE001 - reported to the parent through the error file
                Path(spec["workdir"], f"error-{spec.get('rank', 'all')}.txt").write_text(traceback.format_exc())
                code = 1
            finally:
                os._exit(code)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        return pid
    spec_path = Path(spec["workdir"]) / f"spec-{spec.get('rank', 'all')}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with open(Path(spec["workdir"]) / "stderr.txt", "ab") as err:
        proc = subprocess.Popen([sys.executable, str(Path(__file__)), "child", str(spec_path)], env=env,
                                start_new_session=True, stderr=err)
    proc.returncode = 0  # waited for with os.waitpid (_wait); keeps Popen from warning that it still runs
    return proc.pid


def _wait(pids: list[int], timer: float | None, timeout: float) -> tuple[list[int], bool]:
    """Wait for the children; after `timer` seconds (if given) SIGKILL every group still running. Returns the
    wait statuses and whether the timer fired on a running child. A child that dies takes the group down."""
    start = time.monotonic()
    status: dict[int, int] = {}
    fired = False
    while len(status) < len(pids):
        for pid in pids:
            if pid in status:
                continue
            got, st = os.waitpid(pid, os.WNOHANG)
            if got:
                status[pid] = st
                if os.WIFSIGNALED(st):  # one rank died: the group goes down with it (a node failure)
                    for other in pids:
                        if other not in status:
                            _kill_group(other)
        elapsed = time.monotonic() - start
        if timer is not None and not fired and elapsed >= timer and len(status) < len(pids):
            fired = True
            for pid in pids:
                if pid not in status:
                    _kill_group(pid)
        if elapsed > timeout:
            for pid in pids:
                if pid not in status:
                    _kill_group(pid)
            raise TimeoutError(f"children {[p for p in pids if p not in status]} ran past {timeout}s")
        time.sleep(0.002)
    for pid in pids:  # the workers of a killed group
        _kill_group(pid)
    return [status[p] for p in pids], fired


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class ChildRun:
    """One child's run: what it was asked to do and how it ended."""

    resume: int | None
    kill: dict | None
    timer: float | None
    killed: bool
    seconds: float


@dataclass
class RunResult:
    config: str
    records: int = 0
    kills: int = 0
    lost: int = 0
    repeated: int = 0
    extra_epoch_tokens: int = 0
    token_errors: int = 0
    order_errors: int = 0
    tokens: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # kills by phase
    children: list[ChildRun] = field(default_factory=list)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    rounds: int = 0
    save_at: list[int] = field(default_factory=list)
    kill_plan: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.repeated or self.token_errors or self.order_errors or self.problems)


class Harness:
    """One configuration on one corpus: its reference run, and kill runs compared against it."""

    def __init__(self, cfg: KillConfig, paths: list[str], docs: list[list[np.ndarray]], workdir: Path, *,
                 fork: bool = True, worker_start: str = "fork", timeout: float = 300.0) -> None:
        self.cfg, self.paths, self.docs = cfg, paths, docs
        self.workdir = Path(workdir)
        self.fork, self.worker_start, self.timeout = fork, worker_start, timeout
        self.reference: list[list] | None = None
        self.rounds = 0
        self.reference_seconds = 0.0
        self.tags = [f"r{r}" for r in range(cfg.dp)] if cfg.ranks == "gloo" and cfg.dp > 1 else ["all"]
        self._runs = 0

    # running ------------------------------------------------------------------------------------------------

    def _run_child(self, wd: Path, resume: int | None, kill: dict | None, save_at: list[int],
                   timer: float | None) -> ChildRun:
        base = {"config": self.cfg.__dict__, "paths": self.paths, "workdir": str(wd), "resume": resume,
                "kill": kill, "save_at": save_at, "worker_start": self.worker_start}
        for p in wd.glob("error-*.txt"):
            p.unlink()
        start = time.monotonic()
        if self.tags == ["all"]:
            pids = [_launch(base, self.fork)]
        else:
            port = free_port()
            pids = [_launch(dict(base, rank=r, port=port), self.fork) for r in range(self.cfg.dp)]
        statuses, fired = _wait(pids, timer, self.timeout)
        seconds = time.monotonic() - start
        killed = any(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in statuses)
        errors = [p.read_text() for p in sorted(wd.glob("error-*.txt"))]
        if errors or any(os.WIFEXITED(s) and os.WEXITSTATUS(s) != 0 for s in statuses):
            stderr = (wd / "stderr.txt").read_text()[-4000:] if (wd / "stderr.txt").exists() else ""
            raise RuntimeError(f"{self.cfg.name}: a child failed (resume {resume}, kill {kill}):\n"
                               + "\n".join(errors) + stderr)
        if not killed and not all((wd / f"done-{t}").exists() for t in self.tags):
            raise RuntimeError(f"{self.cfg.name}: a child exited without finishing")
        return ChildRun(resume, kill, timer if fired else None, killed, seconds)

    def _read_logs(self, wd: Path) -> list[list]:
        out = []
        for t in self.tags:
            with open(wd / f"log-{t}.jsonl", "rb") as f:
                out.extend(json.loads(line) for line in f.read().splitlines() if line)
        return out

    def run_reference(self) -> list[list]:
        wd = self.workdir / "reference"
        wd.mkdir(parents=True, exist_ok=True)
        seg = self._run_child(wd, None, None, [], None)
        self.reference_seconds = seg.seconds
        self.reference = self._read_logs(wd)
        done = [int((wd / f"done-{t}").read_text()) for t in self.tags]
        self.rounds = max(done)
        problems = self.check_source(self.reference)
        own = RunResult(self.cfg.name)
        self.verify(self.reference, own)
        if problems or own.lost or own.repeated:
            raise AssertionError(f"{self.cfg.name}: the uninterrupted run itself is wrong: {problems[:3]}, "
                                 f"{own.lost} tokens lost, {own.repeated} repeated")
        return self.reference

    def run_again(self) -> bool:
        """A second uninterrupted run (its time is what random kill delays are drawn over); whether it yielded
        the same records as the first (a stream that differs between uninterrupted runs cannot resume alike)."""
        wd = self.workdir / "again"
        wd.mkdir(parents=True, exist_ok=True)
        seg = self._run_child(wd, None, None, [], None)
        self.reference_seconds = seg.seconds
        return self._read_logs(wd) == self.reference

    def run_kills(self, kills: list[dict], save_at: list[int]) -> RunResult:
        """Kill at each of `kills` in turn ({"at": round, "phase": ...} or {"timer": seconds}), resuming from
        the latest state every rank saved, then run to the end; verify the stitched log."""
        if self.reference is None:
            self.run_reference()
        self._runs += 1
        wd = self.workdir / f"run-{self._runs:04d}"
        wd.mkdir(parents=True, exist_ok=True)
        result = RunResult(self.cfg.name, rounds=self.rounds, save_at=list(save_at), kill_plan=list(kills))
        start = time.monotonic()
        resume = None
        pending = list(kills)
        while True:
            kill = pending.pop(0) if pending else None
            if kill is not None and "at" in kill and kill["at"] <= (resume or 0):
                continue  # before the resume point: it cannot happen
            timer = kill.get("timer") if kill else None
            seg = self._run_child(wd, resume, kill if kill and "at" in kill else None, save_at, timer)
            result.children.append(seg)
            if not seg.killed:
                if kill is not None and timer is None:
                    result.problems.append(f"kill {kill} did not happen: the child finished first")
                break  # the epoch is done; kills left over (after a timer that came too late) are not made
            result.kills += 1
            kind = "timer" if timer is not None else kill["phase"]
            result.kinds[kind] = result.kinds.get(kind, 0) + 1
            common = set.intersection(*(saved_counts(wd, t) for t in self.tags))
            resume = max(common) if common else None
            for t in self.tags:  # a rank's later states belong to the abandoned run, as a trainer's would
                for c in saved_counts(wd, t):
                    if resume is None or c > resume:
                        state_path(wd, t, c).unlink()
        result.seconds = time.monotonic() - start
        got = self._read_logs(wd)
        self.verify(got, result)
        return result

    # checking ----------------------------------------------------------------------------------------------

    def _locate(self):
        from packloader.sources.order import epoch_stream

        sizes = [len(s) for s in self.docs]
        return epoch_stream(sizes, self.cfg.seed, 0), sum(sizes)

    def check_source(self, records: list[list]) -> list[str]:
        """Each micro-batch's input_ids against the source's tokens for its segments."""
        (shards, rows), n = self._locate()
        problems = []
        for rec in records:
            parts = []
            for doc, a, b in rec[5]:
                if doc >= n:
                    parts = None
                    break
                parts.append(self.docs[int(shards[doc])][int(rows[doc])][a:b])
            if parts is None:
                continue  # another epoch's document: counted by the coverage check
            if _hash(np.concatenate(parts) if parts else np.zeros(0, np.int64)) != rec[6]:
                problems.append(f"rank {rec[0]} step {rec[1]} micro-batch {rec[2]}: input_ids differ from the source")
        return problems

    def verify(self, got: list[list], result: RunResult) -> None:
        (shards, rows), n = self._locate()
        lengths = [len(self.docs[int(s)][int(r)]) for s, r in zip(shards.tolist(), rows.tolist())]
        cover = [np.zeros(k, np.int32) for k in lengths]
        for rec in got:
            if rec[8] and rec[0] != min(rec[8]):
                continue  # a DP-Merge micro-batch: its group's ranks train it together, counted once
            for doc, a, b in rec[5]:
                if doc >= n:
                    result.extra_epoch_tokens += b - a
                else:
                    cover[doc][a:b] += 1
        result.records = len(got)
        result.tokens = int(sum(lengths))
        result.lost = int(sum(int((c == 0).sum()) for c in cover))
        result.repeated = int(sum(int(np.maximum(c - 1, 0).sum()) for c in cover)) + result.extra_epoch_tokens
        result.token_errors = len(self.check_source(got))
        ref = self.reference
        result.order_errors = sum(a != b for a, b in zip(got, ref)) + abs(len(got) - len(ref))


def replace_shard(cfg: KillConfig, paths: list[str], shard: int, workdir: Path) -> None:
    """Put another shard in place of `paths[shard]`: the same name and row count, other documents (a corpus
    re-exported under the same names)."""
    new, _ = write_corpus(cfg.source, workdir / "replacement", seed=cfg.seed + 1000)
    os.replace(new[shard], paths[shard])


def run_replaced_shard(cfg: KillConfig, workdir: Path, at: int = 4, shard: int = 1) -> str:
    """Save at round `at` and die right after; replace one shard between the save and the resume; resume. The
    resumed child must refuse the saved state: returns its error (an AssertionError if it resumed)."""
    paths, docs = write_corpus(cfg.source, workdir / "corpus", seed=cfg.seed)
    h = Harness(cfg, paths, docs, workdir, fork=False)
    wd = workdir / "replaced"
    wd.mkdir(parents=True, exist_ok=True)
    first = h._run_child(wd, None, {"at": at, "phase": "saved"}, [at], None)
    assert first.killed and saved_counts(wd, "all") == {at}, first
    replace_shard(cfg, paths, shard, workdir)
    try:
        h._run_child(wd, at, None, [], None)
    except RuntimeError as e:
        return str(e)
    raise AssertionError(f"{cfg.name}: resumed onto a replaced {paths[shard]} without an error")


def random_kills(rng: random.Random, rounds: int, count: int, reference_seconds: float,
                 timer_share: float = 0.2) -> list[dict]:
    """`count` kill points: rounds drawn uniformly over [1, rounds] (the last round included, in increasing order
    so each kill lands after the previous restart's resume point), each at a random phase; a `timer_share` of
    them a SIGKILL after a random delay instead (anywhere: start-up, mid-write, mid-save)."""
    ats = sorted(rng.sample(range(1, rounds + 1), min(count, rounds)))
    out = []
    for at in ats:
        if rng.random() < timer_share:
            out.append({"timer": rng.uniform(0.0, reference_seconds)})
        else:
            out.append({"at": at, "phase": rng.choice(PHASES)})
    return out


def random_saves(rng: random.Random, rounds: int) -> list[int]:
    """Rounds after which the child saves: every k-th round for a random k, plus the last round half the time."""
    every = rng.randint(1, 6)
    saves = list(range(rng.randint(1, every), rounds + 1, every))
    if rng.random() < 0.5:
        saves.append(rounds)
    return sorted(set(saves))


def prepare_parent(strategies=("auto", "wlb")) -> None:
    """Import what the children use, in the parent, before any fork, so each child does not import it again;
    plan one small window per strategy so numba's kernels are loaded too. Starts no thread."""
    import torch
    import torchdata.stateful_dataloader  # noqa: F401

    import packloader.loader.loader  # noqa: F401
    from packloader.balancers.factory import make_planner
    from packloader.balancers.planners.registry import StepLayout, Window
    from packloader.contracts import PlannerState
    from packloader.sources.jsonl import JsonlSource  # noqa: F401
    from packloader.sources.parquet import ParquetSource  # noqa: F401

    torch.set_num_threads(1)
    for strategy in strategies:
        for slicing in (False, True):
            cfg = plan_config(KillConfig(strategy=strategy, slicing=slicing))
            planner = make_planner(cfg)
            lengths = np.array([900, 400, 300, 50, 20, 7, 512, 3], np.int64) % (cfg.context + 1)
            planner.plan(Window.from_lengths(np.maximum(lengths, 1)), PlannerState(), StepLayout(0, flush=True))


def run_config(cfg: KillConfig, workdir: Path, *, points: int, runs: int, seed: int = 0, fork: bool = True,
               worker_start: str = "fork", kills: list[list[dict]] | None = None,
               saves: list[list[int]] | None = None, timer_share: float = 0.2) -> list[RunResult]:
    """The reference run and `runs` kill runs of about `points / runs` random kill points each (or the given
    `kills` and `saves`, one list per run); a result per run."""
    paths, docs = write_corpus(cfg.source, Path(workdir) / "corpus", seed=cfg.seed)
    h = Harness(cfg, paths, docs, Path(workdir), fork=fork, worker_start=worker_start)
    h.run_reference()
    rng = random.Random(seed)
    results = []
    if kills is None:
        per = [points // runs + (1 if i < points % runs else 0) for i in range(runs)]
        kills = [random_kills(rng, h.rounds, k, h.reference_seconds, timer_share) for k in per]
    for i, plan in enumerate(kills):
        save_at = saves[i] if saves is not None else random_saves(rng, h.rounds)
        results.append(h.run_kills(plan, save_at))
    return results


def run_suite(plan: list[dict], workdir: Path) -> list[dict]:
    """Each entry: {"config": KillConfig fields, "kills": [[kill, ...] per run], "saves": [[round, ...] per run],
    "fork": bool}; kill rounds and save rounds may be fractions of the epoch's rounds (0 < x < 1) or negative
    (counted from the end: -1 is the last round). Returns per entry its runs' results as dicts."""
    import dataclasses

    prepare_parent()
    out = []
    for i, entry in enumerate(plan):
        cfg = KillConfig(**entry["config"])
        wd = Path(workdir) / f"config-{i:03d}"
        paths, docs = write_corpus(cfg.source, wd / "corpus", seed=cfg.seed)
        h = Harness(cfg, paths, docs, wd, fork=entry.get("fork", True), worker_start=entry.get("worker_start", "fork"))
        h.run_reference()
        runs = []
        for kills, saves in zip(entry["kills"], entry["saves"]):
            kills = [dict(k, at=_round(k["at"], h.rounds)) if "at" in k else k for k in kills]
            r = h.run_kills(kills, sorted({_round(x, h.rounds) for x in saves}))
            runs.append(dataclasses.asdict(r))
        out.append({"config": cfg.name, "rounds": h.rounds, "runs": runs})
    return out


def _round(x: float, rounds: int) -> int:
    """A round given as a count, a fraction of the epoch (0 < x < 1) or from the end (-1: the last)."""
    if 0 < x < 1:
        return max(1, min(rounds, round(x * rounds)))
    return int(x) if x > 0 else rounds + 1 + int(x)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    child_main(json.loads(Path(sys.argv[2]).read_text()))
elif __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "suite":
    sys.path.insert(0, str(ROOT))
    result = run_suite(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]).parent / "suite")
    Path(sys.argv[3]).write_text(json.dumps(result))
