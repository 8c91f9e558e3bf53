"""PackedLoader on one process: exactly-once coverage per epoch, tokens equal to the source's, step fields, the
over-long split, flushing a planner's queue at the epoch's end, and errors that name the field."""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.docs import text_docs, token_docs, write_text_shards, write_token_shards
from helpers.planners import DelayingPlanner

from packloader.balancers.planners.registry import available_strategies
from packloader.contracts import ParallelConfig, PlanConfig
from packloader.loader.loader import PackedLoader
from packloader.sources.base import IterableSource
from tests.helpers.ledger import TokenLedger, check_batch_tokens


def config(**kw):
    base = dict(strategy="fixed", max_tokens=256, context=256, tokens_per_step=1024)
    base.update(kw)
    return PlanConfig(**base)


def run_epochs(loader, epochs=1):
    out = []
    for _ in range(epochs):
        out.extend(loader)
    return out


# --- tests ---------------------------------------------------------------------------------------------------------


def test_every_token_once_per_epoch_and_equal_to_the_source():
    docs = token_docs()
    loader = PackedLoader(IterableSource(docs), config=config(), num_threads=2)
    batches = run_epochs(loader, 2)
    ledger = TokenLedger(loader.stream)
    ledger.add(batches)
    for e in (0, 1):
        assert ledger.check_epoch(e) == sum(len(d) for d in docs)
    cache = {}
    for b in batches:
        check_batch_tokens(b, loader.stream, cache)
        assert b.num_tokens <= 256
    # over-long documents are split, counted, never dropped
    long = [len(d) for d in docs if len(d) > 256]
    st = loader.stats
    assert st.split_documents == 2 * len(long) and st.split_pieces == 2 * sum(-(-n // 256) for n in long)
    assert st.epochs_completed == 2 and st.tokens == 2 * sum(len(d) for d in docs)
    assert [b.last_in_epoch for b in batches].count(True) == 2
    loader.close()


def test_steps_are_visible_and_loss_tokens_normalise_over_the_step():
    docs = token_docs(200, seed=1)
    loader = PackedLoader(IterableSource(docs), config=config(tokens_per_step=2000), num_threads=0)
    batches = list(loader)
    steps: dict[int, list] = {}
    for b in batches:
        steps.setdefault(b.step, []).append(b)
    assert sorted(steps) == list(range(len(steps)))
    for s, bs in steps.items():
        assert [b.index_in_step for b in bs] == list(range(len(bs)))
        assert all(b.micro_batches_in_step == len(bs) for b in bs)
        assert all(b.loss_tokens_in_step == sum(x.num_loss_tokens for x in bs) for b in bs)
        assert bs[0].plan.step == s


def test_data_parallel_ranks_share_one_plan_and_cover_each_token_once():
    docs = token_docs(250, seed=2)
    cfg = config(parallel=ParallelConfig(dp=3), tokens_per_step=3000)
    per_rank = []
    for r in range(3):
        loader = PackedLoader(IterableSource(docs), config=cfg, dp_rank=r, num_threads=1)
        per_rank.append(list(loader))
        loader.close()
    steps = [sorted({b.step for b in bs}) for bs in per_rank]
    assert steps[0] == steps[1] == steps[2]
    for s in steps[0]:
        plans = [next(b.plan for b in bs if b.step == s) for bs in per_rank]
        assert plans[0] == plans[1] == plans[2]
        counts = [sum(1 for b in bs if b.step == s) for bs in per_rank]
        assert counts[0] == counts[1] == counts[2]
        loss = sum(b.num_loss_tokens for bs in per_rank for b in bs if b.step == s)
        assert all(b.loss_tokens_in_step == loss for bs in per_rank for b in bs if b.step == s)
    ledger = TokenLedger(loader.stream)
    for bs in per_rank:
        ledger.add(bs)
    ledger.check_epoch(0)


def test_text_parquet_shards_tokenized_with_eos(tmp_path):
    texts = text_docs(150)
    paths = write_text_shards(tmp_path, texts)
    loader = PackedLoader(paths, tokenizer="bytes", config=config(), num_threads=2, chunk_docs=16)
    assert loader.lengths_mode == "local"
    batches = list(loader)
    ledger = TokenLedger(loader.stream)
    ledger.add(batches)
    assert ledger.check_epoch(0) == sum(len(t.encode()) + 1 for t in texts)  # bytes + EOS
    cache = {}
    for b in batches:
        check_batch_tokens(b, loader.stream, cache)
    eos = [b.input_ids[b.cu_seqlens[i + 1] - 1].item() for b in batches for i, s in enumerate(b.segments)
           if s.end == len(cache[s.doc])]
    assert set(eos) == {256} and len(eos) == len(texts)


def test_default_tokenizer_on_text(tmp_path):
    texts = text_docs(40)
    loader = PackedLoader(write_text_shards(tmp_path, texts, shards=2), config=config(), num_threads=1)
    batches = list(loader)
    assert loader.stream.tokenizer.name == "tekken"
    ledger = TokenLedger(loader.stream)
    ledger.add(batches)
    ledger.check_epoch(0)


def test_pretokenized_parquet_reads_lengths_from_the_column(tmp_path):
    docs = token_docs(300, seed=3)
    loader = PackedLoader(write_token_shards(tmp_path, docs), config=config(), num_threads=2)
    assert loader.lengths_mode == "column"
    batches = run_epochs(loader, 2)
    ledger = TokenLedger(loader.stream)
    ledger.add(batches)
    assert ledger.check_epoch(0) == ledger.check_epoch(1) == sum(len(d) for d in docs)
    cache = {}
    for b in batches:
        check_batch_tokens(b, loader.stream, cache)
    # the two epochs are drawn in different orders
    first = [b.doc_ids.tolist() for b in batches if b.epoch == 0]
    second = [(np.array(b.doc_ids) - len(docs)).tolist() for b in batches if b.epoch == 1]
    assert first != second


def test_pretokenized_shards_without_eos_get_it(tmp_path):
    docs = token_docs(50, seed=4)
    loader = PackedLoader(write_token_shards(tmp_path, docs, eos_appended=False), config=config(), num_threads=0)
    assert loader.stream.eos_appended and loader.stream.eos_id == 999
    batches = list(loader)
    ledger = TokenLedger(loader.stream)
    ledger.add(batches)
    assert ledger.check_epoch(0) == sum(len(d) + 1 for d in docs)


def test_threads_do_not_change_the_stream():
    docs = token_docs(200, seed=5)
    a = [(b.step, b.input_ids.tolist()) for b in PackedLoader(IterableSource(docs), config=config(), num_threads=0)]
    b = [(b.step, b.input_ids.tolist()) for b in PackedLoader(IterableSource(docs), config=config(), num_threads=3,
                                                              prefetch=4, chunk_docs=7)]
    assert a == b


def test_endless_stream_crosses_epochs():
    docs = token_docs(40, seed=6)
    loader = PackedLoader(IterableSource(docs), config=config(tokens_per_step=512), epochs=None, num_threads=1)
    epochs = []
    for i, b in enumerate(loader):
        epochs.append(b.epoch)
        if i == 200:
            break
    assert epochs[0] == 0 and epochs[-1] >= 3 and epochs == sorted(epochs)


def test_layouts_and_padding():
    docs = token_docs(60, seed=7)
    hf = list(PackedLoader(IterableSource(docs), config=config(), layout="hf", num_threads=0))
    assert all(b.input_ids.dim() == 2 and b.input_ids.shape[0] == 1 for b in hf)
    padded = list(PackedLoader(IterableSource(docs), config=config(), pad_to_multiple=8, pad_to_tokens=320,
                               pad_id=5, num_threads=0))
    assert all(b.num_tokens == 320 and b.cu_seqlens_padded[-1].item() == 320 for b in padded)
    assert sum(b.num_loss_tokens for b in padded) == sum(len(d) - 1 for d in docs)


def test_a_planners_queue_is_flushed_at_the_end_of_each_epoch():
    docs = token_docs(300, seed=8)
    cfg = config(tokens_per_step=800)
    loader = PackedLoader(IterableSource(docs), config=cfg, planner=DelayingPlanner(cfg, threshold=60),
                          num_threads=2)
    batches = run_epochs(loader, 2)
    assert loader.stats.delayed_pieces > 0
    ledger = TokenLedger(loader.stream)
    ledger.add(batches)
    ledger.check_epoch(0)
    ledger.check_epoch(1)
    # nothing of epoch 0 is trained after epoch 1 began
    epochs = [b.epoch for b in batches]
    assert epochs == sorted(epochs)
    assert all(d < len(docs) for b in batches if b.epoch == 0 for d in b.doc_ids.tolist())


@pytest.mark.parametrize("strategy", [s for s in available_strategies() if s != "fixed"])
def test_any_registered_planner_covers_every_token_once(strategy):
    try:
        from packloader.balancers.factory import make_planner

        make_planner(config(strategy=strategy))
    except (ImportError, ValueError) as e:  # a planner whose module is not there yet
        pytest.skip(f"{strategy}: {e}")
    docs = token_docs(300, seed=9)
    cfg = config(strategy=strategy, model="tiny", parallel=ParallelConfig(dp=2), tokens_per_step=1500)
    ledger = None
    for r in range(2):
        loader = PackedLoader(IterableSource(docs), config=cfg, dp_rank=r, num_threads=1)
        batches = list(loader)
        ledger = ledger or TokenLedger(loader.stream)
        ledger.add(batches)
        cache = {}
        for b in batches:
            check_batch_tokens(b, loader.stream, cache)
        loader.close()
    ledger.check_epoch(0)


def test_invalid_config_and_options_name_the_field():
    docs = token_docs(10)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.max_tokens"):
        PackedLoader(IterableSource(docs), config=PlanConfig(max_tokens=0))
    with pytest.raises(msgspec.ValidationError, match="tokens_per_stepp"):
        PackedLoader(IterableSource(docs), config={"tokens_per_stepp": 5})
    with pytest.raises(msgspec.ValidationError, match=r"\$\.pad_to_multiple"):
        PackedLoader(IterableSource(docs), config=config(), pad_to_multiple=0)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.layout"):
        PackedLoader(IterableSource(docs), config=config(), layout="bshd")
    with pytest.raises(msgspec.ValidationError, match=r"\$\.lengths"):
        PackedLoader(IterableSource(docs), config=config(), lengths="psychic")
    with pytest.raises(ValueError, match="dp_rank"):
        PackedLoader(IterableSource(docs), config=config(parallel=ParallelConfig(dp=2)))
    with pytest.raises(ValueError, match="dp_rank=2"):
        PackedLoader(IterableSource(docs), config=config(parallel=ParallelConfig(dp=2)), dp_rank=2)
    with pytest.raises(ValueError, match="length column"):
        PackedLoader(IterableSource(text_docs(5)), tokenizer="bytes", config=config(), lengths="column")
    with pytest.raises(ValueError, match="pad_to_tokens"):
        PackedLoader(IterableSource(docs), config=config(), pad_to_tokens=100)
    with pytest.raises(ValueError, match="no documents"):
        PackedLoader(IterableSource([]), config=config())
    with pytest.raises(FileNotFoundError):
        PackedLoader("/nonexistent/shards-*.parquet", config=config())


@pytest.mark.parametrize("bad,message", [
    (dict(tokens_per_step=200), r"tokens_per_step=200 is below max_tokens=256: expected tokens_per_step >= max_tokens"),
    (dict(model="llama9-1b"), r"model='llama9-1b' is not usable .*expected a model preset \(.*llama3-8b"),
    (dict(model="/nonexistent/profile.json"), r"model='/nonexistent/profile.json' is not usable"),
    (dict(context=512), r"context=512 exceeds max_tokens=256 with strategy='fixed', which does not slice"),
    (dict(context=512, strategy="slimpack", allow_slicing=False),
     r"context=512 exceeds max_tokens=256 with allow_slicing=False"),
])
def test_inconsistent_config_is_refused_at_construction(bad, message):
    """Settings that used to pass construction and fail (or not) later: refused before anything is read."""
    from packloader.loader.dataset import PackedDataset

    docs = token_docs(10)
    for make in (PackedLoader, PackedDataset):
        with pytest.raises(ValueError, match=message):
            make(IterableSource(docs), config=config(**bad))
    with pytest.raises(ValueError, match=message):  # a dict config too
        PackedLoader(IterableSource(docs), config=msgspec.to_builtins(config(**bad)))


def test_context_above_max_tokens_is_accepted_where_the_planner_slices():
    docs = token_docs(10)
    for strategy in ("slimpack", "auto"):
        PackedLoader(IterableSource(docs), config=config(context=512, strategy=strategy), num_threads=0).close()


def test_state_from_another_configuration_is_refused():
    docs = token_docs(50)
    a = PackedLoader(IterableSource(docs), config=config(), num_threads=0)
    next(iter(a))
    state = a.state_dict()
    b = PackedLoader(IterableSource(docs), config=config(), seed=1, num_threads=0)
    with pytest.raises(ValueError, match="seed: saved 0, now 1"):
        b.load_state_dict(state)
    # strict=False too: another seed's position would lose and repeat tokens
    with pytest.raises(ValueError, match="seed: saved 0, now 1"):
        b.load_state_dict(state, strict=False)
    # tokens_per_step, max_tokens and the layout may change (elastic resume); the context may not
    c = PackedLoader(IterableSource(docs), config=config(context=128), num_threads=0)
    with pytest.raises(ValueError, match="config.context: saved 256, now 128"):
        c.load_state_dict(state, strict=False)


def test_bad_rows_surface_with_file_and_row(tmp_path):
    """An error in a background reader thread reaches the trainer with the reader's own message."""
    from packloader.sources.errors import SourceError

    texts = text_docs(60)
    table = pa.table({"text": pa.array(texts[:30] + [None] + texts[31:], pa.string())})
    path = tmp_path / "broken.parquet"
    pq.write_table(table, path, row_group_size=10)
    loader = PackedLoader([str(path)], tokenizer="bytes", config=config(), num_threads=2, chunk_docs=8)
    with pytest.raises(SourceError, match=r"broken\.parquet, row 30, column 'text': null"):
        list(loader)
    loader.close()
