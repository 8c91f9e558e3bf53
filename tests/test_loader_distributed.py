"""Several gloo ranks: the same plan on every rank, every token once across ranks, lengths all-gathered when
ranks share the tokenizing, and a clear error (not a hang) when a rank dies or disagrees."""

from __future__ import annotations

import msgspec
import pytest
from helpers.distributed import run_ranks

from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.loader import PackedLoader
from tests.helpers.ledger import TokenLedger

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _config(world: int) -> PlanConfig:
    return PlanConfig(strategy="fixed", max_tokens=256, context=256, tokens_per_step=400 * world,
                      parallel=ParallelConfig(dp=world))


def _summarise(batches) -> list[tuple]:
    return [(b.step, msgspec.json.encode(b.plan), [(s.doc, s.start, s.end) for s in b.segments],
             b.loss_tokens_in_step, b.num_loss_tokens, b.index_in_step, b.micro_batches_in_step) for b in batches]


def _run(rank, world, paths, lengths, epochs):
    import torch.distributed as dist

    loader = PackedLoader(paths, tokenizer="bytes", config=_config(world), lengths=lengths, num_threads=2,
                          chunk_docs=13, timeout=60)
    assert loader.dp_rank == rank  # from torch.distributed
    mode = loader.lengths_mode
    batches = []
    for _ in range(epochs):
        batches.extend(loader)
    loader.close()
    dist.barrier()
    return mode, _summarise(batches)


def _reference(paths, world, lengths_per_rank=None):
    """The same loaders without torch.distributed (explicit dp_rank, each reading everything)."""
    out = []
    for r in range(world):
        loader = PackedLoader(paths, tokenizer="bytes", config=_config(world), dp_rank=r, num_threads=1)
        out.append(_summarise(list(loader)))
        stream = loader.stream
        loader.close()
    return out, stream


@pytest.mark.parametrize("world,kind,lengths", [(2, "tokens", "auto"), (3, "text", "gather"), (4, "text", "local"),
                                                (2, "text", "gather")])
def test_ranks_plan_alike_and_cover_every_token_once(tmp_path, world, kind, lengths):
    from helpers.docs import text_docs, token_docs, write_text_shards, write_token_shards

    if kind == "tokens":
        paths = write_token_shards(tmp_path, token_docs(220, seed=world), shards=3)
    else:
        paths = write_text_shards(tmp_path, text_docs(180, seed=world), shards=4, row_group_size=10)
    results = run_ranks(_run, world, paths, lengths, 2)
    modes = {m for m, _ in results}
    assert modes == {"column" if kind == "tokens" else lengths}
    per_rank = [r for _, r in results]
    steps = [[x[0] for x in r] for r in per_rank]
    for r in range(world):
        # identical plans on every rank, and equal micro-batch counts per step
        assert sorted(set(steps[r])) == sorted(set(steps[0]))
        for mine, theirs in zip(_first_per_step(per_rank[r]), _first_per_step(per_rank[0])):
            assert mine[1] == theirs[1]
    # the per-step loss normaliser is the sum over all ranks' micro-batches
    for s in set(steps[0]):
        total = sum(x[4] for r in per_rank for x in r if x[0] == s)
        assert {x[3] for r in per_rank for x in r if x[0] == s} == {total}
    # the first epoch, as the same loaders compute it without torch.distributed (plans from local lengths)
    ref, stream = _reference(paths, world)
    for r in range(world):
        n = len(ref[r])
        assert [(x[0], x[1], x[2]) for x in per_rank[r][:n]] == [(x[0], x[1], x[2]) for x in ref[r]]
    ledger = TokenLedger(stream)
    for r in per_rank:
        ledger.add([{"segments": x[2]} for x in r])
    ledger.check_epoch(0)
    ledger.check_epoch(1)


def _first_per_step(summary):
    seen, out = set(), []
    for x in summary:
        if x[0] not in seen:
            seen.add(x[0])
            out.append(x)
    return out


def _iteration_error(loader) -> str:
    """Iterate `loader` to its end: the RuntimeError's text, or "no error"; the loader is closed either way."""
    try:
        for _ in loader:
            pass
    except RuntimeError as e:
        return str(e)
    finally:
        loader.close()
    return "no error"


def _dies(rank, world, paths, stop_after):
    """Rank 1 takes `stop_after` batches and leaves; the others keep going and must fail with a clear error."""
    loader = PackedLoader(paths, config=_config(world), num_threads=1, prefetch=1, timeout=4)
    if rank == 1:
        it = iter(loader)
        for _ in range(stop_after):
            next(it)
        loader.close()
        return "left"
    return _iteration_error(loader)


@pytest.mark.parametrize("stop_after", [0, 3])
def test_a_dead_rank_is_an_error_naming_it_not_a_hang(tmp_path, stop_after):
    from helpers.docs import token_docs, write_token_shards

    paths = write_token_shards(tmp_path, token_docs(400, seed=1), shards=2)
    results = run_ranks(_dies, 3, paths, stop_after, timeout=120)
    assert results[1] == "left"
    for msg in (results[0], results[2]):
        assert "ranks [1] did not report within 4s" in msg, msg
        assert "step " in msg


def _disagrees(rank, world, paths, differ):
    """Rank 1 builds its loader with `differ` changed; every rank must fail before the first step, naming it."""
    import torch.distributed as dist

    kw = dict(tokenizer="bytes", config=_config(world), num_threads=1, timeout=30)
    if rank == 1:
        kw.update(differ)
        if "tokens_per_step" in differ:
            kw["config"] = msgspec.structs.replace(_config(world), tokens_per_step=kw.pop("tokens_per_step"))
    try:
        loader = PackedLoader(paths[rank] if isinstance(paths[0], list) or hasattr(paths[0], "shards") else paths, **kw)
    except RuntimeError as e:
        return str(e)
    finally:
        dist.barrier()
    try:
        return _iteration_error(loader)
    finally:
        dist.barrier()


@pytest.mark.parametrize("differ,field", [
    (dict(seed=1), "seed: ranks [0] have 0, ranks [1] have 1"),
    (dict(tokens_per_step=900), "config.tokens_per_step: ranks [0] have 800, ranks [1] have 900"),
    (dict(append_eos=False), "append_eos: ranks [0] have True, ranks [1] have False"),
])
def test_ranks_configured_differently_fail_before_the_first_step_naming_the_field(tmp_path, differ, field):
    from helpers.docs import text_docs, write_text_shards

    paths = write_text_shards(tmp_path, text_docs(120, seed=2), shards=2)
    results = run_ranks(_disagrees, 2, paths, differ, timeout=120)
    for msg in results:
        assert "before the first step: ranks disagree on the loader settings" in msg and field in msg, msg


def test_a_rank_reading_a_stale_copy_of_a_shard_fails_before_the_first_step_naming_it(tmp_path):
    """Each rank reads its own copy of the shards: rank 1's copy of tok-000 is byte for byte rank 0's (another
    directory is fine), its tok-001 is a stale one with the same name and row count but other tokens. Every rank
    refuses before the first step, naming tok-001 and not tok-000."""
    import shutil

    from helpers.docs import token_docs, write_token_shards

    docs = token_docs(200, seed=10)
    paths = [write_token_shards(tmp_path, docs, shards=2)]
    (tmp_path / "copy").mkdir()
    stale = docs[:100] + token_docs(100, seed=11)  # tok-001 holds rows 100..199: same count, other documents
    stale_paths = write_token_shards(tmp_path / "copy", stale, shards=2)
    shutil.copyfile(paths[0][0], stale_paths[0])  # tok-000: an exact copy
    paths.append(stale_paths)
    results = run_ranks(_disagrees, 2, paths, {}, timeout=120)
    for msg in results:
        assert "before the first step: ranks disagree on the loader settings" in msg, msg
        assert "source.tok-001.parquet: ranks [0] have '100 rows, " in msg and "ranks [1] have '100 rows, " in msg, msg
        assert "tok-000" not in msg, msg


def test_ranks_reading_different_data_disagree_on_the_plan_naming_the_lengths(tmp_path):
    """In-memory sources with the same name and row count (nothing identifies their content, so the settings check
    passes), other contents: the step check names the lengths, on every rank."""
    from helpers.docs import token_docs

    from packloader.sources.base import IterableSource

    sources = [IterableSource(token_docs(200, seed=10 + r), name="same") for r in range(2)]
    results = run_ranks(_disagrees, 2, sources, {}, timeout=120)
    for msg in results:
        assert "step 0: ranks disagree on the plan" in msg and "ranks [0]" in msg and "ranks [1]" in msg, msg
        assert "lengths of the documents drawn for the step differ" in msg, msg
